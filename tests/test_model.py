"""attnlab.model.transformer: blocks and whole models (decoders and encoders) against the oracle,
and their properties.

Tolerances, float64: 1e-9 where every step is computed in float64; 1e-5 for sinusoidal and RoPE
models, whose angles attnlab computes in float32 as transformers does (tests/test_positions.py
checks them).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import reference
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from styles import fields, randomize

from attnlab import Transformer
from attnlab.errors import UserError
from attnlab.model.config import ModelConfig
from attnlab.model.transformer import Block

SMALL = dict(d_vocab=11, n_ctx=16, d_model=16, n_layers=2, n_heads=2)

DECODERS = {
    "gpt2-like": fields("gpt2"),
    "llama-like": fields("llama-gqa", n_heads=4),
    "qwen-like": fields("qwen-qk-norm-partial-rope", mlp="swiglu", n_kv_heads=None, rope_theta=1e6),
    "neox-like": fields("pythia-parallel", d_model=32, n_heads=2, tie_embeddings=False),
    "sliding-window-gqa": dict(
        positional="rope", n_heads=4, n_kv_heads=2, sliding_window=3, norm="rmsnorm"
    ),
    "sinusoidal-post-norm": dict(
        positional="sinusoidal", norm_placement="post", mlp="relu", final_norm=False
    ),
    "none-attn-only": dict(positional="none", attn_only=True, n_heads=4, n_kv_heads=1),
    "d-head-scale": dict(d_head=5, n_heads=3, attn_scale=0.5, d_mlp=24, tie_embeddings=False),
    # Granite's multipliers on the embedding, each sublayer's output and the logits; and on a
    # parallel block, where both sublayers are scaled
    "granite-like": fields(
        "llama-gqa",
        n_heads=4,
        attn_scale=0.3,
        embedding_multiplier=3.0,
        residual_multiplier=0.4,
        logit_scale=0.25,
    ),
    "granite-parallel": fields("pythia-parallel", residual_multiplier=1.7, logit_scale=2.0),
    # Phi-2's bias on the LM head
    "phi2-like": fields("pythia-parallel", mlp="gelu_tanh", unembed_bias=True),
    # Gemma 3's parts with a window of 3 on one block of two and a soft-capped head
    "gemma-like": fields(
        "gemma3",
        n_heads=4,
        d_head=8,
        sliding_window=3,
        rope_theta_local=100.0,
        attn_scale=0.3,
        logit_softcap=5.0,
    ),
    # Gemma 2's attention soft-cap and OLMo 2's norms after the sublayers and over all of q and k
    "gemma2-like": fields("gemma2", n_heads=4, sliding_window=3),
    "olmo2-like": fields("olmo2", n_heads=4),
    # the speedrun's parts (modded-nanogpt) with QK-norm and an untied head
    "speedrun-like": fields(
        "speedrun-relu2-softcap", qk_norm=True, tie_embeddings=False, logit_softcap=2.0
    ),
}
ENCODERS = {
    "bert-like": dict(
        causal=False,
        norm_placement="post",
        final_norm=False,
        embed_norm=True,
        n_token_types=2,
        norm_eps=1e-12,
    ),
    "rope-encoder": dict(causal=False, positional="rope", norm="rmsnorm", n_token_types=3),
}


def tolerance(config: ModelConfig) -> dict:
    exact = config.positional in ("learned", "none")
    return dict(rtol=1e-9, atol=1e-9) if exact else dict(rtol=1e-5, atol=1e-5)


def random_model(config: ModelConfig) -> Transformer:
    """A float64 model in eval mode with every parameter from N(0, 0.3): far from the init's
    near-uniform patterns."""
    model = Transformer(config).double().eval()
    randomize(model)
    return model


def numpy_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy() for name, t in model.state_dict().items()}


def padding_mask(rng, B: int, T: int, side: str) -> np.ndarray:
    """(B, T) with 1 for real tokens: each row has 1..T real tokens, padded on the left or the
    right."""
    lengths = rng.integers(1, T + 1, size=B)
    real = np.arange(T)[None, :] < lengths[:, None]
    return (real[:, ::-1] if side == "left" else real).astype(np.int64)


def assert_matches_reference(model: Transformer, ids: np.ndarray, **inputs: np.ndarray) -> None:
    """model(ids, **inputs) on the fused path and on the explicit one equals the oracle on the same
    inputs."""
    expected = torch.from_numpy(
        reference.transformer_forward(model.config, numpy_state(model), ids, **inputs)
    )
    kwargs = {name: torch.from_numpy(value) for name, value in inputs.items()}
    fused = model(torch.from_numpy(ids), **kwargs)
    # a hook that reads every pattern sends each attention layer down the explicit path
    read_patterns = [(lambda name: name.endswith("hook_pattern"), lambda pattern, hook: None)]
    explicit = model.run_with_hooks(torch.from_numpy(ids), fwd_hooks=read_patterns, **kwargs)
    for out in (fused, explicit):
        torch.testing.assert_close(out, expected, **tolerance(model.config))


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_matches_reference(rng, name):
    config = ModelConfig(**{**SMALL, **DECODERS[name]})
    model = random_model(config)
    B, T = 3, int(rng.integers(2, 9))
    ids = rng.integers(0, config.d_vocab, size=(B, T))
    assert model(torch.from_numpy(ids)).shape == (B, T, config.d_vocab)
    assert_matches_reference(model, ids)
    mask = padding_mask(rng, B, T, "left")
    # count real tokens only, as generation does
    positions = np.clip(np.cumsum(mask, axis=-1) - 1, 0, None)
    assert_matches_reference(model, ids, attention_mask=mask, positions=positions)


@pytest.mark.parametrize("name", list(ENCODERS))
def test_encoder_matches_reference_with_token_types_and_padding(rng, name):
    config = ModelConfig(**{**SMALL, **ENCODERS[name]})
    model = random_model(config)
    B, T = 3, int(rng.integers(2, 9))
    ids = rng.integers(0, config.d_vocab, size=(B, T))
    assert model(torch.from_numpy(ids)).shape == (B, T, config.d_model)
    assert_matches_reference(model, ids)  # token types default to 0
    types = rng.integers(0, config.n_token_types, size=(B, T))
    assert_matches_reference(
        model, ids, token_type_ids=types, attention_mask=padding_mask(rng, B, T, "right")
    )


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_matches_reference(rng, placement, causal):
    config = ModelConfig(**{**SMALL, "norm_placement": placement, "causal": causal})
    block = Block(config, 0).double().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    T = int(rng.integers(1, 8))
    x = rng.normal(size=(1, T, config.d_model))
    state = {f"blocks.0.{k}": v for k, v in numpy_state(block).items()}
    expected = reference.block_forward(config, state, "blocks.0", x[0], np.arange(T), None)
    torch.testing.assert_close(
        block(torch.from_numpy(x))[0], torch.from_numpy(expected), rtol=1e-10, atol=1e-10
    )


def test_pre_and_post_norm_blocks_follow_their_equations(rng):
    """The block equations themselves, on stand-in functions: residuals around Attn and MLP, norms
    inside or after."""
    x = rng.normal(size=(3, 4))
    attn, mlp, n1, n2 = (lambda h: 2 * h), (lambda h: h**2), (lambda h: h + 1), (lambda h: -h)
    h = x + attn(n1(x))
    np.testing.assert_allclose(reference.pre_norm_block(x, attn, mlp, n1, n2), h + mlp(n2(h)))
    h = n1(x + attn(x))
    np.testing.assert_allclose(reference.post_norm_block(x, attn, mlp, n1, n2), n2(h + mlp(h)))


# --- properties
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def cached_model(positional: str, causal: bool = True) -> Transformer:
    """One small float64 model per setting, built once (hypothesis calls the tests many times)."""
    torch.manual_seed(0)
    extra = {"n_token_types": 2} if not causal else {}
    config = ModelConfig(
        **{**SMALL, "positional": positional, "causal": causal, "dropout": 0.1, **extra}
    )
    return random_model(config)


@settings(max_examples=30)
@given(positional=st.sampled_from(["learned", "sinusoidal", "rope", "none"]), data=st.data())
def test_changing_token_t_leaves_earlier_outputs_unchanged(positional, data):
    model = cached_model(positional)
    T = data.draw(st.integers(2, 10), label="T")
    t = data.draw(st.integers(0, T - 1), label="t")
    ids = torch.tensor(
        [data.draw(st.lists(st.integers(0, 10), min_size=T, max_size=T), label="ids")]
    )
    changed = ids.clone()
    changed[0, t] = (ids[0, t] + data.draw(st.integers(1, 10), label="delta")) % 11
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=1e-12, atol=1e-12)
    # while position t itself does see the change
    assert not torch.allclose(before[:, t], after[:, t])


@settings(max_examples=30)
@given(data=st.data())
def test_without_positions_an_encoder_is_order_blind(data):
    """The chapter's "order-blind": permuting the tokens (and their types) permutes the outputs,
    nothing more."""
    model = cached_model("none", causal=False)
    T = data.draw(st.integers(1, 10), label="T")
    ids = torch.tensor(
        [data.draw(st.lists(st.integers(0, 10), min_size=T, max_size=T), label="ids")]
    )
    types = torch.tensor(
        [data.draw(st.lists(st.integers(0, 1), min_size=T, max_size=T), label="types")]
    )
    perm = torch.tensor(data.draw(st.permutations(range(T)), label="perm"))
    out = model(ids, token_type_ids=types)
    permuted = model(ids[:, perm], token_type_ids=types[:, perm])
    torch.testing.assert_close(permuted, out[:, perm], rtol=1e-10, atol=1e-10)


def test_with_positions_an_encoder_sees_order():
    model = cached_model("learned", causal=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    perm = torch.tensor([3, 1, 0, 2])
    assert not torch.allclose(model(ids[:, perm]), model(ids)[:, perm])


# --- the rest of the model's contract
# -------------------------------------------------------------------


def test_loss_is_next_token_cross_entropy(rng):
    model = random_model(ModelConfig(**SMALL))
    ids = torch.from_numpy(rng.integers(0, 11, size=(2, 6)))
    targets = torch.from_numpy(rng.integers(0, 11, size=(2, 6)))
    logits = model(ids)
    expected = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(model.loss(ids, targets).double(), expected, rtol=1e-6, atol=1e-6)
    targets[0, :3] = -100  # ignored positions do not count
    kept = targets != -100
    expected = -torch.log_softmax(logits, -1)[kept].gather(-1, targets[kept][..., None]).mean()
    torch.testing.assert_close(model.loss(ids, targets).double(), expected, rtol=1e-6, atol=1e-6)


def test_tied_and_untied_heads():
    tied = Transformer(ModelConfig(**SMALL))
    assert tied.unembed.weight is tied.embed.weight
    untied = Transformer(ModelConfig(**SMALL, tie_embeddings=False))
    assert untied.unembed.weight is not untied.embed.weight
    assert untied.num_params() == tied.num_params() + 11 * 16  # a tied head is counted once
    assert tied.num_params(non_embedding=True) == tied.num_params() - 11 * 16 - 16 * 16
    assert Transformer(ModelConfig(**SMALL, causal=False)).unembed is None


def test_sandwich_norms_hook_what_joins_the_residual_stream():
    """With sandwich norms, hook_attn_out and hook_mlp_out are the normed outputs (as
    TransformerLens's ln1_post / ln2_post): the stream is still their sum."""
    config = ModelConfig(**{**SMALL, **DECODERS["gemma-like"]})
    model = random_model(config)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    _, cache = model.run_with_cache(ids)
    for layer in range(config.n_layers):
        b = f"blocks.{layer}."
        torch.testing.assert_close(
            cache[b + "hook_resid_mid"], cache[b + "hook_resid_pre"] + cache[b + "hook_attn_out"]
        )
        torch.testing.assert_close(
            cache[b + "hook_resid_post"], cache[b + "hook_resid_mid"] + cache[b + "hook_mlp_out"]
        )
        block, z = model.blocks[layer], cache[b + "attn.hook_z"]  # [batch, pos, head, d_head]
        attn = block.attn.W_O(z.flatten(-2))  # the attention layer's own output
        torch.testing.assert_close(cache[b + "hook_attn_out"], block.ln1_post(attn))
    with pytest.raises(UserError, match="sandwich norms"):
        cache.stack_head_results()


def test_logit_softcap_is_c_tanh_of_the_uncapped_logits(rng):
    capped = random_model(ModelConfig(**SMALL, logit_softcap=0.2))
    plain = random_model(ModelConfig(**SMALL))
    plain.load_state_dict(capped.state_dict())
    ids = torch.from_numpy(rng.integers(0, 11, size=(2, 7)))
    logits = plain(ids)
    assert logits.abs().max() > 0.4  # the cap has something to do
    torch.testing.assert_close(capped(ids), 0.2 * torch.tanh(logits / 0.2), rtol=1e-12, atol=1e-12)
    assert capped(ids).abs().max() < 0.2
    with pytest.raises(UserError, match="logit_softcap must be a positive number"):
        ModelConfig(**SMALL, logit_softcap=0.0)


def test_zero_init_projections_start_every_block_as_the_identity_and_still_learn():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SMALL, zero_init_projections=True, bias=False))
    for block in model.blocks:
        assert not block.attn.W_O.weight.any() and not block.mlp.W_out.weight.any()
        assert block.attn.W_Q.weight.std() > 0.01  # the rest keeps the normal init
    ids = torch.randint(0, 11, (2, 6))
    _, cache = model.run_with_cache(ids)
    torch.testing.assert_close(
        cache["blocks.1.hook_resid_post"], cache["blocks.0.hook_resid_pre"], rtol=0, atol=0
    )
    model.loss(ids, torch.randint(0, 11, (2, 6))).backward()
    assert all(
        block.attn.W_O.weight.grad.abs().sum() > 0 and block.mlp.W_out.weight.grad.abs().sum() > 0
        for block in model.blocks
    )  # a zero matrix still receives a gradient
    default = Transformer(ModelConfig(**SMALL))
    assert default.blocks[0].attn.W_O.weight.std() > 0


def test_stop_at_layer_returns_the_residual_stream_before_that_block(rng):
    model = random_model(ModelConfig(**SMALL))
    ids = torch.from_numpy(rng.integers(0, 11, size=(1, 5)))
    _, cache = model.run_with_cache(ids, names_filter="blocks.1.hook_resid_pre")
    torch.testing.assert_close(model(ids, stop_at_layer=1), cache["blocks.1.hook_resid_pre"])


def test_dropout_acts_only_in_training():
    model = cached_model("learned")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    try:
        model.train()
        assert not torch.allclose(model(ids), model(ids))
    finally:
        model.eval()
    torch.testing.assert_close(model(ids), model(ids), rtol=0, atol=0)


def test_one_dimensional_ids_are_a_batch_of_one():
    model = cached_model("learned")
    ids = torch.tensor([1, 2, 3])
    torch.testing.assert_close(model(ids), model(ids[None]))


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.tensor([[1, 11]]), r"token id 11 is outside the vocabulary \[0, 11\)"),
        (torch.tensor([[-1, 2]]), "token id -1 is outside"),
        (torch.tensor([[1.0, 2.0]]), "must be integers"),
        (torch.zeros(1, 0, dtype=torch.long), "no tokens"),
    ],
)
def test_bad_input_ids_raise_user_errors(ids, message):
    with pytest.raises(UserError, match=message):
        cached_model("learned")(ids)
