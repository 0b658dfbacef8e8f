"""The kernels' elementwise work and lookups, each a typed wrapper of one C function: a decode
step's ops (`norm_call`, `rope_call`, `activate_call`, `silu_mul_call`, `softcap_call`,
`add_call`, `mul_call`, `window_mask_call`, the embeddings `embed_call` and `embed_blocks_call`),
a prompt's rows shared by the threads (`rms_norm_rows`, `rms_norm_parts_rows`, `silu_mul_rows`,
`silu_mul_up_rows`, `rope_rows`), and a lookup in a table of blocks (`embed_blocks`).

Design choices:
- A *_call function checks once what the C code trusts and returns a prepared Call
  (programs.py); the *_rows functions run at once and return new tensors (or the one they
  wrote in place).
- The prompt's kernels compute the decode step's equations, so a prompt and its decode steps
  agree; tests/test_kernels.py holds each to attnlab.model's module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...memory import new_tensor
from ...model.layers import LayerNorm
from . import builds
from .products import _block_type
from .programs import Activation, BlockKind, Call, Op


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every row of x (..., d) float32, the rows shared by the threads
    (attnlab_rms_norm_rows: the decode step's RMSNorm). Returns a new tensor."""
    x = x.contiguous()
    assert x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    builds.library().attnlab_rms_norm_rows(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm_parts_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of every row of x (..., d) float32 with the parts its hooks read: (out as
    `rms_norm_rows`, scale (..., 1) = sqrt(mean(x²) + eps), normalized = x / scale), one pass over
    each row (attnlab_rms_norm_parts_rows). New tensors."""
    x = x.contiguous()
    assert x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
    out, normalized = new_tensor(*x.shape), new_tensor(*x.shape)
    scale = torch.empty(*x.shape[:-1], 1)
    d = x.shape[-1]
    builds.library().attnlab_rms_norm_parts_rows(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), scale.data_ptr(), normalized.data_ptr(),
        x.numel() // d, d, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, scale, normalized


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate = silu(gate) · up in place (SwiGLU's product; gate and up contiguous float32 of the same
    shape, the values shared by the threads: attnlab_silu_mul_rows). Returns gate."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    assert gate.dtype == up.dtype == torch.float32
    builds.library().attnlab_silu_mul_rows(
        gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads()
    )
    return gate


def silu_mul_up_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """up = silu(gate) · up in place (SwiGLU's product where a hook holds the gate; contiguous
    float32 of the same shape: attnlab_silu_mul_up_rows). Returns up."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    assert gate.dtype == up.dtype == torch.float32
    builds.library().attnlab_silu_mul_up_rows(
        gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads()
    )
    return up


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [batch, pos, head, d_head] by cos, sin [batch, pos, 1, rotary_dim] (each position's
    angles, as attnlab.model.positions.Rotary gives them), out of place, the rows shared by the
    threads (attnlab_rope_rows: the decode step's rotation). Returns a new tensor."""
    B, T, H, D = x.shape
    rotary_dim = cos.shape[-1]
    assert cos.shape == sin.shape == (B, T, 1, rotary_dim) and rotary_dim <= D
    assert x.dtype == cos.dtype == sin.dtype == torch.float32
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = new_tensor(*x.shape)
    builds.library().attnlab_rope_rows(
        x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, H, D, rotary_dim,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_call(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> Callable[[], None]:
    """Rotate x (rows, heads, d_head) in place by the angles cos, sin (n, rotary_dim) of positions
    0..n-1, read at each row's position (positions: rows int64, read at each call; every one below
    n)."""
    rows, heads, d_head = x.shape
    assert (
        cos.is_contiguous()
        and sin.is_contiguous()
        and positions.dtype == torch.int64
        and positions.numel() == rows
    )
    return Call(Op.ROPE, x, cos, sin, positions, rows, heads, d_head, cos.shape[-1])


def embed_call(
    ids: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    positions_table: torch.Tensor | None,
    out: torch.Tensor,
    scale: float = 1.0,
) -> Callable[[], None]:
    """out (rows, d) = table[ids] * scale (+ positions_table[positions]); ids, positions: rows
    int64, read at each call; scale rounded to float32 (as torch's x * scale on a float32 x)."""
    rows, d = out.shape
    assert ids.dtype == positions.dtype == torch.int64 and ids.numel() == positions.numel() == rows
    assert (
        table.is_contiguous()
        and table.shape[1] == d
        and (positions_table is None or positions_table.is_contiguous())
    )
    return Call(Op.EMBED, ids, table, positions, positions_table, out, rows, d, scale)


def norm_call(norm, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """out = norm(x) for an attnlab LayerNorm or RMSNorm over the last dim of x (rows, d)."""
    d = x.shape[-1]
    rows = x.numel() // d
    if isinstance(norm, LayerNorm):
        return Call(Op.LAYER_NORM, x, norm.weight, norm.bias, out, rows, d, norm.eps)
    return Call(Op.RMS_NORM, x, norm.weight, out, rows, d, norm.eps)


def activate_call(x: torch.Tensor, kind: Activation) -> Callable[[], None]:
    """x = act(x) in place, the nonlinearity `kind`, over every value of the contiguous float32
    x."""
    assert x.is_contiguous() and x.dtype == torch.float32
    return Call(Op.ACTIVATE, x, x.numel(), Activation(kind))


def silu_mul_call(gate: torch.Tensor, up: torch.Tensor) -> Callable[[], None]:
    """gate = silu(gate) ⊙ up in place (SwiGLU's product); gate and up contiguous float32 of one
    shape."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    return Call(Op.SILU_MUL, gate, up, gate.numel())


def softcap_call(x: torch.Tensor, cap: float) -> Callable[[], None]:
    """x = cap · tanh(x / cap) in place over every value of the contiguous float32 x."""
    assert x.is_contiguous() and x.dtype == torch.float32
    return Call(Op.SOFTCAP, x, x.numel(), cap)


def embed_blocks_call(
    ids: torch.Tensor, blocks: torch.Tensor, kind: BlockKind, out: torch.Tensor, scale: float = 1.0
) -> Call:
    """out (rows, d) = the rows ids (rows int64, read at each call) of a table in blocks (uint8
    (d_vocab, row bytes), contiguous), dequantized in C (attnlab_embed_q: bit-equal to
    `embed_blocks`), times scale (as embed_call's). The C code trusts the ids: the caller checks
    them (generate: the prompt's before the first step, the argmax of d_vocab logits after it,
    where d_vocab <= the table's rows)."""
    rows, d = out.shape
    assert blocks.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
    assert blocks.shape[1] == _block_type(kind).row_bytes(d) and ids.dtype == torch.int64
    assert ids.numel() == rows
    return Call(Op.EMBED_Q, ids, blocks, out, rows, d, int(kind), scale)


def add_call(y: torch.Tensor, x: torch.Tensor) -> Call:
    """y += x in place; contiguous float32 of one size."""
    assert y.is_contiguous() and x.is_contiguous() and y.dtype == x.dtype == torch.float32
    assert y.numel() == x.numel()
    return Call(Op.ADD, y, x, y.numel())


def mul_call(y: torch.Tensor, x: torch.Tensor) -> Call:
    """y *= x in place; contiguous float32 of one size."""
    assert y.is_contiguous() and x.is_contiguous() and y.dtype == x.dtype == torch.float32
    assert y.numel() == x.numel()
    return Call(Op.MUL, y, x, y.numel())


def window_mask_call(
    window_mask: torch.Tensor, key_mask: torch.Tensor | None, slot: torch.Tensor, window: int
) -> Call:
    """window_mask (rows, max_len) bool = key_mask (or every slot, key_mask None) but the slots
    before slot - window + 1 (slot: (1,) int64, read at each call): the keys a windowed block's
    query at that slot sees."""
    rows, max_len = window_mask.shape
    assert window_mask.dtype == torch.bool and window_mask.is_contiguous() and window >= 1
    assert key_mask is None or (key_mask.shape == window_mask.shape and key_mask.is_contiguous())
    assert slot.dtype == torch.int64 and slot.numel() == 1
    return Call(Op.WINDOW_MASK, window_mask, key_mask, slot, rows, max_len, window)


def embed_blocks(
    ids: torch.Tensor, blocks: torch.Tensor, kind: BlockKind, out: torch.Tensor
) -> None:
    """out (rows, d) = the rows ids (rows int64) of a table in blocks (uint8 (d_vocab, row bytes),
    contiguous), each dequantized alone in C (attnlab_dequantize, bit-equal to the reference): a
    lookup never makes the whole float table. Callers check `usable`."""
    rows, d = out.shape
    row_bytes, lib = blocks.shape[1], builds.library()
    assert blocks.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
    assert row_bytes == _block_type(kind).row_bytes(d) and ids.numel() == rows
    base, at = blocks.data_ptr(), out.data_ptr()  # read at each call: the blocks may have moved
    for r, token in enumerate(ids.tolist()):
        if not 0 <= token < blocks.shape[0]:  # as torch's lookup: never a read past the table
            raise IndexError(f"token id {token} is out of range for {blocks.shape[0]} rows")
        lib.attnlab_dequantize(base + token * row_bytes, at + 4 * r * d, 1, d, int(kind), 1)
