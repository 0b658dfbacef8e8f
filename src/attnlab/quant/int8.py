"""Weights in 8 bits, one scale per output feature: `Int8Linear`.

Design choices:
- Each output feature's row w is stored as q = round(w / s) in int8 with s = max|w| / 127, one
  float32 scale per row (gpt-fast's int8 weight-only scheme; llama.cpp's Q8_0 keeps one scale per
  block of 32 instead, attnlab.quant.blocks). Symmetric, so 0 stays 0.
- Activations stay in their own dtype: y = (x qᵀ) ⊙ s + b. The forward is that equation and
  nothing faster; generation's KernelInt8Linear (attnlab.generate.fast_layers) multiplies a few
  rows in C, widening each int8 weight in registers, and is held to this one by the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """A Linear whose weight is stored in int8 with one float32 scale per output feature
    (attnlab.quantize): y = (x qᵀ) ⊙ scale + b, the activations in their own dtype, the int8
    weight widened to it where it is used."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scale", torch.ones(out_features, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Round each row of `weight` (d_out, d_in) to int8 steps of max|row| / 127 (symmetric, so 0
        stays 0)."""
        module = cls(weight.shape[1], weight.shape[0], bias is not None, weight.device)
        with torch.no_grad():
            w = weight.detach().float()
            scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
            module.weight.copy_(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            module.scale.copy_(scale)
            if bias is not None:
                module.bias.copy_(bias.detach())
        return module

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the int8 values stand for: q ⊙ scale, (d_out, d_in)."""
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def scaled(self, y: torch.Tensor) -> torch.Tensor:
        """y ⊙ scale + b, for y = x qᵀ of activations of y's dtype."""
        y = y * self.scale.to(y.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(F.linear(x, self.weight.to(x.dtype)))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, int8"
        )
