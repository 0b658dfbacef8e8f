"""attnlab.generate.loop: the KV cache gives the logits of a full forward pass, padding changes
nothing, sampling draws from the distribution it says it does, and bad arguments are refused.

Tolerance: cached and full logits in float64 agree to 1e-9 (the same float32 RoPE/sinusoid angles on
both sides).
"""

from __future__ import annotations

import pytest
import torch
from styles import randomize

from attnlab import Transformer
from attnlab.errors import UserError
from attnlab.generate.kv_cache import KVCache
from attnlab.generate.loop import decode_one_token_at_slot, generate, prefill
from attnlab.generate.sampling import filter_logits, sample_next
from attnlab.model.config import ModelConfig

BASE = dict(d_vocab=13, n_ctx=32, d_model=16, n_layers=2, n_heads=4, d_mlp=32)
CONFIGS = {
    "learned": dict(),
    "sinusoidal": dict(positional="sinusoidal"),
    "rope-partial-qk-norm": dict(
        positional="rope", rotary_fraction=0.5, qk_norm=True, norm="rmsnorm"
    ),
    "rope-gqa-swiglu": dict(
        positional="rope", n_kv_heads=2, mlp="swiglu", bias=False, tie_embeddings=False
    ),
    "none-multi-query": dict(positional="none", n_kv_heads=1),
    "post-norm-attn-only": dict(norm_placement="post", attn_only=True),
    # a window of 3, shorter than the prompt and the text: prefill, decode steps and the pattern
    # keep to the band
    "sliding-window-rope-gqa": dict(positional="rope", n_kv_heads=2, sliding_window=3),
}
F64 = dict(rtol=1e-9, atol=1e-9)


def build(overrides: dict, dtype=torch.float64) -> Transformer:
    """A small model with N(0, 0.3) parameters: confident enough that greedy choices are not
    near-ties."""
    model = Transformer(ModelConfig(**{**BASE, **overrides})).to(dtype).eval()
    randomize(model)
    return model


def read_patterns(model: Transformer):
    """fwd_hooks that read every pattern: the forward pass then takes the explicit attention
    path."""
    return [(lambda name: name.endswith("hook_pattern"), lambda pattern, hook: None)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("path", ["fused", "explicit"])
@pytest.mark.parametrize("values_position_minor", [False, True])
def test_cached_decoding_gives_the_logits_of_a_full_forward_pass(name, path, values_position_minor):
    model = build(CONFIGS[name])
    B, T = 2, 10
    ids = torch.randint(0, BASE["d_vocab"], (B, T))
    full = model(ids)
    hooks = read_patterns(model) if path == "explicit" else []
    cache = KVCache.for_model(model, B, T, values_position_minor=values_position_minor)
    with model.hooks(hooks):
        # a prompt of 4, then chunks of 1, 2 and 3 new tokens (queries are the last T of S keys)
        start = 0
        for end in (4, 5, 7, 10):
            logits = model(ids[:, start:end], kv_cache=cache, start_pos=start)
            torch.testing.assert_close(logits, full[:, start:end], **F64)
            start = end


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("values_position_minor", [False, True])
def test_prefill_and_decode_step_give_the_logits_of_a_full_forward_pass(
    name, values_position_minor
):
    """The decode step as generate runs it: a (1,) slot tensor, the whole buffer, a key mask of
    written slots."""
    model = build(CONFIGS[name])
    B, T, P, max_len = 2, 9, 4, 16
    ids = torch.randint(0, BASE["d_vocab"], (B, T))
    full = model(ids)
    cache = KVCache.for_model(model, B, max_len, values_position_minor=values_position_minor)
    # [batch, kv_head, pos, d_head] like the keys, with positions contiguous
    if values_position_minor:
        assert cache.v[0].shape == cache.k[0].shape and cache.v[0].stride(-2) == 1
    torch.testing.assert_close(prefill(model, ids[:, :P], cache), full[:, P - 1], **F64)
    key_mask = torch.zeros(B, max_len, dtype=torch.bool)
    key_mask[:, :P] = True
    for t in range(P, T):
        key_mask[:, t] = True
        slot, positions = torch.tensor([t]), torch.full((B, 1), t)
        logits = decode_one_token_at_slot(
            model, ids[:, t : t + 1], cache, slot, positions, key_mask
        )
        torch.testing.assert_close(logits, full[:, t], **F64)


@pytest.mark.parametrize("name", ["learned", "sinusoidal", "rope-gqa-swiglu", "none-multi-query"])
def test_each_row_of_a_left_padded_batch_generates_what_it_would_alone(name):
    model = build(CONFIGS[name])
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = generate(model, ids, 6, temperature=0, attention_mask=mask)
    assert batch.shape == (3, width + 6)
    assert torch.equal(batch[:, :width], ids)
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), 6, temperature=0)
        assert batch[row, width:].tolist() == alone[0, len(prompt) :].tolist()


def test_greedy_is_the_argmax_of_the_full_forward_pass_whatever_the_seed():
    model = build(CONFIGS["rope-gqa-swiglu"])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    expected = ids
    for _ in range(8):  # no cache at all: the whole sequence through the model each time
        expected = torch.cat([expected, model(expected)[:, -1].argmax(-1, keepdim=True)], dim=-1)
    for seed in (None, 0, 1):
        assert torch.equal(generate(model, ids, 8, temperature=0, seed=seed), expected)
    assert torch.equal(model.generate(ids, 8, temperature=0), expected)


def test_a_seed_makes_sampling_reproducible():
    model = build(CONFIGS["learned"], torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    first = generate(model, ids, 20, temperature=2.0, seed=7)
    assert torch.equal(first, generate(model, ids, 20, temperature=2.0, seed=7))
    others = [generate(model, ids, 20, temperature=2.0, seed=s) for s in range(8, 12)]
    assert any(not torch.equal(first, other) for other in others)
    assert ((first >= 0) & (first < BASE["d_vocab"])).all()


def test_sampling_draws_from_the_softmax():
    """Frequencies of 40,000 draws match softmax(logits / temperature) to 0.015 (≈ 6 standard
    errors)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    draws = sample_next(
        logits.expand(n, -1), temperature=0.8, generator=torch.Generator().manual_seed(0)
    )
    assert draws.shape == (n, 1)
    frequencies = torch.bincount(draws[:, 0], minlength=6).float() / n
    torch.testing.assert_close(frequencies, torch.softmax(logits / 0.8, -1), rtol=0, atol=0.015)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.randn(1, 50) * 2
    order = logits[0].argsort(descending=True)
    g = torch.Generator().manual_seed(1)
    n = 5000
    draws = sample_next(logits.expand(n, -1), top_k=5, generator=g)[:, 0]
    assert set(draws.tolist()) == set(order[:5].tolist())  # all five are reachable, nothing else
    probs = torch.softmax(logits[0], -1)[order]
    nucleus = int((probs.cumsum(0) < 0.6).sum()) + 1  # the smallest prefix whose mass reaches 0.6
    draws = sample_next(logits.expand(n, -1), top_p=0.6, generator=g)[:, 0]
    assert set(draws.tolist()) <= set(order[:nucleus].tolist())
    draws = sample_next(logits.expand(n, -1), top_k=10, top_p=0.6, generator=g)[:, 0]
    assert set(draws.tolist()) <= set(order[: min(nucleus, 10)].tolist())
    kept = torch.isfinite(filter_logits(logits, 1.0, top_k=3, top_p=None))[0]
    assert set(kept.nonzero()[:, 0].tolist()) == set(order[:3].tolist())
    # a tiny nucleus keeps the top id
    assert torch.isfinite(filter_logits(logits, 1.0, top_p=1e-6)).sum() == 1
    # below float32's smallest number: still the top id, never an empty nucleus (NaN)
    for tiny in (5e-324, 0.0):
        kept = torch.isfinite(filter_logits(logits, 1.0, top_p=tiny))[0]
        assert kept.sum() == 1 and kept[logits[0].argmax()]
    assert torch.equal(sample_next(logits, temperature=0), order[:1].view(1, 1))


def test_eos_stops_every_row_and_pads_with_it():
    model = build(CONFIGS["learned"])
    ids = torch.tensor([[1, 2, 3]])
    free = generate(model, ids, 8, temperature=0)
    eos = int(free[0, 5])  # the third generated token
    stopped = generate(model, ids, 8, temperature=0, eos_token_id=eos)
    first = int((free[0, 3:] == eos).nonzero()[0, 0]) + 3  # where eos first appears
    assert torch.equal(stopped[0, : first + 1], free[0, : first + 1])
    assert (stopped[0, first:] == eos).all() and stopped.shape == free.shape


def test_on_token_streams_each_new_column_and_the_mode_is_restored():
    model = build(CONFIGS["learned"], torch.float32).train()
    streamed = []
    ids = torch.tensor([[1, 2], [3, 4]])
    out = generate(model, ids, 5, temperature=0, on_token=streamed.append)
    assert [tuple(t.shape) for t in streamed] == [(2, 1)] * 5
    assert torch.equal(torch.cat([ids, *streamed], dim=-1), out)
    assert model.training
    assert torch.equal(generate(model, ids, 0), ids)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (dict(top_k=0), "top_k must be a positive integer, got 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(max_new_tokens=30), r"= 33 exceeds the model's context n_ctx=32"),
    ],
)
def test_bad_arguments_raise_user_errors(kwargs, message):
    model = build(CONFIGS["learned"], torch.float32)
    with pytest.raises(UserError, match=message):
        generate(model, torch.tensor([[1, 2, 3]]), **{"max_new_tokens": 4, **kwargs})


def test_an_encoder_cannot_generate_and_a_full_cache_says_so():
    encoder = build(dict(causal=False), torch.float32)
    with pytest.raises(UserError, match="generate needs a causal"):
        generate(encoder, torch.tensor([[1, 2]]), 3)
    cache = KVCache(1, 1, 1, 4, 2)
    with pytest.raises(UserError, match="holds 4 positions but generation reached 5"):
        cache.update(0, 3, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_decode_steps_read_nothing_on_the_host(monkeypatch):
    """Only the prompt's ids are range-checked (one host read); each decode step's token skips the
    check."""
    model = build(CONFIGS["learned"], torch.float32)
    checked = []
    monkeypatch.setattr(
        type(model), "_check_values", lambda self, ids, positions: checked.append(ids.shape)
    )
    generate(model, torch.tensor([[1, 2, 3]]), 5, temperature=0)
    assert checked == [(1, 3)]


def test_a_hook_on_the_final_norm_sees_every_prompt_position_in_generation():
    """prefill sends only the last position through the final norm and the LM head, except when a
    hook there expects a forward's every position."""
    model = build(CONFIGS[next(iter(CONFIGS))])
    ids = torch.randint(0, BASE["d_vocab"], (2, 7))
    seen = []
    handle = model.ln_final.register_forward_hook(lambda m, i, out: seen.append(out.shape[1]))
    try:
        generate(model, ids, 2, temperature=0)
    finally:
        handle.remove()
    assert seen[0] == 7
    widths, logits_from_resid = [], model.logits_from_resid
    model.logits_from_resid = lambda resid: (
        widths.append(resid.shape[1]) or logits_from_resid(resid)
    )
    generate(model, ids, 2, temperature=0)
    assert widths[0] == 1  # no hook: the prompt's last position only
