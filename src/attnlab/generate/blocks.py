"""Weights in ggml's own blocks (Q8_0, Q4_0, Q4_1): the bytes a GGUF file holds, kept as they are.

Design choices:
- One block is 32 weights of a row with their own scale (ggml-common.h's block_q8_0, block_q4_0,
  block_q4_1, the layout llama.cpp reads):
    Q8_0, 34 bytes: d (float16), q[32] (int8);            w_j = d q_j
    Q4_0, 18 bytes: d (float16), 16 bytes of 4-bit n;     w_j = d (n_j - 8)
    Q4_1, 20 bytes: d, m (float16), 16 bytes of 4-bit n;  w_j = d n_j + m
  In Q4_0 and Q4_1, byte j holds n_j in its low four bits and n_{j+16} in its high four.
- `BlockLinear` keeps a matrix as those bytes (a uint8 tensor [d_out, blocks per row · block bytes])
  and nothing else: no float copy. Its forward is the reference: `dequantize` (the one dequantizer
  here, checked bit for bit against gguf-py's `gguf.quants.dequantize`, which nobody here wrote),
  then F.linear, so its output is a float model's on the file's values. Generation's kernel decode
  step (attnlab.generate.kernel_decoder) multiplies the blocks themselves in C instead, with the
  activation rounded to 8 bits per block of 32 as llama.cpp does (decode.c, attnlab_linear_q); the
  tests hold it to this reference within the bound that rounding implies.
- `quantize_blocks` makes the same blocks from float weights, bit-equal to gguf-py's
  `gguf.quants.quantize` (the numpy transcription of ggml's C reference that llama-quantize runs):
  attnlab.quantize(model, "q4_0" | "q4_1" | "q8_0") uses it, so a model trained here gets them too.
- `weight` is the dequantized matrix, made at each read (TransformerLens's weight views read it); it
  is a new tensor each time: writing into it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

BLOCK = 32  # weights per block (QK8_0 = QK4_0 = QK4_1 in ggml)


@dataclass(frozen=True)
class BlockType:
    name: str  # ggml's name, as GGUF's tensor types spell it
    ggml_type: int  # its number in GGUF's tensor info (GGMLQuantizationType)
    nbytes: int  # bytes per block of BLOCK weights
    kernel: int  # decode.c's attnlab_block_type (attnlab.generate.kernels.BlockKind)


BLOCK_TYPES = {
    "q8_0": BlockType("Q8_0", 8, 34, 0),
    "q4_0": BlockType("Q4_0", 2, 18, 1),
    "q4_1": BlockType("Q4_1", 3, 20, 2),
}
BY_GGML_NAME = {t.name: kind for kind, t in BLOCK_TYPES.items()}


def block_type(kind: str) -> BlockType:
    if kind not in BLOCK_TYPES:
        raise UserError(f"unknown block type {kind!r}; attnlab keeps {', '.join(BLOCK_TYPES)}")
    return BLOCK_TYPES[kind]


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block (rows of b), as float32 [n, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weights that `blocks` (uint8 [..., blocks per row · block bytes]) stand for:
    [..., blocks per row · 32], by the formulas of the module docstring."""
    t = block_type(kind)
    assert blocks.dtype == torch.uint8 and blocks.shape[-1] % t.nbytes == 0
    b = blocks.reshape(-1, t.nbytes)  # one block per row
    d = _halves(b, 0)  # [n, 1]
    if kind == "q8_0":
        w = d * b[:, 2:].contiguous().view(torch.int8).float()
    else:
        packed = b[:, 4:] if kind == "q4_1" else b[:, 2:]  # [n, 16]
        n = torch.cat([packed & 15, packed >> 4], dim=1)  # [n, 32]: low nibbles, then high
        w = d * (n.float() - 8) if kind == "q4_0" else d * n.float() + _halves(b, 2)
    return w.reshape(*blocks.shape[:-1], -1)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """roundf (ties away from zero), as ggml's quantize_row_q8_0_ref and gguf-py's np_roundf."""
    a = v.abs()
    floored = a.floor()
    return torch.sign(v) * (floored + torch.floor(2 * (a - floored)))


def quantize_blocks(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """`weight` (d_out, d_in), d_in a multiple of 32, as blocks of `kind`: uint8 [d_out, d_in / 32 ·
    block bytes], bit-equal to gguf-py's `gguf.quants.quantize` (ggml's C reference: the scale
    rounded to float16 only when stored, the weights scaled by the float32 one)."""
    t = block_type(kind)
    d_out, d_in = weight.shape
    if d_in % BLOCK:
        raise UserError(
            f"rows of {d_in} weights do not divide into {t.name} blocks of {BLOCK}; keep this "
            "matrix in float or use int8"
        )
    x = weight.detach().to(torch.float32).reshape(-1, BLOCK)  # one block per row
    half = lambda v: v.to(torch.float16).view(torch.uint8)  # noqa: E731  [n, 1] -> [n, 2]
    inverse = lambda d: torch.where(d == 0, torch.zeros_like(d), 1 / d)  # noqa: E731
    if kind == "q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        q = _round_half_away(x * inverse(d)).to(torch.int8).view(torch.uint8)
        out = torch.cat([half(d), q], dim=1)
    else:
        if kind == "q4_0":  # the weight of largest magnitude maps to -8
            top = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
            d = top / -8
            n = torch.trunc(x * inverse(d) + 8.5)
            head = half(d)
        else:
            low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
            d = (high - low) / 15
            n = torch.trunc((x - low) * inverse(d) + 0.5)
            head = torch.cat([half(d), half(low)], dim=1)
        n = n.to(torch.uint8).clamp(0, 15)
        out = torch.cat([head, n[:, :16] | (n[:, 16:] << 4)], dim=1)
    return out.reshape(d_out, d_in // BLOCK * t.nbytes)


class BlockLinear(nn.Module):
    """y = x Wᵀ + b with W kept as ggml blocks (module docstring): `blocks` uint8 [d_out, d_in / 32
    · block bytes], `kind` its type. The forward is the reference: dequantize, then F.linear."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        t = block_type(kind)
        if in_features % BLOCK:
            raise UserError(
                f"rows of {in_features} weights do not divide into {t.name} blocks of {BLOCK}"
            )
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.register_buffer(
            "blocks",
            torch.zeros(
                out_features, in_features // BLOCK * t.nbytes, dtype=torch.uint8, device=device
            ),
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_blocks(
        cls, blocks: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None
    ) -> "BlockLinear":
        """A module holding `blocks` itself (not a copy)."""
        module = cls(in_features, blocks.shape[0], kind, bias is not None, device="meta")
        if tuple(blocks.shape) != tuple(module.blocks.shape) or blocks.dtype != torch.uint8:
            raise UserError(
                f"{kind} blocks of shape {tuple(blocks.shape)} cannot hold a ({blocks.shape[0]}, "
                f"{in_features}) matrix; expected uint8 {tuple(module.blocks.shape)}"
            )
        module.blocks = blocks
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        return module

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, kind: str, bias: torch.Tensor | None = None
    ) -> "BlockLinear":
        return cls.from_blocks(quantize_blocks(weight, kind), kind, weight.shape[1], bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix the blocks stand for, (d_out, d_in)."""
        return dequantize(self.blocks, self.kind).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix, made at each read (writing into it changes nothing)."""
        return self.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {BLOCK_TYPES[self.kind].name} blocks"
        )
