"""The trace view's stages (attnlab.explorer.stages) for each wiring of the block: the stages in
the order the block computes them, each hooked stage's values read from its hook in
run_with_cache's cache, the computed ones (scores, the post-norm sums) equal to what they stand
for, and the skipped ones (RoPE, an attention-only model's MLP) with no tensor."""

from __future__ import annotations

import pytest
import torch
from explorer_models import TEXT, char_tokenizer
from styles import build

from attnlab.explorer.views import Explorer

ATTENTION = ["q", "k", "v"]
SCORES = ["scores", "masked", "pattern", "z", "attn_out"]
MLP = ["mlp_pre", "mlp_post", "mlp_out"]
ROPE, NO_ROPE = ["rot_q", "rot_k"], ["rope"]

PRE = ["resid_pre", "ln1", *ATTENTION]
POST = ["resid_pre", *ATTENTION]
PRE_MLP = ["resid_mid", "ln2", *MLP, "resid_post"]
POST_MLP = ["add1", "resid_mid", *MLP, "add2", "resid_post"]
# a wiring: (a style of tests/styles.py and the changes that make the wiring, the stages of its
# blocks in order)
WIRINGS = {
    "pre": (("gpt2", {}), [*PRE, *NO_ROPE, *SCORES, *PRE_MLP]),
    "pre-rope-qk-norm-one-kv-head": (
        ("qwen-qk-norm-partial-rope", {}),
        [*PRE, *ROPE, *SCORES, *PRE_MLP],
    ),
    # Gemma 3: sandwich norms, block 0 windowed, block 1 global
    "pre-sandwich-window": (("gemma3", {}), [*PRE, *ROPE, *SCORES, *PRE_MLP]),
    # OLMo 2: norms only after attention and the MLP, none before them
    "pre-post-norms-only": (
        ("olmo2", {}),
        ["resid_pre", *ATTENTION, *ROPE, *SCORES, "resid_mid", *MLP, "resid_post"],
    ),
    # Gemma 2: its attention scores soft-capped before the mask
    "pre-sandwich-softcap": (("gemma2", {}), [*PRE, *ROPE, *SCORES, *PRE_MLP]),
    "post": (
        ("gpt-post-norm", dict(positional="sinusoidal")),
        [*POST, *NO_ROPE, *SCORES, *POST_MLP],
    ),
    # BERT: a post-norm encoder, QK-norm with no RoPE hook after it
    "post-encoder": (
        ("gpt-post-norm", dict(causal=False, qk_norm=True, final_norm=False)),
        [*POST, *NO_ROPE, *SCORES, *POST_MLP],
    ),
    "parallel": (("pythia-parallel", {}), [*PRE, *ROPE, *SCORES, "ln2", *MLP, "resid_post"]),
    "attn-only-pre": (("sinusoidal-attn-only", {}), [*PRE, *NO_ROPE, *SCORES, "resid_mid", "mlp"]),
    "attn-only-post": (
        ("sinusoidal-attn-only", dict(norm_placement="post", positional="rope")),
        [*POST, *ROPE, *SCORES, "add1", "resid_mid", "mlp"],
    ),
}

RESID, HEADS = ["pos", "d_model"], ["pos", "head", "d_head"]
SCORE, HIDDEN = ["head", "query_pos", "key_pos"], ["pos", "d_mlp"]
# the hook each hooked stage reads, under blocks.{layer}., and its dimensions
HOOKS = {
    "resid_pre": ("hook_resid_pre", RESID),
    "ln1": ("ln1.hook_normalized", RESID),
    "q": ("attn.hook_q", HEADS),
    "k": ("attn.hook_k", HEADS),
    "v": ("attn.hook_v", HEADS),
    "rot_q": ("attn.hook_rot_q", HEADS),
    "rot_k": ("attn.hook_rot_k", HEADS),
    "masked": ("attn.hook_attn_scores", SCORE),
    "pattern": ("attn.hook_pattern", SCORE),
    "z": ("attn.hook_z", HEADS),
    "attn_out": ("hook_attn_out", RESID),
    "resid_mid": ("hook_resid_mid", RESID),
    "ln2": ("ln2.hook_normalized", RESID),
    "mlp_pre": ("mlp.hook_pre", HIDDEN),
    "mlp_post": ("mlp.hook_post", HIDDEN),
    "mlp_out": ("hook_mlp_out", RESID),
    "resid_post": ("hook_resid_post", RESID),
}
# the stages computed from the cache: the residual sums of a post-norm block, before its norm
SUMS = {"add1": ("hook_resid_pre", "hook_attn_out"), "add2": ("hook_resid_mid", "hook_mlp_out")}
SKIPPED = {"rope", "mlp"}
ATOL = 1e-5


def tensor(values) -> torch.Tensor:
    """A stage's values as a tensor, None (a value that is not finite) as NaN."""
    if isinstance(values, list):
        return torch.stack([tensor(v) for v in values])
    return torch.tensor(float("nan") if values is None else values)


def close(values, expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.as_tensor(values), expected.float(), atol=ATOL, rtol=0)


def check_stage(stage: dict, cache, layer: int, token: int) -> None:
    key, p = stage["key"], f"blocks.{layer}."
    if key in SKIPPED:
        assert (stage["hook"], stage["shape"], stage["dims"], stage["values"]) == (None,) * 4
        assert stage["equation"].startswith("skipped")
    elif key in SUMS:
        first, second = (cache[p + hook][0] for hook in SUMS[key])
        assert (stage["hook"], stage["dims"], stage["shape"]) == (None, RESID, list(first.shape))
        close(stage["values"], (first + second)[token])
    elif key == "scores":  # q kᵀ / √d_head: the masked scores where the mask keeps them
        masked = cache[p + "attn.hook_attn_scores"][0]
        assert (stage["hook"], stage["dims"], stage["shape"]) == (None, SCORE, list(masked.shape))
        kept = masked[:, token].isfinite()  # [head, key_pos]
        close(torch.tensor(stage["values"])[kept], masked[:, token][kept])
    else:
        hook, dims = HOOKS[key]
        full = cache[p + hook][0]
        assert (stage["hook"], stage["dims"], stage["shape"]) == (p + hook, dims, list(full.shape))
        row = full[:, token] if dims == SCORE else full[token]
        values = tensor(stage["values"])
        assert torch.equal(values.isnan(), ~row.isfinite()), key  # -inf (masked) is sent as None
        close(values.nan_to_num(), torch.where(row.isfinite(), row, 0.0))


@pytest.mark.parametrize("wiring", WIRINGS)
def test_the_trace_shows_each_wiring_stage_by_stage_from_its_hooks(wiring, seed):
    (style, changes), keys = WIRINGS[wiring]
    tokenizer = char_tokenizer()
    model = build(style, d_vocab=tokenizer.vocab_size, **changes)
    model.tokenizer = tokenizer
    explorer = Explorer({wiring: model})
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    for layer in range(model.config.n_layers):
        for token in (0, 9, len(TEXT) - 1):
            stages = explorer.trace(wiring, TEXT, layer, token)["stages"]
            assert [s["key"] for s in stages] == keys, (layer, token)
            for stage in stages:
                check_stage(stage, cache, layer, token)
