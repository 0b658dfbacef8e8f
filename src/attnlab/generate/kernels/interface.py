"""The C interface of attnlab's kernels: one table of every function the C source exports, and the
loader that declares them to ctypes.

Design choices:
- One row per exported function (every non-static attnlab_* function defined in a *.c file under
  C_FOLDER): its name, its result type and its parameters' types, in order. ctypes trusts what it
  is told (a float passed where C reads an int64 is garbage, silently), so nothing but this table
  says what a C function takes: `load` and `declare` set argtypes and restype from it, a program's
  op (program.OpCall) is laid out by it, and tests/test_kernel_interface.py parses the C source
  and checks the table against it both ways (a function missing here, a row whose function is
  gone, a parameter of another type).
- Types as ctypes sees them: every pointer a void pointer (the wrappers pass tensors'
  data_ptr()), int64_t, int, float and uint64_t as themselves.
- cpu.c is a library of its own (what the CPU and the operating system allow, built before a
  build of the kernels is chosen): its function is a row like the others, declared by
  `declare(lib, CPU_FUNCTIONS)`; `load` declares every other row.
- A call with other than the declared number of arguments is refused (`_counted`): ctypes passes
  extra arguments on without a word.
- This module imports nothing of attnlab: the build module and the check programs' parent use it
  without a circle.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

# the kernels' C source: every *.c and *.h file below this folder (the build key hashes them all,
# and the interface test parses every *.c file for the exported functions)
C_FOLDER = Path(__file__).parent

_ptr, _i64, _int, _float, _u64 = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_float,
    ctypes.c_uint64,
)


class Signature(NamedTuple):
    """A C function's result type (None: void) and its parameters' types, in order."""

    result: type | None
    parameters: list[type]


def _void(*parameters: type) -> Signature:
    return Signature(None, list(parameters))


# The one table of the C interface. Parameters in the C source's order; the comments name them.
FUNCTIONS: dict[str, Signature] = {
    # -- decode products, one row or a few: float32 (x, w, b, y, rows, d_in, d_out, accumulate,
    # threads), int8 with a scale per output feature (x, q, scale, b, y, ...)
    "attnlab_linear_f32": _void(*[_ptr] * 4, _i64, _i64, _i64, _int, _int),
    "attnlab_linear_i8": _void(*[_ptr] * 5, _i64, _i64, _i64, _int, _int),
    # ggml blocks (x, blocks, b, y, scratch, rows, d_in, d_out, block type | REPACKED, accumulate,
    # threads), its scratch bytes per thread (rows, d_in), blocks -> float32 (blocks, out, rows,
    # d_in, block type, threads)
    "attnlab_linear_q": _void(*[_ptr] * 5, _i64, _i64, _i64, _int, _int, _int),
    "attnlab_linear_q_scratch": Signature(_i64, [_i64, _i64]),
    "attnlab_dequantize": _void(_ptr, _ptr, _i64, _i64, _int, _int),
    # block rows -> the 16-row decode layout (blocks, out, d_out, d_in, block type); whether the
    # 16-row products of a block type are this build's fastest
    "attnlab_repack16": _void(_ptr, _ptr, _i64, _i64, _int),
    "attnlab_repack16_fast": Signature(_int, [_int]),
    # -- a prompt's products, many rows at once (x, weights, bias, y, scratch, rows, d_in, d_out,
    # block type, threads): blocks with 8-bit activations, float32 on tiles of float or
    # dequantized weights; several block matrices times one x, rounded once (x, n, weights[],
    # biases[], ys[], d_outs[], block types[] int32, scratch, rows, d_in, threads); their scratch
    # bytes (rows, d_in, threads); which are vectorised (bit 0: 8-bit, bit 1: float32)
    "attnlab_linear_q_rows": _void(*[_ptr] * 5, _i64, _i64, _i64, _int, _int),
    "attnlab_linear_f_rows": _void(*[_ptr] * 5, _i64, _i64, _i64, _int, _int),
    "attnlab_linear_q_rows_many": _void(_ptr, _i64, *[_ptr] * 6, _i64, _i64, _int),
    "attnlab_linear_rows_scratch": Signature(_i64, [_i64, _i64, _int]),
    "attnlab_linear_rows_vectorized": Signature(_int, []),
    # -- float32 products on AMX tiles: several matrices times one x (x, n, weights[], biases[],
    # ys[], d_outs[], scratch, rows, d_in, fresh: the ys on pages no cache holds, threads), one
    # matrix (x, w, b, y, scratch, rows, d_in, d_out, threads: the AMX check's), SwiGLU's gate and
    # silu(gate) · up (x, w_gate, w_up, gate, post, scratch, rows, d_in, d_out, fresh, threads),
    # their scratch bytes (rows, d_in, d_out, threads), and whether this process may run them
    # (asks the operating system)
    "attnlab_linear_amx_many": _void(_ptr, _i64, *[_ptr] * 5, _i64, _i64, _int, _int),
    "attnlab_linear_amx": _void(*[_ptr] * 5, _i64, _i64, _i64, _int),
    "attnlab_linear_amx_swiglu": _void(*[_ptr] * 6, _i64, _i64, _i64, _int, _int),
    "attnlab_linear_amx_scratch": Signature(_i64, [_i64, _i64, _i64, _int]),
    "attnlab_linear_amx_swiglu_scratch": Signature(_i64, [_i64, _i64, _i64, _int]),
    "attnlab_amx_permitted": Signature(_int, []),
    # -- a prompt's causal attention from position 0 in one call (q, k, v, out, scratch, batch, T,
    # heads, kv_heads, d_head, scale, cap, threads; cap: the scores' soft-cap, 0 for none) and its
    # scratch bytes (batch, T, kv_heads, d_head, threads); in three steps for hooks between them:
    # the masked scores (q, k, scores, scratch, batch, T, heads, kv_heads, d_head, scale, cap,
    # threads), each row's softmax (scores, pattern,
    # rows, n, threads), the pattern times V (pattern, v, out, batch, T, S, heads, kv_heads,
    # d_head, threads)
    "attnlab_attend_rows": _void(*[_ptr] * 5, *[_i64] * 5, _float, _float, _int),
    "attnlab_attend_rows_scratch": Signature(_i64, [*[_i64] * 4, _int]),
    "attnlab_attend_scores": _void(*[_ptr] * 4, *[_i64] * 5, _float, _float, _int),
    "attnlab_softmax_rows": _void(_ptr, _ptr, _i64, _i64, _int),
    "attnlab_attend_mix": _void(*[_ptr] * 3, *[_i64] * 6, _int),
    # all three in one call, on the float32 tiles (q, k, v, scores, pattern, out, scratch, batch,
    # T, heads, kv_heads, d_head, scale, cap, threads)
    "attnlab_attend_explicit": _void(*[_ptr] * 7, *[_i64] * 5, _float, _float, _int),
    # the steps' two products on AMX tiles (as above, with scratch), all three steps in one call
    # (q, k, v, scores, pattern, out, scratch, batch, T, heads, kv_heads, d_head, scale, cap,
    # threads), and their scratch bytes (T, S, d_head, threads)
    "attnlab_attend_scores_amx": _void(*[_ptr] * 4, *[_i64] * 5, _float, _float, _int),
    "attnlab_attend_mix_amx": _void(*[_ptr] * 4, *[_i64] * 6, _int),
    "attnlab_attend_explicit_amx": _void(*[_ptr] * 7, *[_i64] * 5, _float, _float, _int),
    "attnlab_attend_amx_scratch": Signature(_i64, [_i64, _i64, _i64, _int]),
    # -- a decode step's ops (program.Op): attention over the cache (q, k_new, v_new, k_cache,
    # v_cache, key_mask, its row stride, scores, out, rows, heads, kv_heads, d_head, max_len,
    # slot, scale, cap, threads)
    "attnlab_attend": _void(*[_ptr] * 6, _i64, _ptr, _ptr, *[_i64] * 5, _ptr, _float, _float, _int),
    # RoPE in place (x, cos, sin, positions, rows, heads, d_head, rotary_dim); embeddings (ids,
    # table, positions, positions_table, out, rows, d, scale), from blocks (ids, blocks, out, rows,
    # d, block type, scale)
    "attnlab_rope": _void(*[_ptr] * 4, *[_i64] * 4),
    "attnlab_embed": _void(*[_ptr] * 5, _i64, _i64, _float),
    "attnlab_embed_q": _void(_ptr, _ptr, _ptr, _i64, _i64, _int, _float),
    # norms (x, w, (b,) out, rows, d, eps), activations in place (x, n, kind; x, n, cap), SwiGLU's
    # product and the residual's sums in place (y, x, n), a windowed block's key mask
    # (window_mask, key_mask, slot, rows, max_len, window)
    "attnlab_rms_norm": _void(_ptr, _ptr, _ptr, _i64, _i64, _float),
    "attnlab_layer_norm": _void(*[_ptr] * 4, _i64, _i64, _float),
    "attnlab_activate": _void(_ptr, _i64, _int),
    "attnlab_softcap": _void(_ptr, _i64, _float),
    "attnlab_silu_mul": _void(_ptr, _ptr, _i64),
    "attnlab_add": _void(_ptr, _ptr, _i64),
    "attnlab_mul": _void(_ptr, _ptr, _i64),
    "attnlab_window_mask": _void(_ptr, _ptr, _ptr, _i64, _i64, _i64),
    # -- a mixture of experts' ops: the router's choice (scores, weights, chosen, rows, n_experts,
    # k, normalize), the chosen experts' products (x, table, chosen, y, scratch, rows, k, d_in,
    # d_out, x_per_slot, threads), their outputs weighed into the residual (x, y, weights, shared,
    # shared_gate, rows, k, d, accumulate)
    "attnlab_route": _void(*[_ptr] * 3, _i64, _i64, _i64, _int),
    "attnlab_linear_experts": _void(*[_ptr] * 5, *[_i64] * 4, _int, _int),
    "attnlab_weigh_experts": _void(*[_ptr] * 5, _i64, _i64, _i64, _int),
    # -- a prompt's elementwise kernels, the rows shared by the threads: RMSNorm (x, w, out, rows,
    # d, eps, threads), with its hooks' parts (x, w, out, scale, normalized, rows, d, eps,
    # threads), SwiGLU's product into gate or into up (gate, up, n, threads), RoPE out of place
    # (x, out, cos, sin, rows, heads, d_head, rotary_dim, threads)
    "attnlab_rms_norm_rows": _void(_ptr, _ptr, _ptr, _i64, _i64, _float, _int),
    "attnlab_rms_norm_parts_rows": _void(*[_ptr] * 5, _i64, _i64, _float, _int),
    "attnlab_silu_mul_rows": _void(_ptr, _ptr, _i64, _int),
    "attnlab_silu_mul_up_rows": _void(_ptr, _ptr, _i64, _int),
    "attnlab_rope_rows": _void(*[_ptr] * 4, *[_i64] * 4, _int),
    # -- programs: run one (ops, their number, threads); greedy generation in C (ops, their
    # number, threads, tokens; logits, rows, vocab; ids, position, slot, key mask, its length;
    # out, its row stride, eos, done): the number of tokens written
    "attnlab_run": _void(_ptr, _i64, _int),
    "attnlab_generate_greedy": Signature(
        _i64, [_ptr, _i64, _int, _i64, _ptr, _i64, _i64, *[_ptr] * 4, _i64, _ptr, _i64, _i64, _ptr]
    ),
    # -- the build: _OPENMP's value (0 without OpenMP); one read-only pass over a buffer (address,
    # bytes, threads, prefetch distance or 0; the sum of its 64-bit words) and the decode
    # products' prefetch distance, the read bandwidth's probe
    "attnlab_openmp": Signature(_int, []),
    "attnlab_read_pass": Signature(_u64, [_ptr, _i64, _int, _i64]),
    "attnlab_prefetch_ahead": Signature(_i64, []),
    # -- cpu.c's library: the ATTNLAB_CPU_* bits of the instruction sets usable here (CpuLevel)
    "attnlab_cpu_levels": Signature(_int, []),
}
CPU_FUNCTIONS = ("attnlab_cpu_levels",)  # cpu.c's, in a library of its own
KERNEL_FUNCTIONS = tuple(name for name in FUNCTIONS if name not in CPU_FUNCTIONS)


def declare(lib: ctypes.CDLL, names: Iterable[str] = KERNEL_FUNCTIONS) -> ctypes.CDLL:
    """`lib` with the functions `names` (rows of FUNCTIONS) given their argument and result types;
    a name the library lacks is ctypes' AttributeError."""
    for name in names:
        function = getattr(lib, name)
        function.argtypes, function.restype = FUNCTIONS[name].parameters, FUNCTIONS[name].result
    return lib


def load(path: Path) -> ctypes.CDLL:
    """The kernels of the shared library at `path`, every one declared (`declare`) and refusing a
    call with other than its number of arguments (`_counted`)."""
    lib = declare(ctypes.CDLL(str(path)))
    for name in KERNEL_FUNCTIONS:
        setattr(lib, name, _counted(getattr(lib, name)))
    return lib


def _counted(function: ctypes._CFuncPtr) -> Callable:
    """`function`, refusing a call with other than its declared number of arguments: ctypes passes
    a C function's extra arguments on without a word, and the function reads its own from the
    wrong places (a product given one argument too many ran with `threads` set to 0)."""
    count = len(function.argtypes)

    @functools.wraps(function)
    def call(*args):
        if len(args) != count:
            raise TypeError(f"{function.__name__} takes {count} arguments ({len(args)} given)")
        return function(*args)

    return call
