"""Positions: attention is order-blind, so order comes from here.

Design choices:
- Three encodings, as the chapter tells them: learned absolute positions (a table, GPT-2/BERT),
  sinusoids added to the embeddings (the original Transformer), and RoPE, which rotates q and k by a
  position-dependent angle so that q·k depends only on the offset between positions.
- Sinusoids and RoPE angles are computed from the positions on the fly, so a model can be run past the
  length it was trained at (the extrapolation experiment needs that); learned tables cannot, and say so.
- RoPE uses the rotate-half convention (GPT-NeoX, LLaMA, Hugging Face): dims i and i + d/2 form a pair.
  The angles are computed exactly as transformers computes them (float32 inverse frequencies times the
  float positions), so patterns match it to float rounding. A partial rotary fraction rotates only the
  first `rotary_dim` dims of each head.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    positions: any integer shape (...) -> (..., d_model), float32.
    """
    div = torch.exp(torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    angles = positions.to(torch.float32).unsqueeze(-1) * div  # (..., d_model/2)
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1)  # interleave: sin at even dims, cos at odd
    return pe.flatten(-2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (−x2, x1) on the two halves of the last dim: a 90° turn of every (i, i + d/2) pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE angles: cos and sin of pos · θ^(−2i/d) for each rotated pair, for the positions asked for."""

    def __init__(self, rotary_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin of shape (B, T, 1, rotary_dim), broadcastable over heads."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.float()  # (B, T, rotary_dim/2)
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of x [batch, pos, head, d_head]: x·cos + rotate_half(x)·sin."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
