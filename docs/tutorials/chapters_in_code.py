# %% 1. Queries, keys, values: a soft dictionary
import torch

import attnlab
from attnlab.model.attention import apply_mask, attention_pattern, attention_scores
from attnlab.model.positions import Rotary, apply_rope

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # three entries' keys [S, d_k]
values = torch.tensor([[10.0], [20.0], [30.0]])  # and their values [S, d_v]
query = torch.tensor([[4.0, 1.0]])  # closest to the first key [T, d_k]

scores = attention_scores(query, keys, scale=2**-0.5)  # q·kᵀ / √d_k
weights = attention_pattern(scores)  # softmax over the keys
print("weights:", weights)
print("output: ", weights @ values)  # a blend of the values, mostly the first
print("a hard lookup would give", values[scores.argmax()])

# %% 2. The causal mask
T = 4
scores = torch.randn(T, T)
pattern = attention_pattern(apply_mask(scores, causal=True))  # -inf above the diagonal
print(pattern)
print("rows sum to 1:", torch.allclose(pattern.sum(-1), torch.ones(T)))

# %% 3. A tiny model, and a change at position t that leaves the outputs before t alone
config = attnlab.preset("nano", d_vocab=3, n_layers=2, n_heads=4, d_model=16, n_ctx=8)
model = attnlab.Transformer(config).eval()
ids = torch.tensor([[0, 1, 2, 0, 1]])  # "A B C A B"
logits, cache = model.run_with_cache(ids)
changed = ids.clone()
changed[0, 3] = 2  # "A B C C B"
logits_changed = model(changed)
# up to float32's rounding: the two runs' sums may go in another order
print("positions 0-2 unchanged:", torch.allclose(logits[0, :3], logits_changed[0, :3], atol=1e-6))
print("position 3 changed:     ", not torch.allclose(logits[0, 3], logits_changed[0, 3]))

# %% 4. Heads: each its own pattern, concatenated and mixed by W_O
pattern = cache["blocks.0.attn.hook_pattern"]  # [batch, head, query_pos, key_pos]
z = cache["blocks.0.attn.hook_z"]  # [batch, pos, head, d_head]
print("pattern:", tuple(pattern.shape), " z:", tuple(z.shape))
print("head 0 and head 1 attend differently:", not torch.allclose(pattern[0, 0], pattern[0, 1]))
v = cache["blocks.0.attn.hook_v"]  # [batch, pos, head, d_head]
z_by_hand = torch.einsum("bhqk,bkhd->bqhd", pattern, v)  # each head: its pattern times its V
print("z = pattern · V, head by head:", torch.allclose(z, z_by_hand, atol=1e-6))
attn = model.blocks[0].attn
out_by_hand = attn.W_O(z.flatten(-2))  # concatenate the heads, then W_O
print("attn_out = W_O · concat(z):", torch.allclose(out_by_hand, cache["blocks.0.hook_attn_out"]))

# %% 5. Positions: RoPE makes a score depend on the offset only
rope = Rotary(rotary_dim=8)
q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)  # [batch, pos, head, d_head]


def score_at(m: int, n: int) -> float:
    """The score of q at position m against k at position n, both rotated."""
    cos_m, sin_m = rope(torch.tensor([[m]]))
    cos_n, sin_n = rope(torch.tensor([[n]]))
    return float((apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum())


print("offset 3 at 5 vs 2:  ", round(score_at(5, 2), 4), round(score_at(105, 102), 4))
print("offset 3 vs offset 4:", round(score_at(5, 2), 4), round(score_at(6, 2), 4))

# %% 6. The pre-norm block: each sublayer reads a normalized copy and adds to the stream
block = model.blocks[0]
resid_pre = cache["blocks.0.hook_resid_pre"]
resid_mid = resid_pre + block.attn(block.ln1(resid_pre))  # x + Attention(LN(x))
resid_post = resid_mid + block.mlp(block.ln2(resid_mid))  # x + MLP(LN(x))
print("resid_mid as cached: ", torch.allclose(resid_mid, cache["blocks.0.hook_resid_mid"]))
print("resid_post as cached:", torch.allclose(resid_post, cache["blocks.0.hook_resid_post"]))
next_block = cache["blocks.1.hook_resid_pre"]
print("the next block reads it:", torch.equal(cache["blocks.0.hook_resid_post"], next_block))
