"""Positions: attention is order-blind, so order comes from here.

Design choices:
- Three encodings, as the chapter tells them: learned absolute positions (a table, GPT-2/BERT),
  sinusoids added to the embeddings (the original Transformer), and RoPE, which rotates q and k by a
  position-dependent angle so that q·k depends only on the offset between positions.
- Sinusoids and RoPE angles are computed from the positions on the fly, so a model can be run past
  the length it was trained at (the extrapolation experiment needs that); learned tables cannot, and
  say so.
- RoPE uses the rotate-half convention (GPT-NeoX, LLaMA, Hugging Face): dims i and i + d/2 form a
  pair. The angles are computed exactly as transformers computes them (float32 inverse frequencies
  times the float positions), so patterns match it to float rounding. A partial rotary fraction
  rotates only the first `rotary_dim` dims of each head.
- Context extension rescales the inverse frequencies, in the same float32 steps as transformers'
  modeling_rope_utils: "linear" (position interpolation, Chen et al. 2023) divides every one by the
  factor; "llama3" (Llama 3.1/3.2) divides only those whose wavelength 2π/freq exceeds
  original_n_ctx / low_freq_factor, keeps those under original_n_ctx / high_freq_factor, and blends
  linearly in between.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    positions: any integer shape (...) -> (..., d_model), float32.
    """
    div = torch.exp(
        torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
        * (-math.log(10000.0) / d_model)
    )
    angles = positions.to(torch.float32).unsqueeze(-1) * div  # (..., d_model/2)
    # interleave: sin at even dims, cos at odd
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1)
    return pe.flatten(-2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (−x2, x1) on the two halves of the last dim: a 90° turn of every (i, i + d/2)
    pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def scale_frequencies(
    inv_freq: torch.Tensor,
    scaling: str,
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_n_ctx: int = 8192,
) -> torch.Tensor:
    """RoPE's inverse frequencies for a longer context: "none", "linear" (all / factor) or "llama3":

    wavelength λ = 2π / freq;  λ > original_n_ctx / low_freq_factor: freq / factor;  λ <
    original_n_ctx /
    high_freq_factor: freq;  else (1 − s) · freq / factor + s · freq,  s = (original_n_ctx / λ −
    low) / (high − low)
    """
    if scaling == "none":
        return inv_freq
    if scaling == "linear":
        return inv_freq / factor
    assert scaling == "llama3", scaling
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original_n_ctx / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_n_ctx / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original_n_ctx / high_freq_factor) & (
        wavelength <= original_n_ctx / low_freq_factor
    )
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """RoPE angles: cos and sin of pos · θ^(−2i/d) for each rotated pair (frequencies scaled as
    configured), for the positions asked for."""

    def __init__(
        self, rotary_dim: int, theta: float = 10000.0, scaling: str = "none", **scaling_args: float
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
        )
        self.register_buffer(
            "inv_freq", scale_frequencies(inv_freq, scaling, **scaling_args), persistent=False
        )

    @classmethod
    def for_config(cls, config, local: bool = False) -> "Rotary":
        """The model's RoPE, or with `local` the sliding-window blocks' own (rope_theta_local, no
        scaling: Gemma 3's local layers)."""
        if local:
            return cls(config.rotary_dim, config.rope_theta_local)
        return cls(
            config.rotary_dim,
            config.rope_theta,
            config.rope_scaling,
            factor=config.rope_scaling_factor,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_n_ctx=config.rope_original_n_ctx or config.n_ctx,
        )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin of shape (B, T, 1, rotary_dim), broadcastable over heads."""
        # (B, T, rotary_dim/2)
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of x [batch, pos, head, d_head]: x·cos +
    rotate_half(x)·sin."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
