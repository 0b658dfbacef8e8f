"""Memory: run_with_cache keeps only what names_filter asks for; capture_patterns equals the cached
pattern."""

import pytest
import torch

import attnlab
import attnlab.model.attention
from attnlab.inspection.capture import capture_patterns


def small(preset: str, **overrides) -> attnlab.Transformer:
    torch.manual_seed(0)
    sizes = dict(d_vocab=61, n_ctx=64, d_model=32, n_layers=3, n_heads=4)
    return attnlab.Transformer(attnlab.preset(preset, **{**sizes, **overrides})).eval()


def test_run_with_cache_stores_only_the_filtered_names(monkeypatch):
    model = small("nano")
    ids = torch.randint(61, (2, 20))
    calls = []
    real = attnlab.model.attention.attention_pattern
    monkeypatch.setattr(
        attnlab.model.attention, "attention_pattern", lambda s: calls.append(s.shape) or real(s)
    )
    _, cache = model.run_with_cache(ids, names_filter="blocks.1.attn.hook_pattern")
    assert list(cache) == ["blocks.1.attn.hook_pattern"]
    assert cache["blocks.1.attn.hook_pattern"].shape == (2, 4, 20, 20)
    # Only the hooked layer materialised a T x T pattern; the others kept torch's fused kernel.
    assert calls == [torch.Size([2, 4, 20, 20])]
    calls.clear()
    _, cache = model.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_q"))
    assert sorted(cache) == [f"blocks.{l}.attn.hook_q" for l in range(3)]
    assert calls == []
    # and nothing stays attached afterwards
    assert not any(p.has_hooks for p in model.hook_dict.values())


def test_unknown_names_in_the_filter_are_an_error():
    model = small("nano")
    with pytest.raises(attnlab.UserError, match="hook_pattern"):
        model.run_with_cache(
            torch.zeros(1, 4, dtype=torch.long), names_filter=["blocks.0.attn.hook_patern"]
        )


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("nano", {}),
        ("llama-tiny", {}),  # RoPE + grouped-query
        ("llama-tiny", {"positional": "none", "qk_norm": True}),  # QK-norm after hook_q
        ("llama-tiny", {"qk_norm": True}),  # QK-norm then RoPE
        ("llama-tiny", {"sliding_window": 9}),  # a band shorter than the text, across query chunks
        ("bert-mini", {"d_mlp": 64}),  # bidirectional
    ],
)
@pytest.mark.parametrize("chunk", [None, 7])
def test_capture_patterns_equals_the_cached_pattern(preset, overrides, chunk):
    model = small(preset, **overrides)
    ids = torch.randint(61, (2, 30))
    attention_mask = torch.ones(2, 30, dtype=torch.long)
    attention_mask[1, :5] = 0  # left padding in the second row
    kwargs = {"attention_mask": attention_mask}
    _, cache = model.run_with_cache(
        ids, names_filter=lambda n: n.endswith("hook_pattern"), **kwargs
    )
    patterns = capture_patterns(
        model, ids, layers=[0, 2], heads=[3, 1], query_chunk=chunk, **kwargs
    )
    assert sorted(patterns) == [0, 2]
    for layer, pattern in patterns.items():
        assert pattern.shape == (2, 2, 30, 30)
        torch.testing.assert_close(
            pattern, cache[f"blocks.{layer}.attn.hook_pattern"][:, [3, 1]], atol=1e-6, rtol=1e-5
        )


def test_capture_patterns_checks_its_arguments():
    model = small("nano")
    with pytest.raises(attnlab.UserError, match="layer 5"):
        capture_patterns(model, torch.zeros(1, 4, dtype=torch.long), layers=[5])
    with pytest.raises(attnlab.UserError, match="head 9"):
        capture_patterns(model, torch.zeros(1, 4, dtype=torch.long), heads=[9])
    with pytest.raises(attnlab.UserError, match="at least one layer"):
        capture_patterns(model, torch.zeros(1, 4, dtype=torch.long), layers=[])


def test_capture_patterns_long_input_keeps_one_head():
    """A 1024-token input, one head of one layer: the result is one T x T matrix, nothing else is
    kept."""
    model = small("llama-tiny", n_ctx=1024)
    ids = torch.randint(61, (1, 1024))
    patterns = capture_patterns(model, ids, layers=[1], heads=[2], query_chunk=128)
    pattern = patterns[1]
    assert pattern.shape == (1, 1, 1024, 1024)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(1, 1, 1024))
    assert (pattern.triu(1) == 0).all()
