"""attnlab.model.attention against the NumPy oracle (tests/reference.py), path against path, and its
properties.

Tolerances: float64 comparisons with the oracle use 1e-10 (they differ only by summation order);
explicit vs fused in float32 must agree to a relative error of 1e-5 (‖a − b‖∞ / ‖b‖∞).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.model.attention import Attention, causal_mask, scaled_dot_product_attention
from attnlab.model.config import ModelConfig

PATHS = ("explicit", "fused")
F64 = dict(rtol=1e-10, atol=1e-10)


def attend(q, k, v, path: str, **kwargs):
    """Output (and weights on the explicit path, else None) of scaled_dot_product_attention on one
    path."""
    if path == "explicit":
        return scaled_dot_product_attention(q, k, v, return_weights=True, **kwargs)
    return scaled_dot_product_attention(q, k, v, **kwargs), None


def tensor(x: np.ndarray, dtype=torch.float64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def random_qkv(rng, B, H, T, S, D, Dv=None, H_kv=None):
    H_kv = H_kv or H
    return (
        rng.normal(size=(B, H, T, D)),
        rng.normal(size=(B, H_kv, S, D)),
        rng.normal(size=(B, H_kv, S, Dv or D)),
    )


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# --- the chapter's equations
# -------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_matches_the_chapters_causal_attention(rng, path):
    for _ in range(5):
        T, d_k, d_v = rng.integers(1, 9), rng.integers(1, 9), rng.integers(1, 9)
        Q, K, V = rng.normal(size=(T, d_k)), rng.normal(size=(T, d_k)), rng.normal(size=(T, d_v))
        expected_out, expected_weights = reference.causal_attention(Q, K, V)
        out, weights = attend(tensor(Q), tensor(K), tensor(V), path, causal=True)
        torch.testing.assert_close(out, tensor(expected_out), **F64)
        if weights is not None:
            torch.testing.assert_close(weights, tensor(expected_weights), **F64)


def test_the_oracles_general_attention_agrees_with_the_chapters(rng):
    """Check the oracle itself: its masked attention with causal=True is the chapter's −1e9
    version."""
    Q, K, V = rng.normal(size=(5, 3)), rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    for a, b in zip(reference.attention(Q, K, V, causal=True), reference.causal_attention(Q, K, V)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    _, weights = reference.attention(Q, K, V, allowed=np.zeros((5, 5), dtype=bool))
    assert (weights == 0).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_on_random_shapes(rng, path, causal):
    """Random batch, heads, T ≤ S (causal: the queries are the last T of S positions), d_k ≠ d_v,
    scale."""
    for _ in range(6):
        B, H, S, D, Dv = (int(n) for n in rng.integers(1, 5, size=5))
        T = int(rng.integers(1, S + 1))
        scale = None if rng.random() < 0.5 else float(rng.uniform(0.1, 2.0))
        Q, K, V = random_qkv(rng, B, H, T, S, D, Dv)
        expected_out, expected_weights = reference.batched_attention(
            Q, K, V, causal=causal, scale=scale
        )
        out, weights = attend(tensor(Q), tensor(K), tensor(V), path, causal=causal, scale=scale)
        assert out.shape == (B, H, T, Dv)
        torch.testing.assert_close(out, tensor(expected_out), **F64)
        if weights is not None:
            assert weights.shape == (B, H, T, S)
            torch.testing.assert_close(weights, tensor(expected_weights), **F64)


def random_mask(rng, kind: str, B: int, H: int, T: int, S: int) -> tuple[np.ndarray, dict]:
    """A mask of the given kind and the matching reference keyword: bool, additive (with some −∞),
    padding."""
    if kind == "bool":
        allowed = rng.random((B, H, T, S)) < 0.7
        return allowed, {"allowed": allowed}
    if kind == "additive":
        # broadcast over heads, queries, batch
        shape = [(B, 1, T, S), (B, 1, 1, S), (1, H, T, S)][rng.integers(3)]
        additive = rng.normal(size=shape)
        additive[rng.random(shape) < 0.25] = -np.inf
        return additive, {"additive": additive}
    # left padding: the last `length` keys of each row are real
    lengths = rng.integers(1, S + 1, size=B)
    allowed = np.arange(S)[None, :] >= (S - lengths)[:, None]
    allowed = allowed[:, None, None, :]  # [batch, 1, 1, key_pos]
    return allowed, {"allowed": allowed}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["bool", "additive", "padding"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks_match_reference(rng, path, kind, causal):
    for _ in range(5):
        B, H, S, D = (int(n) for n in rng.integers(1, 5, size=4))
        T = int(rng.integers(1, S + 1))
        Q, K, V = random_qkv(rng, B, H, T, S, D)
        mask, ref_mask = random_mask(rng, kind, B, H, T, S)
        expected_out, expected_weights = reference.batched_attention(
            Q, K, V, causal=causal, **ref_mask
        )
        torch_mask = torch.from_numpy(mask) if mask.dtype == bool else tensor(mask)
        out, weights = attend(tensor(Q), tensor(K), tensor(V), path, causal=causal, mask=torch_mask)
        assert not out.isnan().any()
        torch.testing.assert_close(out, tensor(expected_out), **F64)
        if weights is not None:
            torch.testing.assert_close(weights, tensor(expected_weights), **F64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["none", "bool", "additive", "padding"])
def test_sliding_window_matches_reference(rng, path, kind):
    """A window smaller than the text (the queries the last T of S keys, as in cached decoding),
    with every mask."""
    for _ in range(6):
        B, H, D = (int(n) for n in rng.integers(1, 4, size=3))
        S = int(rng.integers(3, 12))
        T, window = int(rng.integers(1, S + 1)), int(rng.integers(1, S))
        Q, K, V = random_qkv(rng, B, H, T, S, D)
        mask, ref_mask = random_mask(rng, kind, B, H, T, S) if kind != "none" else (None, {})
        expected_out, expected_weights = reference.batched_attention(
            Q, K, V, causal=True, window=window, **ref_mask
        )
        torch_mask = (
            None if mask is None else torch.from_numpy(mask) if mask.dtype == bool else tensor(mask)
        )
        out, weights = attend(
            tensor(Q), tensor(K), tensor(V), path, causal=True, mask=torch_mask, window=window
        )
        torch.testing.assert_close(out, tensor(expected_out), **F64)
        if weights is not None:
            torch.testing.assert_close(weights, tensor(expected_weights), **F64)
            band = torch.from_numpy(reference.causal_allowed(T, S, window))
            assert (weights[..., ~band] == 0).all()  # nothing outside the band


@pytest.mark.parametrize("path", PATHS)
def test_attention_soft_cap_matches_reference(rng, path):
    """Gemma 2's soft-cap c: softmax(c·tanh(Q Kᵀ · scale / c) + mask) V on both paths (the fused
    one takes the explicit equation: torch's kernel has no cap), with a window and GQA; and the cap
    changes the output (scores of N(0, 1) q and k reach well past it)."""
    for _ in range(4):
        B, T, D, cap = 2, int(rng.integers(3, 10)), 8, float(rng.uniform(0.5, 2.0))
        Q, K, V = random_qkv(rng, B, 4, T, T, D, H_kv=2)
        window = int(rng.integers(2, T + 1))  # (a window of 1 sees one key: nothing to weigh)
        expected, expected_weights = reference.batched_attention(
            Q,
            np.repeat(K, 2, axis=1),
            np.repeat(V, 2, axis=1),
            causal=True,
            window=window,
            softcap=cap,
        )
        out, weights = attend(
            tensor(Q), tensor(K), tensor(V), path, causal=True, window=window, softcap=cap
        )
        torch.testing.assert_close(out, tensor(expected), **F64)
        if weights is not None:
            torch.testing.assert_close(weights, tensor(expected_weights), **F64)
        uncapped, _ = attend(tensor(Q), tensor(K), tensor(V), path, causal=True, window=window)
        assert relative_error(uncapped, out) > 1e-3


def test_sliding_window_band_is_the_query_and_the_keys_just_before_it():
    # 4 queries, the last 4 of 6 positions (2..5); each sees itself and the one before
    band = causal_mask(4, 6, window=2).int().tolist()
    assert band == [[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    # a window as long as the text: plain causal
    assert torch.equal(causal_mask(5, 5, window=5), causal_mask(5, 5))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(rng, path, kind):
    B, H, T, S, D = 2, 2, 4, 5, 3
    q, k, v = (tensor(x).requires_grad_() for x in random_qkv(rng, B, H, T, S, D))
    allowed = torch.from_numpy(rng.random((B, H, T, S)) < 0.8)
    allowed[:, :, 1] = False  # query 1 of every head sees nothing
    allowed[:, :, 2, 0] = True  # and the others at least one key
    mask = (
        allowed
        if kind == "bool"
        else torch.zeros(B, H, T, S, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    )
    out, weights = attend(q, k, v, path, mask=mask)
    assert not out.isnan().any()
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    if weights is not None:
        assert torch.equal(weights[:, :, 1], torch.zeros_like(weights[:, :, 1]))
    out.sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
    # a row that sees nothing learns nothing
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("H, H_kv", [(4, 2), (4, 1), (6, 3)])
def test_grouped_query_attention_matches_reference(rng, path, H, H_kv):
    for causal in (False, True):
        B, S, D = 2, int(rng.integers(1, 7)), int(rng.integers(1, 6))
        T = int(rng.integers(1, S + 1))
        Q, K, V = random_qkv(rng, B, H, T, S, D, H_kv=H_kv)
        allowed = rng.random((B, 1, 1, S)) < 0.8
        expected_out, expected_weights = reference.batched_attention(
            Q, K, V, causal=causal, allowed=allowed
        )
        out, weights = attend(
            tensor(Q), tensor(K), tensor(V), path, causal=causal, mask=torch.from_numpy(allowed)
        )
        torch.testing.assert_close(out, tensor(expected_out), **F64)
        if weights is not None:
            assert weights.shape == (B, H, T, S)
            torch.testing.assert_close(weights, tensor(expected_weights), **F64)


def test_grouped_query_heads_that_do_not_divide_are_refused():
    q, kv = torch.randn(1, 4, 3, 2), torch.randn(1, 3, 3, 2)
    with pytest.raises(ValueError, match="multiple"):
        scaled_dot_product_attention(q, kv, kv, return_weights=True)


def test_causal_with_more_queries_than_keys_is_refused():
    q, kv = torch.randn(1, 4, 2), torch.randn(1, 3, 2)
    for return_weights in (False, True):
        with pytest.raises(ValueError, match="T=4 queries, S=3 keys"):
            scaled_dot_product_attention(q, kv, kv, causal=True, return_weights=return_weights)


def test_causal_mask_puts_the_queries_last():
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert torch.equal(causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


# --- the two paths
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [None, "bool", "additive", "padding"])
def test_explicit_and_fused_paths_agree_in_float32(rng, kind):
    for _ in range(6):
        B, H, S, D = (int(n) for n in rng.integers(1, 6, size=4))
        D *= 8
        T = int(rng.integers(1, S + 1))
        causal = bool(rng.random() < 0.5)
        q, k, v = (tensor(x, torch.float32) for x in random_qkv(rng, B, H, T, S, D))
        mask = None
        if kind is not None:
            m, _ = random_mask(rng, kind, B, H, T, S)
            mask = torch.from_numpy(m) if m.dtype == bool else tensor(m, torch.float32)
        explicit, _ = attend(q, k, v, "explicit", causal=causal, mask=mask)
        fused, _ = attend(q, k, v, "fused", causal=causal, mask=mask)
        assert relative_error(fused, explicit) <= 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_in_float64(rng, path):
    B, H, T, S, D = 1, 2, 3, 4, 3
    q, k, v = (tensor(x).requires_grad_() for x in random_qkv(rng, B, H, T, S, D))
    allowed = torch.from_numpy(rng.random((B, 1, T, S)) < 0.7)
    allowed[..., -1] = True  # every query sees its own position, so no row is fully masked
    for kwargs in (
        dict(causal=True),
        dict(mask=allowed),
        dict(causal=True, mask=allowed),
        dict(scale=0.7),
    ):
        if path == "explicit":
            fn = lambda q, k, v: scaled_dot_product_attention(
                q, k, v, return_weights=True, **kwargs
            )  # noqa: E731
        else:
            fn = lambda q, k, v: scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
        # the full Jacobian once; random projections of it (fast_mode) for the masked variants
        assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=kwargs != dict(causal=True))


# --- properties
# -------------------------------------------------------------------------------------

shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.integers(0, 4), st.integers(1, 6)
)  # B, H, T, extra keys S − T, D


def qkv_from(seed: int, B, H, T, S, D, magnitude: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, H, n, D, generator=g, dtype=torch.float64) * magnitude for n in (T, S, S)
    )


@settings(max_examples=40)
@given(
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    causal=st.booleans(),
    magnitude=st.sampled_from([0.01, 1.0, 30.0, 1e3]),
)
def test_pattern_rows_sum_to_one_and_causal_is_zero_above_the_diagonal(
    shape, seed, causal, magnitude
):
    B, H, T, extra, D = shape
    S = T + extra
    q, k, v = qkv_from(seed, B, H, T, S, D, magnitude)
    out, weights = scaled_dot_product_attention(q, k, v, causal=causal, return_weights=True)
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T, dtype=torch.float64))
    if causal:
        assert (weights.masked_select(~causal_mask(T, S)) == 0).all()


@settings(max_examples=40)
@given(shape=shapes, seed=st.integers(0, 2**32 - 1), causal=st.booleans())
def test_equal_keys_give_uniform_weights(shape, seed, causal):
    """If every key is the same, every query matches them equally: weights 1/(keys it may see),
    output = their mean."""
    B, H, T, extra, D = shape
    S = T + extra
    q, k, v = qkv_from(seed, B, H, T, S, D)
    k = k[:, :, :1].expand(B, H, S, D)
    out, weights = scaled_dot_product_attention(q, k, v, causal=causal, return_weights=True)
    visible = causal_mask(T, S) if causal else torch.ones(T, S, dtype=torch.bool)
    uniform = visible / visible.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, uniform.to(torch.float64).expand(B, H, T, S))
    torch.testing.assert_close(out, torch.matmul(uniform.to(torch.float64), v))
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, causal=causal), out)


def test_the_chapters_a_b_c_walk_through(rng):
    """Three tokens "A B C" attending causally: A sees only A, B sees A and B, C sees all three."""
    X = rng.normal(size=(3, 4))  # one embedding per token
    out, pattern = scaled_dot_product_attention(
        tensor(X), tensor(X), tensor(X), causal=True, return_weights=True
    )
    assert pattern.shape == (3, 3)
    assert torch.equal(pattern, pattern.tril())  # lower-triangular: no token looks ahead
    torch.testing.assert_close(pattern.sum(-1), torch.ones(3, dtype=torch.float64))
    assert pattern[0, 0] == 1.0  # A can only attend to itself
    torch.testing.assert_close(out[0], tensor(X[0]))
    expected_out, expected_pattern = reference.causal_attention(X, X, X)
    torch.testing.assert_close(pattern, tensor(expected_pattern), **F64)
    torch.testing.assert_close(out, tensor(expected_out), **F64)


# --- the multi-head layer
# ----------------------------------------------------------------------------

LAYER_CONFIGS = {
    "multi-head": dict(n_heads=2),
    "grouped-query": dict(n_heads=4, n_kv_heads=2, bias=False),
    "multi-query": dict(n_heads=3, n_kv_heads=1, d_head=5),
    "qkv-bias-only": dict(n_heads=2, bias=False, qkv_bias=True),
    "qk-norm-rope": dict(n_heads=2, qk_norm=True, positional="rope"),
    "partial-rope": dict(
        n_heads=2, n_kv_heads=1, d_head=8, positional="rope", rotary_fraction=0.5, rope_theta=100.0
    ),
    "encoder-scale": dict(n_heads=2, causal=False, attn_scale=0.3),
    "sliding-window": dict(n_heads=2, n_kv_heads=1, positional="rope", sliding_window=2),
}


def layer_state(layer: Attention) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy() for name, p in layer.state_dict().items()}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_multi_head_layer_matches_reference(rng, path, name):
    config = ModelConfig(d_model=12, d_vocab=8, n_layers=1, **LAYER_CONFIGS[name])
    layer = Attention(config, 0).double().eval()
    with torch.no_grad():
        # larger than the init's 0.02 so the pattern is far from uniform
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    if path == "explicit":
        layer.hook_pattern.add_hook(lambda pattern, hook: None)
    assert layer.needs_pattern == (path == "explicit")
    B, T = 2, int(rng.integers(1, 7))
    X = rng.normal(size=(B, T, config.d_model))
    allowed = rng.random((B, T)) < 0.8
    allowed[:, -1] = True
    rope = None
    positions = np.arange(T) + int(rng.integers(0, 5))
    if config.positional == "rope":
        angles = reference.rope_angles(positions, config.rotary_dim, config.rope_theta)
        # [1, pos, 1, rotary_dim]
        angles = np.concatenate([angles, angles], axis=-1)[None, :, None, :]
        rope = (tensor(np.cos(angles)), tensor(np.sin(angles)))
    out = layer(tensor(X), rope=rope, mask=torch.from_numpy(allowed)[:, None, None, :])
    state = layer_state(layer)
    for b in range(B):
        expected = reference.multi_head_attention(
            X[b],
            state["W_Q.weight"],
            state["W_K.weight"],
            state["W_V.weight"],
            state["W_O.weight"],
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            b_Q=state.get("W_Q.bias"),
            b_K=state.get("W_K.bias"),
            b_V=state.get("W_V.bias"),
            b_O=state.get("W_O.bias"),
            scale=config.scale,
            causal=config.causal,
            allowed=allowed[b][None, :],
            q_norm=state.get("q_norm.weight"),
            k_norm=state.get("k_norm.weight"),
            norm_eps=config.norm_eps,
            rope=(positions, config.rotary_dim, config.rope_theta) if rope is not None else None,
            window=config.sliding_window,
        )
        torch.testing.assert_close(out[b], tensor(expected), **F64)


def test_multi_head_layer_has_the_configured_parameters():
    config = ModelConfig(
        d_model=16, n_heads=4, n_kv_heads=2, d_head=6, bias=False, qkv_bias=True, qk_norm=True
    )
    layer = Attention(config, 0)
    assert layer.W_Q.weight.shape == (4 * 6, 16) and layer.W_K.weight.shape == (2 * 6, 16)
    assert layer.W_V.weight.shape == (2 * 6, 16) and layer.W_O.weight.shape == (16, 4 * 6)
    assert layer.W_Q.bias is not None and layer.W_O.bias is None
    assert layer.q_norm.weight.shape == (6,) and layer.k_norm.weight.shape == (6,)
