"""attnlab.model.positions: sinusoids and RoPE against the oracle, and RoPE's defining properties.

Tolerances: apply_rope with given cos/sin is exact in float64 (1e-12). attnlab computes the angles
themselves in float32, as transformers does, so cos/sin tables and sinusoids agree with the float64
oracle to float32 rounding of pos·θ (1e-5 for the positions used here).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import reference
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import Transformer
from attnlab.errors import UserError
from attnlab.model.config import ModelConfig
from attnlab.model.positions import Rotary, apply_rope, rotate_half, sinusoidal_positions

F32_ANGLES = dict(rtol=0, atol=1e-5)


@pytest.mark.parametrize("d_model", [2, 8, 64])
def test_sinusoids_match_the_original_transformer(d_model):
    positions = torch.arange(100)
    pe = sinusoidal_positions(positions, d_model)
    assert pe.shape == (100, d_model) and pe.dtype == torch.float32
    expected = reference.sinusoidal_positions(np.arange(100), d_model)
    torch.testing.assert_close(pe.double(), torch.from_numpy(expected), **F32_ANGLES)
    assert torch.equal(pe[0, 0::2], torch.zeros(d_model // 2)) and torch.equal(
        pe[0, 1::2], torch.ones(d_model // 2)
    )


def test_sinusoids_accept_any_batch_shape():
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    pe = sinusoidal_positions(positions, 6)
    assert pe.shape == (2, 3, 6)
    torch.testing.assert_close(pe[1, 0], sinusoidal_positions(torch.tensor([5]), 6)[0])


@pytest.mark.parametrize("rotary_dim, theta", [(8, 10000.0), (4, 100.0), (16, 500000.0)])
def test_rotary_angles_match_reference(rotary_dim, theta):
    positions = torch.arange(50).reshape(2, 25)
    cos, sin = Rotary(rotary_dim, theta)(positions)
    assert cos.shape == (2, 25, 1, rotary_dim)
    angles = reference.rope_angles(positions.numpy(), rotary_dim, theta)
    angles = np.concatenate([angles, angles], axis=-1)[:, :, None, :]
    torch.testing.assert_close(cos.double(), torch.from_numpy(np.cos(angles)), **F32_ANGLES)
    torch.testing.assert_close(sin.double(), torch.from_numpy(np.sin(angles)), **F32_ANGLES)
    assert Rotary(rotary_dim, theta)(positions, torch.float64)[0].dtype == torch.float64


def reference_cos_sin(
    positions: np.ndarray, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 cos/sin tables [batch, pos, 1, rotary_dim] from the oracle's angles."""
    angles = reference.rope_angles(positions, rotary_dim, theta)
    angles = np.concatenate([angles, angles], axis=-1)[..., None, :]
    return torch.from_numpy(np.cos(angles)), torch.from_numpy(np.sin(angles))


@pytest.mark.parametrize("d_head, rotary_dim", [(8, 8), (8, 4), (10, 2), (6, 6)])
def test_apply_rope_rotates_each_pair_as_the_equation_says(rng, d_head, rotary_dim):
    B, T, H, theta = 2, 5, 3, float(rng.choice([10.0, 10000.0]))
    x = rng.normal(size=(B, T, H, d_head))
    positions = rng.integers(0, 100, size=(B, T))
    cos, sin = reference_cos_sin(positions, rotary_dim, theta)
    out = apply_rope(torch.from_numpy(x), cos, sin)
    expected = reference.apply_rope(np.swapaxes(x, 1, 2), positions[:, None, :], rotary_dim, theta)
    torch.testing.assert_close(
        out, torch.from_numpy(np.swapaxes(expected, 1, 2)), rtol=1e-12, atol=1e-12
    )
    # partial: the rest untouched
    assert torch.equal(out[..., rotary_dim:], torch.from_numpy(x[..., rotary_dim:]))


def test_rotate_half_is_a_quarter_turn():
    x = torch.arange(1.0, 7.0)
    assert rotate_half(x).tolist() == [-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]
    torch.testing.assert_close(rotate_half(rotate_half(x)), -x)  # two quarter turns: a half turn
    assert float(x @ rotate_half(x)) == 0.0  # perpendicular


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    i=st.integers(0, 60),
    j=st.integers(0, 60),
    shift=st.integers(0, 60),
    half=st.integers(1, 6),
    theta=st.sampled_from([10.0, 10000.0, 1e6]),
)
def test_rope_scores_depend_only_on_the_offset(seed, i, j, shift, half, theta):
    """⟨R(i) q, R(j) k⟩ = ⟨R(i + s) q, R(j + s) k⟩: RoPE scores see i − j, not where the pair
    sits."""
    d_head = 2 * half
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, d_head, generator=g, dtype=torch.float64)
    rotary = Rotary(d_head, theta)

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        cos, sin = rotary(torch.tensor([[pos_q, pos_k]]), torch.float64)  # [1, 2, 1, d_head]
        rotated = apply_rope(torch.stack([q, k])[None, :, None, :], cos, sin)[0, :, 0]
        return rotated[0] @ rotated[1]

    scale = float(q.norm() * k.norm())
    torch.testing.assert_close(score(i, j), score(i + shift, j + shift), rtol=0, atol=1e-4 * scale)
    if i == j:  # no offset: no rotation between them at all
        torch.testing.assert_close(score(i, j), q @ k, rtol=0, atol=1e-5 * scale)


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    positions=st.lists(st.integers(0, 10_000), min_size=1, max_size=6),
    half=st.integers(1, 6),
    rotated_half=st.integers(1, 6),
)
def test_rope_preserves_norms(seed, positions, half, rotated_half):
    rotary_dim = 2 * min(rotated_half, half)
    g = torch.Generator().manual_seed(seed)
    # [batch, pos, head, d_head]
    x = torch.randn(1, len(positions), 2, 2 * half, generator=g, dtype=torch.float64)
    cos, sin = Rotary(rotary_dim)(torch.tensor([positions]), torch.float64)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-12)


def test_learned_positions_stop_at_n_ctx_but_computed_ones_extrapolate():
    ids = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(UserError, match="n_ctx=8"):
        Transformer(ModelConfig(d_vocab=5, n_ctx=8, d_model=8, n_layers=1, n_heads=2))(ids)
    for positional in ("sinusoidal", "rope", "none"):
        model = Transformer(
            ModelConfig(d_vocab=5, n_ctx=8, d_model=8, n_layers=1, n_heads=2, positional=positional)
        )
        assert torch.isfinite(model(ids)).all()


def test_positional_settings_build_the_right_parts():
    base = dict(d_vocab=5, n_ctx=8, d_model=8, n_layers=1, n_heads=2)
    assert Transformer(ModelConfig(**base)).pos_embed.weight.shape == (8, 8)
    for positional in ("sinusoidal", "rope", "none"):
        model = Transformer(ModelConfig(**base, positional=positional))
        assert model.pos_embed is None and (model.rotary is not None) == (positional == "rope")
    assert (
        Transformer(ModelConfig(**base, positional="rope", rotary_fraction=0.5)).rotary.rotary_dim
        == 2
    )


def test_the_oracles_rope_is_a_complex_rotation(rng):
    """Check the oracle itself: pair (x_i, x_{i+d/2}) as the complex number x_i + i·x_{i+d/2}, times
    e^{iθ}."""
    d, positions = 8, np.arange(6)
    x = rng.normal(size=(6, d))
    z = (x[:, : d // 2] + 1j * x[:, d // 2 :]) * np.exp(
        1j * reference.rope_angles(positions, d, 10000.0)
    )
    np.testing.assert_allclose(
        reference.apply_rope(x, positions, d), np.concatenate([z.real, z.imag], -1), atol=1e-12
    )


def test_linear_rope_scaling_is_position_interpolation_and_llama3_keeps_short_wavelengths():
    """linear: the angles at position p are the unscaled ones at p / factor (Chen et al. 2023).
    llama3: wavelengths under original_n_ctx / high_freq_factor are untouched, those over
    original_n_ctx / low_freq_factor divided by the factor, and those between lie between the
    two."""
    positions = torch.tensor([[0, 4, 12, 100]])
    plain, linear = Rotary(16, 100.0), Rotary(16, 100.0, "linear", factor=4.0)
    torch.testing.assert_close(linear(positions)[0], plain(positions // 4)[0], rtol=0, atol=1e-6)
    freq = plain.inv_freq
    llama3 = Rotary(
        16,
        100.0,
        "llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_n_ctx=64,
    ).inv_freq
    wavelength = 2 * math.pi / freq
    short, long = wavelength < 64 / 4, wavelength > 64
    assert short.any() and long.any() and (~short & ~long).any()  # all three bands are checked
    torch.testing.assert_close(llama3[short], freq[short])
    torch.testing.assert_close(llama3[long], freq[long] / 8)
    between = ~short & ~long
    assert ((llama3[between] < freq[between]) & (llama3[between] > freq[between] / 8)).all()
