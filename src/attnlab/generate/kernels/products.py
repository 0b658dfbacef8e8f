"""The kernels' products, each a typed wrapper of one C function: float32 and int8 decode products
(`linear`), ggml block products (`block_linear`, the 16-row layout of `repack16` and
`repack16_in_place`, `dequantize`), a prompt's products of many rows (`block_linear_rows`,
`linear_rows`) and float32 products on AMX tiles (`linear_amx`, `swiglu_amx`).

Design choices:
- One wrapper per C function, checking once (where a call is prepared) the shapes, dtypes and
  layouts the C code trusts; a *_call function returns a prepared Call (programs.py) for a step
  program, its plain twin runs it once.
- Only the forward computation, for inference: none takes gradients (callers check `usable`).
- A prompt's products are tiled GEMMs that read each weight once per tile; their 8-bit rounding is
  the decode step's, so `block_linear_rows` gives `block_linear`'s numbers up to the order of
  float32 summation.
- AMX products split each float32 value exactly into three bfloat16 parts and sum six products of
  parts in float32: a float32 GEMM's accuracy. They run only where builds.amx_unusable has no
  objection (it also asks the operating system for this process's permission: an AMX
  instruction without it is an illegal instruction); their scratch is kept from call to call
  (buffers._kept_scratch).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ...memory import fresh, new_tensor
from ...quant.blocks import BLOCK_TYPES
from . import builds
from .buffers import _kept_scratch
from .programs import BlockKind, Call, Op

# the block kinds the prompt products (attnlab_linear_q_rows / _f_rows) unpack: the C source's
# block_values reads these per 32 weights (Q4_K's and Q5_K's sub-blocks as Q4_1's blocks; Q6_K's two
# scales per 32 are not in the tiles' format)
ROWS_KINDS = (
    BlockKind.Q8_0,
    BlockKind.Q4_0,
    BlockKind.Q4_1,
    BlockKind.Q5_0,
    BlockKind.Q4_K,
    BlockKind.Q5_K,
)


def linear_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    accumulate: bool = False,
) -> Callable[[], None]:
    """out (=, or += when accumulate) x Wᵀ (· scale) + b, prepared: x (rows, d_in) float32 and W
    (d_out, d_in) float32, or int8 with one float32 scale per output feature; all contiguous."""
    rows, (d_out, d_in) = x.numel() // x.shape[-1], weight.shape
    # the C code trusts these shapes: check them once here, where the call is prepared
    assert (
        x.shape[-1] == d_in
        and out.numel() == rows * d_out
        and x.is_contiguous()
        and out.is_contiguous()
    )
    assert weight.is_contiguous() and x.dtype == out.dtype == torch.float32
    threads = torch.get_num_threads()
    if weight.dtype == torch.int8:
        return Call(
            Op.LINEAR_I8, x, weight, scale, bias, out, rows, d_in, d_out, int(accumulate), threads
        )
    return Call(Op.LINEAR_F32, x, weight, bias, out, rows, d_in, d_out, int(accumulate), threads)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """x Wᵀ (· scale) + b for x (..., d_in), as `linear_call`; returns `out` (..., d_out), a new
    tensor by default. Callers check `usable`."""
    x, weight = x.contiguous(), weight.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    linear_call(x, weight, bias, scale, out, accumulate)()
    return out


def _block_type(kind: BlockKind):
    return next(t for t in BLOCK_TYPES.values() if t.kernel == kind)


def block_bytes(kind: BlockKind) -> int:
    """Bytes per block of `kind` (of 32 weights, or 256 for a K-quant)."""
    return _block_type(kind).nbytes


def block_linear_call(
    x: torch.Tensor,
    blocks: torch.Tensor,
    kind: BlockKind,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    accumulate: bool = False,
    repacked: bool = False,
) -> Callable[[], None]:
    """out (=, or += when accumulate) x Wᵀ + b, prepared, for W (d_out, d_in) in ggml blocks of
    `kind`: blocks uint8 (d_out, d_in / 32 · block bytes), x (rows, d_in) float32, rounded to 8 bits
    per block of 32 on the way (attnlab_linear_q); all contiguous. `repacked`: the blocks
    are in the 16-row layout (`repack16`)."""
    rows, d_in = x.numel() // x.shape[-1], x.shape[-1]
    d_out, t = blocks.shape[0], _block_type(kind)
    # the C code trusts these shapes: check them once here, where the call is prepared
    assert d_in % t.weights == 0 and tuple(blocks.shape) == (d_out, t.row_bytes(d_in))
    assert not repacked or (kind in REPACKABLE and d_out % 16 == 0)
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    assert x.is_contiguous() and out.is_contiguous() and out.numel() == rows * d_out
    assert x.dtype == out.dtype == torch.float32
    threads = torch.get_num_threads()
    per_thread = builds.library().attnlab_linear_q_scratch(rows, d_in)
    scratch = torch.empty(threads * per_thread + 64, dtype=torch.int8)
    scratch = scratch[-scratch.data_ptr() % 64 :]  # 64-byte aligned
    return Call(
        Op.LINEAR_Q,
        x,
        blocks,
        bias,
        out,
        scratch,
        rows,
        d_in,
        d_out,
        int(BlockKind(kind)) | (REPACKED if repacked else 0),
        int(accumulate),
        threads,
    )


# the block kinds with a 16-row decode layout (attnlab_repack16), and the flag that marks
# a LINEAR_Q op's weights as in it
REPACKABLE = (BlockKind.Q8_0, BlockKind.Q4_0, BlockKind.Q4_1, BlockKind.Q5_0, BlockKind.Q4_K)
REPACKED = 0x100


def repack16(
    blocks: torch.Tensor, kind: BlockKind, d_in: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The same blocks (uint8 (d_out, row bytes), d_out a multiple of 16, kind in REPACKABLE) in
    the 16-row decode layout (attnlab_repack16: sixteen rows' blocks interleaved so that
    one 512-bit lane holds one row): a tensor of the same shape and bytes (`out`, or a new one)."""
    d_out, t = blocks.shape[0], _block_type(kind)
    assert kind in REPACKABLE and d_out % 16 == 0 and blocks.is_contiguous()
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (d_out, t.row_bytes(d_in))
    if out is None:
        out = torch.empty_like(blocks)
    assert out.shape == blocks.shape and out.dtype == torch.uint8 and out.is_contiguous()
    assert out.data_ptr() != blocks.data_ptr()
    builds.library().attnlab_repack16(blocks.data_ptr(), out.data_ptr(), d_out, d_in, int(kind))
    return out


# bytes of rows `repack16_in_place` repacks at a time (rounded down to whole groups of 16 rows)
REPACK_CHUNK_BYTES = 4 << 20


def repack16_in_place(blocks: torch.Tensor, kind: BlockKind, d_in: int) -> torch.Tensor:
    """`blocks` rewritten in the 16-row layout where they are (the bytes `repack16` makes), through
    a scratch of at most REPACK_CHUNK_BYTES (at least 16 rows) kept by this thread: a group of 16
    rows takes the same bytes in both layouts, so each chunk of groups is copied out and repacked
    back into its place. No tensor the size of the matrix is made: a fresh copy per matrix, freed
    at once, still lands in malloc's heap where the weights moved into 2 MB pages were (pages
    handed back by the trim), faults them in again and keeps them resident, as much memory as
    the matrices repacked (benchmarks/large_file_memory.py's chat order). Returns `blocks`."""
    d_out, row_bytes = blocks.shape
    assert kind in REPACKABLE and d_out % 16 == 0 and blocks.is_contiguous()
    rows = min(d_out, max(16, REPACK_CHUNK_BYTES // (16 * row_bytes) * 16))
    scratch = _kept_scratch(rows * row_bytes).view(torch.uint8)
    for start in range(0, d_out, rows):
        part = blocks[start : start + rows]  # [rows, row bytes], whole groups
        source = scratch[: part.numel()].view(part.shape)
        source.copy_(part)
        repack16(source, kind, d_in, out=part)
    return blocks


def repack16_vectorised(kind: BlockKind) -> bool:
    """Whether this build's 16-row product of `kind` is vectorised (AVX-512 VNNI; AVX2 with FMA
    and F16C but for Q5_0; the other builds compute it a lane at a time, for tests):
    generation races it against the file's layout only then (policy.repack16_chosen)."""
    return bool(builds.library().attnlab_repack16_vectorised(int(kind)))


def block_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    kind: BlockKind,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    repacked: bool = False,
) -> torch.Tensor:
    """x Wᵀ + b for x (..., d_in) and W in blocks (`repacked`: in the 16-row layout), as
    `block_linear_call`; returns `out` (..., d_out), a new tensor by default. Callers check
    `usable`."""
    x = x.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], blocks.shape[0], dtype=torch.float32)
    block_linear_call(x, blocks, kind, bias, out, accumulate, repacked)()
    return out


def dequantize(blocks: torch.Tensor, kind: BlockKind, d_in: int) -> torch.Tensor:
    """The float32 matrix (d_out, d_in) that `blocks` (uint8, contiguous) of `kind` stand for, on
    torch's threads: attnlab.quant.blocks.dequantize's values, bit for bit. Callers check
    `usable`."""
    d_out, t = blocks.shape[0], _block_type(kind)
    assert tuple(blocks.shape) == (d_out, t.row_bytes(d_in)) and d_in % t.weights == 0
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    out = torch.empty(d_out, d_in)
    builds.library().attnlab_dequantize(
        blocks.data_ptr(), out.data_ptr(), d_out, d_in, int(kind), torch.get_num_threads()
    )
    return out


def rows_vectorized() -> tuple[bool, bool]:
    """Whether this build's prompt products (`block_linear_rows`, `linear_rows`) run vectorised:
    (the 8-bit product on AVX-512 VNNI or AVX2, the float32 one and the prompt attention on
    AVX-512 or AVX2 with FMA). Generation and forward passes take them for prompts only then
    (attnlab.generate.fast_layers; the float32 ones where they also measured faster than torch's
    GEMM, kernels.float_rows); elsewhere they are plain loops, for tests."""
    bits = builds.library().attnlab_linear_rows_vectorized()
    return bool(bits & 1), bool(bits & 2)


def _rows_scratch(rows: int, d_in: int, threads: int) -> torch.Tensor:
    """The prompt products' scratch for rows of d_in values on `threads` threads, 64-byte
    aligned."""
    scratch = torch.empty(
        builds.library().attnlab_linear_rows_scratch(rows, d_in, threads) + 64, dtype=torch.int8
    )
    return scratch[-scratch.data_ptr() % 64 :]


def _rows_product(
    name: str, x: torch.Tensor, weight: torch.Tensor, kind: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """the C source's `name` (attnlab_linear_q_rows or attnlab_linear_f_rows) for x (..., d_in):
    (..., d_out), a new tensor."""
    x = x.contiguous()
    rows, d_in, d_out = x.numel() // x.shape[-1], x.shape[-1], weight.shape[0]
    assert x.dtype == torch.float32 and weight.is_contiguous()
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32)
    threads = torch.get_num_threads()
    scratch = _rows_scratch(rows, d_in, threads)
    out = torch.empty(*x.shape[:-1], d_out)
    getattr(builds.library(), name)(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        rows,
        d_in,
        d_out,
        kind,
        threads,
    )
    return out


def block_linear_rows(
    x: torch.Tensor,
    blocks: torch.Tensor,
    kind: BlockKind,
    bias: torch.Tensor | None = None,
    activations: str = "8-bit",
) -> torch.Tensor:
    """x Wᵀ + b for many rows x (..., d_in) (a prompt), W (d_out, d_in) in blocks of `kind`, as a
    tiled GEMM that reads each weight once per tile: activations "8-bit", rounded per block of 32
    as the decode step rounds them (attnlab_linear_q_rows: `block_linear`'s numbers up
    to float32 summation order), or "float32", each tile of weights dequantized in turn
    (attnlab_linear_f_rows: the module path's product up to summation order). Returns a new tensor
    (..., d_out). Callers check `usable`."""
    d_in = x.shape[-1]
    assert BlockKind(kind) in ROWS_KINDS
    t = _block_type(kind)
    assert d_in % t.weights == 0 and blocks.dtype == torch.uint8
    assert tuple(blocks.shape) == (blocks.shape[0], t.row_bytes(d_in))
    name = {"8-bit": "attnlab_linear_q_rows", "float32": "attnlab_linear_f_rows"}[activations]
    return _rows_product(name, x, blocks, int(BlockKind(kind)), bias)


def block_linear_rows_many(
    x: torch.Tensor, matrices: list[tuple[torch.Tensor, BlockKind, torch.Tensor | None]]
) -> list[torch.Tensor]:
    """[x W_iᵀ + b_i] for each (blocks, kind, bias) of `matrices` (W_i (d_out_i, d_in) in blocks of
    a kind in ROWS_KINDS), x (..., d_in) rounded to 8 bits once for all of them: a layer's q, k and
    v, or its gate and up (attnlab_linear_q_rows_many; each product is
    `block_linear_rows`'s, bit for bit). Returns new tensors (..., d_out_i). Callers check
    `usable`."""
    x = x.contiguous()
    rows, d_in = x.numel() // x.shape[-1], x.shape[-1]
    assert x.dtype == torch.float32
    outs = []
    for blocks, kind, bias in matrices:
        t = _block_type(kind)
        assert BlockKind(kind) in ROWS_KINDS and d_in % t.weights == 0
        assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
        assert tuple(blocks.shape) == (blocks.shape[0], t.row_bytes(d_in))
        assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32)
        outs.append(torch.empty(*x.shape[:-1], blocks.shape[0]))
    n, lib, threads = len(matrices), builds.library(), torch.get_num_threads()
    scratch = _rows_scratch(rows, d_in, threads)

    def addresses(tensors):  # a C array of their addresses, NULL for None
        return (ctypes.c_void_p * n)(*(t.data_ptr() if t is not None else None for t in tensors))

    lib.attnlab_linear_q_rows_many(
        x.data_ptr(),
        n,
        addresses([m[0] for m in matrices]),
        addresses([m[2] for m in matrices]),
        addresses(outs),
        (ctypes.c_int64 * n)(*(m[0].shape[0] for m in matrices)),
        (ctypes.c_int32 * n)(*(int(BlockKind(m[1])) for m in matrices)),
        scratch.data_ptr(),
        rows,
        d_in,
        threads,
    )
    return outs


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b for many rows x (..., d_in) and float32 W (d_out, d_in), as `block_linear_rows`'s
    float32 product (attnlab_linear_f_rows). Returns a new tensor (..., d_out). Callers
    check `usable`."""
    assert weight.dtype == torch.float32 and x.shape[-1] == weight.shape[1]
    return _rows_product("attnlab_linear_f_rows", x, weight, -1, bias)


def _no_amx_raises() -> None:
    """An AMX instruction without the OS's permission is an illegal instruction: `amx_unusable`
    (which asks for it) must have no objection first."""
    why = builds.amx_unusable()
    if why is not None:
        raise RuntimeError(f"attnlab's AMX product cannot run here: {why}")


def linear_amx(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b for many rows x (..., d_in) and float32 W (d_out, d_in) on AMX tiles
    (attnlab_linear_amx): each float32 value split exactly into three bfloat16 parts, six products
    of parts summed in float32, a float32 GEMM's accuracy. Returns a new tensor (..., d_out).
    Callers check `usable`; `amx_unusable` (which also asks the OS for this process's permission:
    an AMX instruction without it is an illegal instruction) is checked here."""
    return linear_amx_many(x, [(weight, bias)])[0]


def linear_amx_many(
    x: torch.Tensor, matrices: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> list[torch.Tensor]:
    """[x W_iᵀ + b_i] for each (W_i, b_i) of `matrices` (float32, W_i (d_out_i, d_in)), x split
    into its bfloat16 parts once for all of them: a layer's q, k and v, or its gate and up
    (attnlab_linear_amx_many; each product is `linear_amx`'s, bit for bit). Returns new
    tensors (..., d_out_i). Callers check `usable`; `amx_unusable` is checked here."""
    _no_amx_raises()
    x = x.contiguous()
    rows, d_in = x.numel() // x.shape[-1], x.shape[-1]
    assert x.dtype == torch.float32
    for weight, bias in matrices:
        assert weight.dtype == torch.float32 and weight.is_contiguous()
        assert weight.dim() == 2 and weight.shape[1] == d_in
        assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32)
    outs = [new_tensor(*x.shape[:-1], w.shape[0]) for w, _ in matrices]
    n, lib, threads = len(matrices), builds.library(), torch.get_num_threads()
    # each matrix's own: a panel's width does not grow with d_out (one panel of 576 features, two
    # of 512 for 1,000), and the C call sizes the threads' room for the widest panel
    needs = lib.attnlab_linear_amx_scratch
    scratch = _kept_scratch(max(needs(rows, d_in, w.shape[0], threads) for w, _ in matrices))

    def addresses(tensors):  # a C array of their addresses, NULL for None
        return (ctypes.c_void_p * n)(*(t.data_ptr() if t is not None else None for t in tensors))

    lib.attnlab_linear_amx_many(
        x.data_ptr(),
        n,
        addresses([m[0] for m in matrices]),
        addresses([m[1] for m in matrices]),
        addresses(outs),
        (ctypes.c_int64 * n)(*(m[0].shape[0] for m in matrices)),
        scratch.data_ptr(),
        rows,
        d_in,
        int(all(fresh(o.numel() * 4) for o in outs)),  # a run_with_cache's cache: past the caches
        threads,
    )
    return outs


def swiglu_amx(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, post): gate = x W_gateᵀ and post = silu(gate) · x W_upᵀ (no biases), float32, on AMX
    tiles, each block's product taken while its gate and up are in the core's cache
    (attnlab_linear_amx_swiglu): linear_amx_many's gate and silu_mul_up_rows's post, bit for bit.
    For a hook on the gate that only reads. Callers check `usable`; `amx_unusable` is checked
    here."""
    _no_amx_raises()
    x = x.contiguous()
    rows, d_in = x.numel() // x.shape[-1], x.shape[-1]
    d_out = w_gate.shape[0]
    assert x.dtype == w_gate.dtype == w_up.dtype == torch.float32
    assert w_gate.shape == w_up.shape == (d_out, d_in)
    assert w_gate.is_contiguous() and w_up.is_contiguous()
    gate, post = new_tensor(*x.shape[:-1], d_out), new_tensor(*x.shape[:-1], d_out)
    lib, threads = builds.library(), torch.get_num_threads()
    scratch = _kept_scratch(lib.attnlab_linear_amx_swiglu_scratch(rows, d_in, d_out, threads))
    lib.attnlab_linear_amx_swiglu(
        x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), gate.data_ptr(), post.data_ptr(),
        scratch.data_ptr(), rows, d_in, d_out, int(fresh(gate.numel() * 4)), threads,
    )  # fmt: skip
    return gate, post
