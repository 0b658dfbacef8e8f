"""Weights in ggml's own blocks (Q8_0, Q4_0, Q4_1, Q5_0 and the K-quants Q4_K, Q5_K, Q6_K): the
bytes a GGUF file holds, kept as they are.

Design choices:
- One block is 32 weights of a row with their own scale (ggml-common.h's block_q8_0, block_q4_0,
  block_q4_1, the layout llama.cpp reads):
    Q8_0, 34 bytes: d (float16), q[32] (int8);            w_j = d q_j
    Q4_0, 18 bytes: d (float16), 16 bytes of 4-bit n;     w_j = d (n_j - 8)
    Q4_1, 20 bytes: d, m (float16), 16 bytes of 4-bit n;  w_j = d n_j + m
  In Q4_0 and Q4_1, byte j holds n_j in its low four bits and n_{j+16} in its high four.
- What a GGUF file holds beyond those (ggml-common.h's block_q5_0, block_q4_K, block_q5_K,
  block_q6_K), read and multiplied as they are but never made here (`attnlab.quantize` offers
  the three above):
    Q5_0, 22 bytes per 32: d, qh (the 32 fifth bits), 16 bytes of nibbles;  w_j = d (n_j - 16)
    Q4_K, 144 bytes per 256: d, dmin, 12 bytes of eight 6-bit scales sc and mins m, 128 of nibbles;
          sub-block s of 32 weights: w = d sc_s n - dmin m_s
    Q5_K, 176 bytes per 256: Q4_K's head, 32 bytes of fifth bits, 128 of nibbles; as Q4_K
    Q6_K, 210 bytes per 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per
          16 weights), d;  w = d sc (n - 32)
  A K-quant's rows must be whole blocks of 256 (the GGUF reader checks that of every tensor).
- `BlockLinear` keeps a matrix as those bytes (a uint8 tensor [d_out, blocks per row · block bytes])
  and nothing else: no float copy. Its forward is the reference: `dequantize` (the one dequantizer
  here, checked bit for bit against gguf-py's `gguf.quants.dequantize`, which nobody here wrote),
  then F.linear, so its output is a float model's on the file's values. Generation's kernel decode
  step (attnlab.generate.kernel_decoder) multiplies the blocks themselves in C instead, with the
  activation rounded to 8 bits per block of 32 as llama.cpp does (linear_q.c, attnlab_linear_q); the
  tests hold it to this reference within the bound that rounding implies.
- `quantize_blocks` makes the same blocks from float weights, bit-equal to gguf-py's
  `gguf.quants.quantize` (the numpy transcription of ggml's C reference that llama-quantize runs):
  attnlab.quantize(model, "q4_0" | "q4_1" | "q8_0") uses it, so a model trained here gets them too.
- One copy of a matrix: generation's decode products read some kinds faster from sixteen rows'
  blocks interleaved (the 16-row layout, c/repack.c's attnlab_repack16), and a BlockLinear then
  holds its blocks in that layout *instead of* the file's (`interleaved`), not beside it. What reads
  the file's layout (the dequantizer, a prompt's tiled products, saving) gets it back from
  `file_blocks()`, a matrix at a time (`deinterleave16`: the layout's permutation of bytes undone in
  torch, checked against the C repack); a state dict holds the file's layout, and loading one puts
  the module back in it.
- The forward dequantizes a matrix of more than SLICE_FLOATS weights a slice of rows at a time
  (its output columns concatenated), so a forward pass holds no whole float copy of an LM head.
- `weight` is the dequantized matrix, made at each read (TransformerLens's weight views read it); it
  is a new tensor each time: writing into it changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
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
    nbytes: int  # bytes per block
    kernel: int  # the C kernels' attnlab_block_type (attnlab.generate.kernels.BlockKind)
    weights: int = BLOCK  # weights per block (QK_K = 256 for the K-quants)

    def row_bytes(self, d_in: int) -> int:
        """Bytes of one row of d_in weights (a whole number of blocks)."""
        return d_in // self.weights * self.nbytes


BLOCK_TYPES = {
    "q8_0": BlockType("Q8_0", 8, 34, 0),
    "q4_0": BlockType("Q4_0", 2, 18, 1),
    "q4_1": BlockType("Q4_1", 3, 20, 2),
    "q5_0": BlockType("Q5_0", 6, 22, 3),
    "q4_k": BlockType("Q4_K", 12, 144, 4, 256),
    "q5_k": BlockType("Q5_K", 13, 176, 5, 256),
    "q6_k": BlockType("Q6_K", 14, 210, 6, 256),
}
# the types attnlab.quantize makes from float weights (quantize_blocks)
QUANTIZABLE = ("q8_0", "q4_0", "q4_1")
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
    if kind not in QUANTIZABLE:
        return _dequantize_more(b, kind).reshape(*blocks.shape[:-1], -1)
    d = _halves(b, 0)  # [n, 1]
    if kind == "q8_0":
        w = d * b[:, 2:].contiguous().view(torch.int8).float()
    else:
        packed = b[:, 4:] if kind == "q4_1" else b[:, 2:]  # [n, 16]
        n = torch.cat([packed & 15, packed >> 4], dim=1)  # [n, 32]: low nibbles, then high
        w = d * (n.float() - 8) if kind == "q4_0" else d * n.float() + _halves(b, 2)
    return w.reshape(*blocks.shape[:-1], -1)


GROUP = 16  # rows interleaved in the 16-row layout (c/repack.c)
# the most float32 weights BlockLinear's forward dequantizes at once (64 MB): a larger matrix is
# multiplied a slice of its rows at a time
SLICE_FLOATS = 16 << 20


def deinterleave16(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The file's layout of `blocks` (uint8 [d_out, row bytes], d_out a multiple of 16) held in the
    16-row layout: per group of 16 rows and per block, the quants in 64-byte chunks whose lane n (4
    bytes) is row n's quant bytes 4j .. 4j + 3, then the 16 d's, then (Q4_1) the 16 m's; Q4_K: its
    128 quant bytes so, the 16 d's, the 16 dmin's, then its 12 bytes of scales and mins as 3 chunks
    of the same kind. A new tensor."""
    t = block_type(kind)
    d_out = blocks.shape[0]
    g = blocks.reshape(d_out // GROUP, -1, GROUP * t.nbytes)  # [group, block, 16 rows' bytes]
    G, nb = g.shape[:2]

    def lanes(start: int, end: int, width: int) -> torch.Tensor:
        """bytes start..end of each group's block, lane-major ([chunk][16 rows][width]), as
        [group, block, row, chunk · width]."""
        part = g[..., start:end].reshape(G, nb, -1, GROUP, width)
        return part.transpose(2, 3).reshape(G, nb, GROUP, -1)

    if kind == "q4_k":  # 128 quant bytes, d, dmin, 12 bytes of scales (ggml's block_q4_K)
        quants, heads = 128 * GROUP, 128 * GROUP + 64
        parts = [
            lanes(quants, quants + 32, 2),
            lanes(quants + 32, heads, 2),
            lanes(heads, heads + 12 * GROUP, 4),
            lanes(0, quants, 4),
        ]
    else:  # d (Q4_1: d, m), then the quants (Q5_0's qh among them)
        head = 4 if kind == "q4_1" else 2
        quants = (t.nbytes - head) * GROUP
        parts = [lanes(quants + 32 * i, quants + 32 * (i + 1), 2) for i in range(head // 2)]
        parts.append(lanes(0, quants, 4))
    return torch.cat(parts, dim=3).transpose(1, 2).reshape(d_out, -1)


def _bits(v: torch.Tensor, shifts: list[int], mask: int, dim: int) -> torch.Tensor:
    """(v >> s) & mask for each s in shifts, stacked along a new dimension `dim`."""
    return torch.stack([(v >> s) & mask for s in shifts], dim=dim)


def _dequantize_more(b: torch.Tensor, kind: str) -> torch.Tensor:
    """Q5_0 and the K-quants (module docstring): b [n, block bytes] -> [n, weights per block], in
    gguf-py's order of float32 operations (its `quants.dequantize`), so equal to it bit for bit."""
    n = b.shape[0]
    if kind == "q5_0":
        qh = sum(b[:, 2 + i : 3 + i].long() << (8 * i) for i in range(4))  # [n, 1], little-endian
        high = (qh >> torch.arange(32)) & 1  # [n, 32]
        low = torch.cat([b[:, 6:] & 15, b[:, 6:] >> 4], dim=1)
        return _halves(b, 0) * ((low | (high.to(torch.uint8) << 4)).float() - 16)
    if kind == "q6_k":
        low = _bits(b[:, :128].reshape(n, 2, 64), [0, 4], 15, 2).reshape(n, 8, 32)
        high = _bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 3, 2).reshape(n, 8, 32)
        q = (low | (high << 4)).float() - 32  # [n, 8 sub-blocks, 32]
        scales = b[:, 192:208].contiguous().view(torch.int8).float()  # one per 16 weights
        d = _halves(b, 208) * scales  # [n, 16]
        return (d[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)
    # Q4_K, Q5_K: the eight 6-bit scales and mins of bytes 4-15 (ggml's get_scale_min_k4)
    s = b[:, 4:16].reshape(n, 3, 4).int()
    sc = torch.cat([s[:, 0] & 63, (s[:, 2] & 15) | ((s[:, 0] >> 2) & 48)], dim=1)  # [n, 8]
    m = torch.cat([s[:, 1] & 63, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 48)], dim=1)
    d = (_halves(b, 0) * sc.float())[:, :, None]  # [n, 8, 1]
    dm = (_halves(b, 2) * m.float())[:, :, None]
    qs = b[:, 48:] if kind == "q5_k" else b[:, 16:]  # sub-blocks 2i, 2i + 1: bytes 32i.. low, high
    q = _bits(qs.reshape(n, 4, 32), [0, 4], 15, 2).reshape(n, 8, 32)
    if kind == "q5_k":  # bit s of byte j: the fifth bit of weight j of sub-block s
        q = q | (_bits(b[:, 16:48], list(range(8)), 1, 1) << 4)
    return (d * q.float() - dm).reshape(n, 256)


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
    if kind not in QUANTIZABLE:
        raise UserError(
            f"attnlab reads {t.name} blocks from GGUF files but does not make them; quantize to "
            f"{', '.join(QUANTIZABLE)}"
        )
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
        parts = [half(d), q]
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
        parts = [head, n[:, :16] | (n[:, 16:] << 4)]
    # written through a view of the tensor returned, which is no view itself: a view's base would
    # keep these bytes alive beside the copy generation moves the blocks into (2 MB pages)
    blocks = torch.empty(d_out, d_in // BLOCK * t.nbytes, dtype=torch.uint8, device=x.device)
    torch.cat(parts, dim=1, out=blocks.view(-1, t.nbytes))  # [block, block bytes]
    return blocks


def weight_rows(module: nn.Module, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a Linear's or an Embedding's weight (d_out or d_vocab first) in float32,
    dequantized from its blocks where it keeps them: a slice of a large matrix (an embedding or LM
    head of 128k rows) without its whole float copy. The 16-row layout is undone for the groups of
    16 rows the slice touches only."""
    if isinstance(module, BlockLinear | BlockEmbedding):
        if getattr(module, "interleaved", False):
            a, b = start // GROUP * GROUP, -(-end // GROUP) * GROUP
            rows = deinterleave16(module.blocks[a:b], module.kind)[start - a : end - a]
        else:
            rows = module.blocks[start:end]
        return dequantize(rows, module.kind)
    return module.weight[start:end].float()


class BlockLinear(nn.Module):
    """y = x Wᵀ + b with W kept as ggml blocks (module docstring): `blocks` uint8 [d_out, d_in / 32
    · block bytes], `kind` its type, in the file's layout or (`interleaved`) the 16-row one. The
    forward is the reference: dequantize, then F.linear."""

    interleaved = False  # blocks in the 16-row layout instead of the file's (module docstring)

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
        if in_features % t.weights:
            raise UserError(
                f"rows of {in_features} weights do not divide into {t.name} blocks of {t.weights}"
            )
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.register_buffer(
            "blocks",
            torch.zeros(out_features, t.row_bytes(in_features), dtype=torch.uint8, device=device),
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

    def file_blocks(self) -> torch.Tensor:
        """The blocks in the file's layout: `blocks` itself, or (interleaved) a new tensor."""
        return deinterleave16(self.blocks, self.kind) if self.interleaved else self.blocks

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix the blocks stand for, (d_out, d_in)."""
        return dequantize(self.file_blocks(), self.kind).to(dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.interleaved:  # a state dict holds the file's layout
            destination[prefix + "blocks"] = self.file_blocks()

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.interleaved = False  # the bytes copied in are the file's layout

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix, made at each read (writing into it changes nothing)."""
        return self.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_by_slices(x, lambda rows: dequantize(rows, self.kind).to(x.dtype))

    def linear_by_slices(
        self, x: torch.Tensor, dequantize_rows: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """F.linear(x, W, b), W made by `dequantize_rows` from the blocks (file's layout) of at
        most SLICE_FLOATS weights at a time: a large matrix (an LM head of 128k rows, 2 GB as
        float32) never exists whole as floats, and each output column is the same product. Each
        slice's columns are written into the one output as they come (no list of slices joined
        at the end: that held the logits twice)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        blocks = self.file_blocks()
        rows = max(GROUP, SLICE_FLOATS // self.in_features)
        if self.out_features <= rows:
            return F.linear(x, dequantize_rows(blocks), bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, rows):
            part = slice(start, start + rows)
            out[..., part] = F.linear(
                x, dequantize_rows(blocks[part]), None if bias is None else bias[part]
            )
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {BLOCK_TYPES[self.kind].name} blocks"
        )


class BlockEmbedding(nn.Module):
    """A token embedding kept as ggml blocks: `blocks` uint8 [d_vocab, row bytes], one row of
    blocks per token. A lookup dequantizes only the rows it reads (so no float table of d_vocab x
    d_model is ever held); a tied LM head is a BlockLinear on the same tensor. `weight` is the
    whole dequantized table, made at each read, for the weight views that want it."""

    def __init__(self, blocks: torch.Tensor, kind: str, embedding_dim: int) -> None:
        super().__init__()
        t = block_type(kind)
        if embedding_dim % t.weights or tuple(blocks.shape[1:]) != (t.row_bytes(embedding_dim),):
            raise UserError(
                f"{kind} blocks of shape {tuple(blocks.shape)} cannot hold an embedding of "
                f"{embedding_dim} values per token"
            )
        self.num_embeddings, self.embedding_dim, self.kind = blocks.shape[0], embedding_dim, kind
        self.register_buffer("blocks", blocks)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (d_vocab, d_model), made at each read."""
        return dequantize(self.blocks, self.kind)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.blocks[ids], self.kind)  # [*ids.shape, d_model]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {BLOCK_TYPES[self.kind].name} blocks"
