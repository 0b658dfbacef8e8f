"""attnlab's C kernels for decoding on a CPU (decode.c), compiled at first use and cached per
machine.

Design choices:
- Plain C, no torch headers: one `cc -O3 -fopenmp` of decode.c is quick, where a torch C++
  extension is slow to build; loaded with ctypes, a call costs little. The shared library is
  cached under ~/.cache/attnlab/kernels (or $ATTNLAB_CACHE/kernels), named by a hash of the source,
  the flags, the compiler and the CPU, so the build is paid once per machine, never once per
  process, and a new CPU or a new decode.c builds anew. Written to a temporary name, then renamed: a
  parallel build never leaves a torn file.
- The instruction set is chosen at run time, not by -march=native: decode.c has three builds on
  x86-64 (VARIANTS: AVX-512 with VNNI, AVX2 with FMA and F16C, portable C), and the process uses the
  best one that (1) the CPU reports, (2) the operating system enables (XCR0's register state, read
  by cpu.c: a CPU flag is not permission) and (3) passes a self-check in a child process (exact
  integer products through each kind of kernel), so that an instruction that faults here kills the
  child, never the user's process; the verdict is cached beside the library. ATTNLAB_KERNELS=avx512,
  avx2 or portable forces one (tests, the AVX2 benchmark column); one this machine does not allow is
  a one-line error. Off x86-64 the builds are -march=native and portable.
- AMX (Sapphire Rapids and later) is a fourth permission, asked of the operating system per
  process (arch_prctl for the tile state, Linux 5.16+): `amx_unusable` runs AMX_CHECK (the
  permission, then an exact product on the tiles) in a child process once per build and machine,
  then asks for this process's own permission; only then do float32 products of many rows take
  `linear_amx` (`float_products`), whose bfloat16 parts keep a float32 GEMM's accuracy.
  llama.cpp's AMX path faults in the virtual machines this was written on (GCC 12's tile
  configuration intrinsic, decode.c's comment); a fault here costs the child only.
- OpenMP links to libgomp.so.1, which torch's wheel has already loaded under that name: the kernels
  share torch's thread pool and its `torch.set_num_threads`. A compiler without OpenMP (Apple's
  clang, clang without libomp) builds them with -fopenmp-simd instead (`openmp_or_not`): the same
  numbers on one thread (`openmp()` False, said in one line; tests/test_kernels_without_openmp.py
  checks clang's build so, two threads asked for).
- No compiler (CC naming none, or no cc, gcc or clang; whatever ATTNLAB_KERNELS forces), a compiler
  that fails, a non-CPU tensor or ATTNLAB_KERNELS=0: `available()` is False and every caller takes
  its PyTorch path, which computes the same equation (tests/test_kernels.py holds them together);
  `unavailable()` says why, and but for ATTNLAB_KERNELS=0 so does one line (attnlab.slower), once
  per process, as it does for a better build passed over.
- Only the forward computation, for inference: the functions here take no gradients (callers check).
- The weights a decode step streams are moved once into 2 MB pages (`place_in_huge_pages`, Linux's
  transparent huge pages, asked for with madvise), in the order the step reads them: fewer TLB
  misses, and the hardware prefetcher runs on past where a 4 KB page would stop it (measured in
  benchmarks/README.md, issue 14). llama.cpp asks for no huge pages: it reads the weights through a
  plain mmap of the GGUF file or from buffers of posix_memalign, which get whatever pages the
  kernel's transparent-huge-page setting gives.
- The bound those weights are read at, `read_bandwidth`, is measured by decode.c itself
  (attnlab_read_pass: every thread its part, the build's widest loads, integer sums, 2 MB pages;
  the best of a plain and a prefetching pass), not by a torch reduction, which read slower than
  the float32 decode step streams (benchmarks/README.md, issue 25).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import mmap
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

import torch

from ... import machine, slower
from ...env import cache_root
from ...errors import UserError
from ...memory import HUGE_PAGE, fresh, new_tensor
from ...model.layers import LayerNorm
from ...quant.blocks import BLOCK_TYPES

SOURCE = Path(__file__).with_name("decode.c")
CPU_SOURCE = Path(__file__).with_name("cpu.c")  # what the CPU and the OS allow (CpuLevel)


class CpuLevel(enum.IntFlag):
    """cpu.c's ATTNLAB_CPU_* bits: the instruction sets of the x86 builds, usable here."""

    AVX2 = 1  # AVX2, FMA, F16C; ymm state enabled by the OS
    AVX512 = 2  # AVX-512 F, BW, VL, DQ, VNNI; zmm and opmask state enabled by the OS


_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
# decode.c's builds, best first: name -> (compiler flags, the CpuLevel it needs). On x86-64 the
# first three, each the same program on every machine: its instruction sets named, and no
# -march=native or -mtune=native (tuned for a Zen 3, gcc vectorised other loops of the AVX2 build:
# other orders of summation, an 8-bit rounding that went the other way, and SmolLM2's perplexity
# moved past tests/test_blocks.py's bound there and not here); elsewhere "native" and "portable".
VARIANTS: dict[str, tuple[list[str], CpuLevel]] = {
    "avx512": (["-O3", *_AVX512, "-fopenmp"], CpuLevel.AVX512),
    "avx2": (["-O3", *_AVX2, "-fopenmp"], CpuLevel.AVX2),
    "native": (["-O3", "-march=native", "-fopenmp"], CpuLevel(0)),
    "portable": (["-O3", "-fopenmp"], CpuLevel(0)),
}
# bytes of weights from which `place_in_huge_pages` moves them (smaller ones sit in cache)
HUGE_PAGES_FROM = 4 << 20

_i64, _int, _ptr, _float = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


class Op(enum.IntEnum):
    """decode.c's attnlab_op_kind: the kernels a step program can hold, in the same order."""

    LINEAR_F32 = 0
    LINEAR_I8 = 1
    ROPE = 2
    EMBED = 3
    ATTEND = 4
    RMS_NORM = 5
    LAYER_NORM = 6
    ACTIVATE = 7
    SILU_MUL = 8
    SOFTCAP = 9
    LINEAR_Q = 10
    EMBED_Q = 11
    ADD = 12
    MUL = 13
    WINDOW_MASK = 14


# The one table of the C interface: each op's attnlab_* function and its parameters' types, in
# order. The loader declares them to ctypes, a program op (OpCall) is laid out by them, and
# tests/test_kernels.py compares the table with decode.c's enum and prototypes.
KERNELS: dict[Op, tuple[str, list]] = {
    Op.LINEAR_F32: ("attnlab_linear_f32", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int]),
    Op.LINEAR_I8: (
        "attnlab_linear_i8",
        [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    ),
    Op.ROPE: ("attnlab_rope", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64]),
    Op.EMBED: ("attnlab_embed", [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _float]),
    Op.ATTEND: (
        "attnlab_attend",
        [_ptr] * 6 + [_i64, _ptr, _ptr] + [_i64] * 5 + [_ptr, _float, _int],
    ),
    Op.RMS_NORM: ("attnlab_rms_norm", [_ptr, _ptr, _ptr, _i64, _i64, _float]),
    Op.LAYER_NORM: ("attnlab_layer_norm", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _float]),
    Op.ACTIVATE: ("attnlab_activate", [_ptr, _i64, _int]),
    Op.SILU_MUL: ("attnlab_silu_mul", [_ptr, _ptr, _i64]),
    Op.SOFTCAP: ("attnlab_softcap", [_ptr, _i64, _float]),
    Op.LINEAR_Q: (
        "attnlab_linear_q",
        [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int, _int],
    ),
    Op.EMBED_Q: ("attnlab_embed_q", [_ptr, _ptr, _ptr, _i64, _i64, _int, _float]),
    Op.ADD: ("attnlab_add", [_ptr, _ptr, _i64]),
    Op.MUL: ("attnlab_mul", [_ptr, _ptr, _i64]),
    Op.WINDOW_MASK: ("attnlab_window_mask", [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
}
RUN = ("attnlab_run", [_ptr, _i64, _int])  # runs a program: its ops, their number, the threads
# greedy generation in C (Program.generate_greedy): the program, its ops' number, the threads,
# the tokens; the logits, rows, vocab; ids, position, slot, key mask, its length; out, its row
# stride, eos, done
GENERATE_GREEDY = (
    "attnlab_generate_greedy",
    [_ptr, _i64, _int, _i64, _ptr, _i64, _i64] + [_ptr] * 4 + [_i64, _ptr, _i64, _i64, _ptr],
)
# block rows -> the 16-row decode layout (blocks, out, d_out, d_in, block type); is it fast here
REPACK16 = ("attnlab_repack16", [_ptr, _ptr, _i64, _i64, _int])
REPACK16_FAST = ("attnlab_repack16_fast", [_int])
OPENMP = ("attnlab_openmp", [])  # _OPENMP's value in this build, 0 without OpenMP
# bytes of scratch attnlab_linear_q needs per thread, for rows and d_in
SCRATCH = ("attnlab_linear_q_scratch", [_i64, _i64])
# blocks -> float32 (blocks, out, rows, d_in, block type, threads)
DEQUANTIZE = ("attnlab_dequantize", [_ptr, _ptr, _i64, _i64, _int, _int])
# a prompt's products, many rows at once (x, weights, bias, y, scratch, rows, d_in, d_out, block
# type, threads): blocks with 8-bit activations, and float32 on tiles of float or dequantized ones
LINEAR_ROWS = [
    ("attnlab_linear_q_rows", [_ptr] * 5 + [_i64] * 3 + [_int, _int]),
    ("attnlab_linear_f_rows", [_ptr] * 5 + [_i64] * 3 + [_int, _int]),
]
# several block matrices times the same x, rounded once (x, n, weights[], biases[], ys[], d_outs[],
# block types[] int32, scratch, rows, d_in, threads): a layer's q, k, v, or its gate and up
LINEAR_Q_ROWS_MANY = ("attnlab_linear_q_rows_many", [_ptr, _i64] + [_ptr] * 6 + [_i64, _i64, _int])
ROWS_SCRATCH = ("attnlab_linear_rows_scratch", [_i64, _i64, _int])  # bytes for rows, d_in, threads
# a prompt's elementwise kernels, rows shared by the threads: RMSNorm (x, w, out, rows, d, eps,
# threads), SwiGLU's product in place (gate, up, n, threads), RoPE out of place (x, out, cos, sin,
# rows, heads, d_head, rotary_dim, threads)
ELEMENTWISE_ROWS = [
    ("attnlab_rms_norm_rows", [_ptr] * 3 + [_i64, _i64, _float, _int]),
    ("attnlab_silu_mul_rows", [_ptr, _ptr, _i64, _int]),
    ("attnlab_rope_rows", [_ptr] * 4 + [_i64] * 4 + [_int]),
    # RMSNorm with its hooks' parts (x, w, out, scale, normalized, rows, d, eps, threads)
    ("attnlab_rms_norm_parts_rows", [_ptr] * 5 + [_i64, _i64, _float, _int]),
    # SwiGLU's product into up (gate, up, n, threads)
    ("attnlab_silu_mul_up_rows", [_ptr, _ptr, _i64, _int]),
]
# a prompt's causal attention from position 0 (q, k, v, out, scratch, batch, T, heads, kv_heads,
# d_head, scale, threads), and its scratch bytes (batch, T, kv_heads, d_head, threads)
ATTEND_ROWS = ("attnlab_attend_rows", [_ptr] * 5 + [_i64] * 5 + [_float, _int])
ATTEND_ROWS_SCRATCH = ("attnlab_attend_rows_scratch", [_i64] * 4 + [_int])
ROWS_VECTORIZED = ("attnlab_linear_rows_vectorized", [])  # bit 0: 8-bit product, bit 1: float32
# float32 products on AMX tiles, of several matrices times the same x (x, n, weights[], biases[],
# ys[], d_outs[], scratch, rows, d_in, fresh: the ys on pages no cache holds, threads), their
# scratch bytes for one matrix (rows, d_in, d_out, threads: a call needs the most over its
# matrices), and whether this process may run them (asks the OS)
LINEAR_AMX = ("attnlab_linear_amx_many", [_ptr, _i64] + [_ptr] * 5 + [_i64, _i64, _int, _int])
LINEAR_AMX_SCRATCH = ("attnlab_linear_amx_scratch", [_i64] * 3 + [_int])
# SwiGLU's gate and silu(gate) · up on AMX tiles (x, w_gate, w_up, gate, post, scratch, rows,
# d_in, d_out, fresh, threads), and its scratch bytes (rows, d_in, d_out, threads)
LINEAR_AMX_SWIGLU = ("attnlab_linear_amx_swiglu", [_ptr] * 6 + [_i64] * 3 + [_int, _int])
LINEAR_AMX_SWIGLU_SCRATCH = ("attnlab_linear_amx_swiglu_scratch", [_i64] * 3 + [_int])
# the attention steps' two products on AMX tiles, as ATTEND_STEPS' first and third (with scratch),
# all three steps in one call (q, k, v, scores, pattern, out, scratch, batch, T, heads, kv_heads,
# d_head, scale, threads), and their scratch bytes (T, S, d_head, threads)
ATTEND_AMX = [
    ("attnlab_attend_scores_amx", [_ptr] * 4 + [_i64] * 5 + [_float, _int]),
    ("attnlab_attend_mix_amx", [_ptr] * 4 + [_i64] * 6 + [_int]),
    ("attnlab_attend_explicit_amx", [_ptr] * 7 + [_i64] * 5 + [_float, _int]),
]
ATTEND_AMX_SCRATCH = ("attnlab_attend_amx_scratch", [_i64] * 3 + [_int])
AMX_PERMITTED = ("attnlab_amx_permitted", [])
# one read-only pass over a buffer (its address, bytes, threads, prefetch distance or 0): the read
# bandwidth's probe; and the decode products' prefetch distance
READ_PASS = ("attnlab_read_pass", [_ptr, _i64, _int, _i64])
PREFETCH_AHEAD = ("attnlab_prefetch_ahead", [])
# a prompt's causal attention from position 0 in three steps, for hooks between them: the masked
# scores (q, k, scores, scratch, batch, T, heads, kv_heads, d_head, scale, threads), each row's
# softmax (scores, pattern, rows, n, threads) and the pattern times V (pattern, v, out, batch, T,
# S, heads, kv_heads, d_head, threads)
ATTEND_STEPS = [
    ("attnlab_attend_scores", [_ptr] * 4 + [_i64] * 5 + [_float, _int]),
    ("attnlab_softmax_rows", [_ptr, _ptr, _i64, _i64, _int]),
    ("attnlab_attend_mix", [_ptr] * 3 + [_i64] * 6 + [_int]),
]


class BlockKind(enum.IntEnum):
    """decode.c's attnlab_block_type: the ggml block types attnlab_linear_q multiplies, in the same
    order (attnlab.quant.blocks.BLOCK_TYPES names the same numbers)."""

    Q8_0 = 0
    Q4_0 = 1
    Q4_1 = 2
    Q5_0 = 3
    Q4_K = 4
    Q5_K = 5
    Q6_K = 6


# the block kinds the prompt products (attnlab_linear_q_rows / _f_rows) unpack: decode.c's
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


class Activation(enum.IntEnum):
    """decode.c's attnlab_activation: the MLP nonlinearities attnlab_activate computes, in the same
    order."""

    GELU = 0
    GELU_TANH = 1
    RELU = 2
    RELU2 = 3


ACTIVATIONS = {
    "gelu": Activation.GELU,
    "gelu_tanh": Activation.GELU_TANH,
    "relu": Activation.RELU,
    "relu2": Activation.RELU2,
}  # ModelConfig.mlp -> attnlab_activate's kind


class OpCall(ctypes.Structure):
    """decode.c's attnlab_op: one kernel call of a step program."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("wait", ctypes.c_int64),
        ("a", ctypes.c_int64 * 17),
        ("f", ctypes.c_double),
    ]


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_id() -> str:
    """The CPU's model and feature flags: -march=native code is only valid on the CPU it was built
    for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return "\n".join(
            line
            for line in text.splitlines()
            if line.startswith(("model name", "flags", "Features"))
        )[:8192]
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> list[str] | None:
    """The C compiler's command: $CC's (split as a shell would: `CC="ccache gcc"`) where its
    program exists, else cc, gcc or clang on PATH; None when there is none (CC naming a program
    that does not exist is none: it is not replaced by another)."""
    named = os.environ.get("CC", "").strip()
    if named:
        command = shlex.split(named)
        found = shutil.which(command[0])
        return None if found is None else [found, *command[1:]]
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return None if found is None else [found]


def no_compiler() -> str | None:
    """Why there is no C compiler to build the kernels with (None: there is one), and the fix."""
    if _compiler() is not None:
        return None
    named = os.environ.get("CC", "").strip()
    where = f"CC={named} names no program here" if named else "no cc, gcc or clang on PATH"
    return (
        f"no C compiler ({where}); install one (apt-get install gcc, or xcode-select --install "
        "on macOS)"
    )


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def compile_library(
    source: Path, flag_sets: tuple[list[str], ...], verbose: bool = False
) -> Path | None:
    """The cached shared library of `source` for this machine, compiled first if needed with the
    first of `flag_sets` that compiles; None when none does."""
    compiler = _compiler()
    if compiler is None:
        return None
    text = source.read_bytes()
    for flags in flag_sets:
        key = hashlib.sha256(
            b"\0".join(
                [text, " ".join(flags).encode(), " ".join(compiler).encode(), _cpu_id().encode()]
            )
        )
        target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            result = subprocess.run(
                [*compiler, *flags, "-shared", "-fPIC", str(source), "-o", tmp, "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode == 0:
                os.replace(tmp, target)
                return target
            if verbose:
                command = " ".join([*compiler, *flags])
                print(f"attnlab kernels: {command} failed:\n{result.stderr}")
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return None


def cpu_levels() -> CpuLevel:
    """The x86 instruction sets this CPU reports and its operating system enables (cpu.c); none
    off x86-64 or without a compiler."""
    if not _is_x86():
        return CpuLevel(0)
    path = compile_library(CPU_SOURCE, (["-O2"],))
    if path is None:
        return CpuLevel(0)
    return CpuLevel(ctypes.CDLL(str(path)).attnlab_cpu_levels())


def build_names() -> tuple[str, ...]:
    """decode.c's builds on this kind of processor, best first: avx512, avx2 and portable on
    x86-64; native and portable elsewhere."""
    return ("avx512", "avx2", "portable") if _is_x86() else ("native", "portable")


def variants_here() -> list[str]:
    """The names of VARIANTS this machine may run, best first (before the self-check)."""
    if not _is_x86():
        return list(build_names())
    levels = cpu_levels()
    return [name for name in build_names() if VARIANTS[name][1] & levels == VARIANTS[name][1]]


def instructions(name: str) -> list[str]:
    """The instruction sets build `name` is compiled for, as the CPU's flags name them (Linux's
    /proc/cpuinfo; macOS's sysctl without its underscores)."""
    flags = VARIANTS[name][0]
    named = [f.removeprefix("-m") for f in flags if f.startswith("-m") and "=" not in f]
    return [n.replace("avx512vnni", "avx512_vnni") for n in named]


def why_not_here(name: str, flags: Iterable[str] | None = None) -> str:
    """Why this CPU cannot execute build `name` (one `variants_here` leaves out): the instructions
    it lacks, by the flags it reports (`flags`, else machine.describe()'s); else (every flag
    there) that its operating system does not enable their registers (cpu.c, XCR0)."""
    reported = machine.describe().flags if flags is None else flags
    have = {flag.lower().replace("_", "") for flag in reported}
    lacking = [n for n in instructions(name) if n.replace("_", "") not in have]
    if lacking:
        return f"this CPU lacks {', '.join(lacking)} (the {name} build's instructions)"
    return (
        f"this CPU's operating system does not enable the registers of the {name} build's "
        f"instructions ({', '.join(instructions(name))}: kernels.cpu_levels)"
    )


# The self-check a child process runs on a fresh build: exact small-integer products through the
# float32, int8 and Q8_0 / Q4_0 block kernels (every block scale 1, every x an integer of at most
# 127, so that rounding x to 8 bits changes nothing and every build must give the same sums).
SELF_CHECK = """
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
P, I, N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
d_in, d_out = 256, 6
x = [127.0 if i % 32 == 5 else float((7 * i) % 23 - 11) for i in range(d_in)]  # 127 in each block
w = [[(3 * i + 5 * o) % 15 - 7 for i in range(d_in)] for o in range(d_out)]
want = [sum(a * b for a, b in zip(x, row)) for row in w]
buf = lambda fmt, v: ctypes.create_string_buffer(struct.pack(f"<{len(v)}{fmt}", *v), 8 * len(v))
out = lambda: ctypes.create_string_buffer(4 * d_out)
got = lambda o: list(struct.unpack(f"<{d_out}f", o.raw[: 4 * d_out]))
X = buf("f", x)
y = out()
lib.attnlab_linear_f32.argtypes = [P, P, P, P, I, I, I, N, N]
lib.attnlab_linear_f32(X, buf("f", [float(v) for r in w for v in r]), None, y, 1, d_in, d_out, 0, 1)
assert got(y) == want, ("f32", got(y), want)
y = out()
lib.attnlab_linear_i8.argtypes = [P, P, P, P, P, I, I, I, N, N]
lib.attnlab_linear_i8(X, buf("b", [v for r in w for v in r]), buf("f", [1.0] * d_out), None, y,
                      1, d_in, d_out, 0, 1)
assert got(y) == want, ("int8", got(y), want)
lib.attnlab_linear_q_scratch.restype = I
lib.attnlab_linear_q_scratch.argtypes = [I, I]
lib.attnlab_linear_q.argtypes = [P, P, P, P, P, I, I, I, N, N, N]
one = struct.pack("<e", 1.0)  # every block scale
q8 = b"".join(one + struct.pack("<32b", *r[i : i + 32]) for r in w for i in range(0, d_in, 32))
q4 = b"".join(
    one + bytes(((r[i + j] + 8) | ((r[i + j + 16] + 8) << 4)) for j in range(16))
    for r in w for i in range(0, d_in, 32)
)
for kind, blocks in ((0, q8), (1, q4)):
    scratch = ctypes.create_string_buffer(lib.attnlab_linear_q_scratch(1, d_in) + 64)
    aligned = ctypes.addressof(scratch) + (-ctypes.addressof(scratch) % 64)
    y = out()
    lib.attnlab_linear_q(X, ctypes.create_string_buffer(blocks, len(blocks)), None, y, aligned,
                         1, d_in, d_out, kind, 0, 1)
    assert got(y) == want, (kind, got(y), want)
print("ok")
"""


# The AMX product's check in a child process, where a fault costs nothing: the operating system's
# permission (attnlab_amx_permitted), then a product of odd shapes whose every value is a small
# integer or a half (exact in float32 and in any order of summation), bias included.
AMX_CHECK = """
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
lib.attnlab_amx_permitted.restype = ctypes.c_int
if lib.attnlab_amx_permitted() != 1:
    sys.exit("this CPU or its operating system does not let a process run AMX tiles")
P, I, N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
rows, d_in, d_out = 37, 70, 45
x = [((5 * r + 3 * i) % 17 - 8) / 2 for r in range(rows) for i in range(d_in)]
w = [(7 * o + 2 * i) % 13 - 6.0 for o in range(d_out) for i in range(d_in)]
b = [o - 20.0 for o in range(d_out)]
want = [sum(x[r * d_in + i] * w[o * d_in + i] for i in range(d_in)) + b[o]
        for r in range(rows) for o in range(d_out)]
lib.attnlab_linear_amx_scratch.restype = I
lib.attnlab_linear_amx_scratch.argtypes = [I, I, I, N]
scratch = ctypes.create_string_buffer(lib.attnlab_linear_amx_scratch(rows, d_in, d_out, 2) + 64)
buf = lambda v: ctypes.create_string_buffer(struct.pack(f"<{len(v)}f", *v), 4 * len(v))
y = ctypes.create_string_buffer(4 * rows * d_out)
lib.attnlab_linear_amx.argtypes = [P] * 5 + [I] * 3 + [N]
lib.attnlab_linear_amx(buf(x), buf(w), buf(b), y, scratch, rows, d_in, d_out, 2)
got = list(struct.unpack(f"<{rows * d_out}f", y.raw))
assert got == want, ("amx", [(g, v) for g, v in zip(got, want) if g != v][:3])
print("ok")
"""


# signals that stop a child from outside: they say nothing about the build it was checking
NOT_THE_BUILD = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def self_check(path: Path, script: str = SELF_CHECK, suffix: str = ".checked") -> str | None:
    """None when the library at `path` passes `script` (SELF_CHECK, or AMX_CHECK) in a child
    process, else why not (a fault, a wrong sum). A verdict that would be the same next time
    (passed, an instruction fault, a wrong sum) is cached in a file beside the library (`suffix`);
    the child killed from outside (an out-of-memory kill, a Ctrl-C) or out of time is not, so the
    next process checks again."""
    verdict = path.with_suffix(suffix)
    if verdict.is_file():
        text = verdict.read_text()
        return None if text == "ok" else text
    try:
        result = subprocess.run(
            [sys.executable, "-I", "-S", "-c", script, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        why = None
        if result.returncode != 0 or result.stdout.strip() != "ok":
            lines = (result.stderr.strip() or f"exit status {result.returncode}").splitlines()
            why = f"its self-check failed ({lines[-1][:200]}; exit status {result.returncode})"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"its self-check could not run ({exc})"
    if -result.returncode in NOT_THE_BUILD:
        return why
    fd, tmp = tempfile.mkstemp(prefix=".check-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(why or "ok")
    os.replace(tmp, verdict)
    return why


def choose_variant(verbose: bool = False) -> tuple[str, Path] | None:
    """(name, library) of the decode.c build this process runs: ATTNLAB_KERNELS's when it names
    one, else the best of `variants_here()` that compiles and passes its self-check; None when
    none does, without a C compiler (whatever ATTNLAB_KERNELS names: there is nothing to build),
    or with ATTNLAB_KERNELS=0. A forced build this machine does not allow is a UserError."""
    return _choose(verbose)[0]


def _choose(verbose: bool = False) -> tuple[tuple[str, Path] | None, list[str], str | None]:
    """`choose_variant`'s choice, why each better build was passed over ("the avx512 build: it
    does not compile"), and why there is none (None: there is one)."""
    wanted = os.environ.get("ATTNLAB_KERNELS", "1").strip().lower()
    if wanted == "0":
        return None, [], "ATTNLAB_KERNELS=0"
    forced = wanted not in ("1", "")
    names = build_names()
    if forced and wanted not in names:
        raise UserError(
            f"ATTNLAB_KERNELS={wanted}: not a build of attnlab's kernels on this machine; "
            f"use one of {', '.join(names)}, 1 (the best allowed) or 0 (none)"
        )
    missing = no_compiler()  # before the CPU is read: cpu.c needs the compiler too
    if missing is not None:
        return None, [], missing
    here = variants_here()
    if forced:
        if wanted not in here:
            raise UserError(
                f"ATTNLAB_KERNELS={wanted}: {why_not_here(wanted)}; use one of {', '.join(here)}"
            )
        here = [wanted]
    passed_over = []
    for name in here:
        path = compile_library(SOURCE, openmp_or_not(VARIANTS[name][0]), verbose)
        why = "it does not compile" if path is None else self_check(path)
        if why is None:
            return (name, path), passed_over, None
        if forced:
            raise UserError(f"ATTNLAB_KERNELS={wanted}: the {name} build cannot run here: {why}")
        if verbose:
            print(f"attnlab kernels: the {name} build is not used: {why}")
        passed_over.append(f"the {name} build: {why}")
    compiler = " ".join(_compiler() or [])
    return (
        None,
        passed_over,
        f"no build of them runs here ({'; '.join(passed_over)}; compiler {compiler}; "
        "kernels.build(verbose=True) prints its errors)",
    )


def openmp_or_not(flags: list[str]) -> tuple[list[str], ...]:
    """`flags`, then the same without OpenMP's runtime for a compiler that has none (Apple's clang,
    clang without libomp): -fopenmp-simd keeps decode.c's `omp simd` reductions, and so the same
    order of summation and the same numbers (without it gcc summed a float32 product's and
    RMSNorm's terms in another order), and ignores the rest, so each kernel runs on the calling
    thread (decode.c, attnlab_openmp); then neither, for a compiler that knows neither flag."""
    if "-fopenmp" not in flags:
        return (flags,)
    without = [f for f in flags if f != "-fopenmp"]
    return flags, [*without, "-fopenmp-simd"], without


def build(verbose: bool = False, flag_sets: tuple[list[str], ...] | None = None) -> Path | None:
    """The cached shared library this machine runs (`choose_variant`), built first if needed; or,
    given `flag_sets`, decode.c compiled with the first of them that compiles, each without
    OpenMP's runtime after it where the compiler has none (`openmp_or_not`; tests build the other
    variants so). None when there is none."""
    if flag_sets is not None:
        every = tuple(each for flags in flag_sets for each in openmp_or_not(flags))
        return compile_library(SOURCE, every, verbose)
    chosen = choose_variant(verbose)
    return None if chosen is None else chosen[1]


@cache
def decision() -> tuple[tuple[str, Path] | None, list[str], str | None]:
    """This process's `_choose()`, decided once; a slower choice than this CPU allows is said in
    one line (attnlab.slower): no kernels at all (but for ATTNLAB_KERNELS=0, the user's own
    choice), or a better build passed over."""
    chosen, passed_over, why_none = _choose()
    if chosen is None and why_none != "ATTNLAB_KERNELS=0":
        slower.say(
            "generation and forward passes run on torch's paths", "attnlab's C kernels", why_none
        )
    elif chosen is not None and passed_over:
        slower.say(
            f"attnlab's C kernels run their {chosen[0]} build",
            "a better one this CPU allows",
            "; ".join(passed_over),
        )
    return chosen, passed_over, why_none


def chosen_variant() -> tuple[str, Path] | None:
    """This process's `choose_variant()`, decided once (`decision`)."""
    return decision()[0]


def use_variant(name: str | None) -> None:
    """From now on this process runs decode.c's build `name` (as ATTNLAB_KERNELS=name would have
    chosen it; None: the default choice again), so that a benchmark can time two builds side by
    side in one run. Kernel calls prepared before keep the build they were prepared with."""
    if name is None:
        os.environ.pop("ATTNLAB_KERNELS", None)
    else:
        os.environ["ATTNLAB_KERNELS"] = name
    decision.cache_clear()
    library.cache_clear()


def variant() -> str | None:
    """The name of the decode.c build this process runs (VARIANTS), None without kernels."""
    chosen = chosen_variant()
    return None if chosen is None else chosen[0]


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, build failed, or ATTNLAB_KERNELS=0): callers fall
    back to PyTorch. A build without OpenMP (`openmp`) is said in one line: its kernels run on
    one thread."""
    chosen = chosen_variant()
    try:
        lib = None if chosen is None else load(chosen[1])
    except OSError:
        return None
    if lib is not None and not lib.attnlab_openmp():
        slower.say(
            "attnlab's C kernels run on one thread",
            "on torch's threads",
            f"{' '.join(_compiler() or ['the compiler'])} built them without OpenMP (-fopenmp "
            "failed); gcc, or clang with libomp (apt-get install libomp-dev), builds them with it",
        )
    return lib


def unavailable() -> str | None:
    """Why this process runs no C kernels (None: it runs them): ATTNLAB_KERNELS=0, no C
    compiler, no build that compiles and passes its self-check, or one that does not load."""
    if library() is not None:
        return None
    chosen, _, why_none = decision()
    return why_none or f"the {chosen[0]} build of attnlab's kernels does not load"


def openmp() -> bool | None:
    """Whether the kernels this process runs were built with OpenMP, so that they run on
    torch.get_num_threads() threads (False: on one thread, decode.c's attnlab_openmp); None without
    kernels."""
    lib = library()
    return None if lib is None else bool(lib.attnlab_openmp())


def load(path: Path) -> ctypes.CDLL:
    """The kernels of the shared library at `path`, their argument types declared."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in [
        *KERNELS.values(),
        RUN,
        DEQUANTIZE,
        *LINEAR_ROWS,
        LINEAR_Q_ROWS_MANY,
        ATTEND_ROWS,
        *ELEMENTWISE_ROWS,
        *ATTEND_STEPS,
        LINEAR_AMX,
        LINEAR_AMX_SWIGLU,
        *ATTEND_AMX,
    ]:
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    for (name, argtypes), restype in (
        (SCRATCH, _i64),
        (ROWS_SCRATCH, _i64),
        (ROWS_VECTORIZED, _int),
        (LINEAR_AMX_SCRATCH, _i64),
        (LINEAR_AMX_SWIGLU_SCRATCH, _i64),
        (ATTEND_AMX_SCRATCH, _i64),
        (AMX_PERMITTED, _int),
        (ATTEND_ROWS_SCRATCH, _i64),
        (READ_PASS, ctypes.c_uint64),
        (PREFETCH_AHEAD, _i64),
        (GENERATE_GREEDY, _i64),
        (REPACK16, None),
        (REPACK16_FAST, _int),
        (OPENMP, _int),
    ):
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    for name in [n for n, value in vars(lib).items() if isinstance(value, ctypes._CFuncPtr)]:
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


def available() -> bool:
    return library() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernels can stand in for PyTorch here: built, every tensor on the CPU, and no
    gradient wanted (the kernels have no backward)."""
    grad = torch.is_grad_enabled()
    if not all(t.device.type == "cpu" and not (grad and t.requires_grad) for t in tensors):
        return False
    return library() is not None


class Call:
    """The kernel of op `kind` with its arguments bound: tensors by address (and kept alive by it:
    they must never move), None as NULL. Calling it runs the kernel; a decode step is a list of
    these, prepared once (by the *_call functions below, one per kernel, which check what the C code
    trusts), and `program` runs such a list
    as one. `wait` False: in a program the threads go on without waiting for each other, up to the
    next call that waits; so no call in that stretch, that one included, may read what this one
    writes or write what it reads."""

    def __init__(self, kind: Op, *args) -> None:
        self.kind = kind
        self.values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        # the memory the C code reads and writes
        self.tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.wait = True
        self._run = functools.partial(getattr(library(), KERNELS[kind][0]), *self.values)

    def __call__(self) -> None:
        self._run()

    def op(self) -> OpCall:
        """This call as one op of a step program: its arguments in order, the float one in `f`."""
        op = OpCall(kind=self.kind, wait=int(self.wait))
        for i, (value, kind) in enumerate(zip(self.values, KERNELS[self.kind][1], strict=True)):
            if kind is _float:
                op.f = value
            else:
                op.a[i] = int(value or 0)
        return op


def independent(call: Call) -> Call:
    """`call`, marked as not needing the threads to wait for each other before the next call (see
    Call)."""
    call.wait = False
    return call


class Program:
    """Calls run as one: a single C call that opens one OpenMP parallel region for all of them
    (decode.c, attnlab_run), instead of one Python call and one region each."""

    def __init__(self, calls: list[Call], threads: int) -> None:
        # a block product's scratch has one part per thread it was prepared for
        assert all(threads <= c.values[-1] for c in calls if c.kind == Op.LINEAR_Q)
        self.calls = calls  # which keep their tensors alive
        self.ops = (OpCall * len(calls))(*(call.op() for call in calls))
        self.threads = threads
        self._run = functools.partial(library().attnlab_run, self.ops, len(calls), threads)

    def __call__(self) -> None:
        self._run()

    def generate_greedy(
        self,
        tokens: int,
        logits: torch.Tensor,
        ids: torch.Tensor,
        position: torch.Tensor,
        slot: torch.Tensor,
        key_mask: torch.Tensor | None,
        out: torch.Tensor,
        eos: int | None,
        done: torch.Tensor,
    ) -> int:
        """Greedy generation with no Python between tokens (decode.c, attnlab_generate_greedy):
        `tokens` times, the argmax of each row of `logits` (rows, vocab) goes to out[:, i] and,
        unless it was the last, into this program's inputs (ids; position and slot one further;
        key_mask's new slot marked), and the program runs, computing the next logits in `logits`.
        A row that made `eos` makes it from then on (done: rows, bool), and generation ends once
        every row has. Returns the number of tokens written. This program must be a whole decode
        step that reads ids, position, slot and key_mask and writes `logits`."""
        rows, vocab = logits.shape
        assert logits.is_contiguous() and out.dtype == ids.dtype == position.dtype == torch.int64
        assert out.shape[0] == rows and out.stride(1) == 1 and 0 <= tokens <= out.shape[1]
        assert ids.numel() == position.numel() == done.numel() == rows and done.dtype == torch.bool
        assert key_mask is None or (key_mask.dtype == torch.bool and key_mask.is_contiguous())
        return library().attnlab_generate_greedy(
            self.ops,
            len(self.calls),
            self.threads,
            tokens,
            logits.data_ptr(),
            rows,
            vocab,
            ids.data_ptr(),
            position.data_ptr(),
            slot.data_ptr(),
            None if key_mask is None else key_mask.data_ptr(),
            0 if key_mask is None else key_mask.shape[1],
            out.data_ptr(),
            out.stride(0),
            -1 if eos is None else eos,
            done.data_ptr(),
        )


def program(steps: list[Callable[[], object]]) -> list[Callable[[], object]]:
    """`steps` with each run of consecutive kernel calls made one Program; other steps (PyTorch
    calls) stay between them, run in order."""
    out, run = [], []
    for step in [*steps, None]:
        if isinstance(step, Call):
            run.append(step)
            continue
        if run:  # (a program's end waits for every thread: what follows may read anything it wrote)
            out.append(Program(run, torch.get_num_threads()))
            run = []
        if step is not None:
            out.append(step)
    return out


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
    per block of 32 on the way (decode.c, attnlab_linear_q); all contiguous. `repacked`: the blocks
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
    per_thread = getattr(library(), SCRATCH[0])(rows, d_in)
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


# the block kinds with a 16-row decode layout (decode.c, attnlab_repack16), and the flag that marks
# a LINEAR_Q op's weights as in it
REPACKABLE = (BlockKind.Q8_0, BlockKind.Q4_0, BlockKind.Q4_1, BlockKind.Q5_0, BlockKind.Q4_K)
REPACKED = 0x100


def repack16(
    blocks: torch.Tensor, kind: BlockKind, d_in: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The same blocks (uint8 (d_out, row bytes), d_out a multiple of 16, kind in REPACKABLE) in
    the 16-row decode layout (decode.c, attnlab_repack16: sixteen rows' blocks interleaved so that
    one 512-bit lane holds one row): a tensor of the same shape and bytes (`out`, or a new one)."""
    d_out, t = blocks.shape[0], _block_type(kind)
    assert kind in REPACKABLE and d_out % 16 == 0 and blocks.is_contiguous()
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (d_out, t.row_bytes(d_in))
    if out is None:
        out = torch.empty_like(blocks)
    assert out.shape == blocks.shape and out.dtype == torch.uint8 and out.is_contiguous()
    assert out.data_ptr() != blocks.data_ptr()
    library().attnlab_repack16(blocks.data_ptr(), out.data_ptr(), d_out, d_in, int(kind))
    return out


def repack16_fast(kind: BlockKind) -> bool:
    """Whether this build's 16-row products of `kind` are its fastest decode products (AVX-512
    VNNI; AVX2 with FMA and F16C but for Q5_0 and Q4_K): generation repacks only then (the other
    builds compute them a lane at a time, for tests)."""
    return bool(library().attnlab_repack16_fast(int(kind)))


def block_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    kind: BlockKind,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """x Wᵀ + b for x (..., d_in) and W in blocks, as `block_linear_call`; returns `out` (...,
    d_out), a new tensor by default. Callers check `usable`."""
    x = x.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], blocks.shape[0], dtype=torch.float32)
    block_linear_call(x, blocks, kind, bias, out, accumulate)()
    return out


def dequantize(blocks: torch.Tensor, kind: BlockKind, d_in: int) -> torch.Tensor:
    """The float32 matrix (d_out, d_in) that `blocks` (uint8, contiguous) of `kind` stand for, on
    torch's threads: attnlab.quant.blocks.dequantize's values, bit for bit. Callers check
    `usable`."""
    d_out, t = blocks.shape[0], _block_type(kind)
    assert tuple(blocks.shape) == (d_out, t.row_bytes(d_in)) and d_in % t.weights == 0
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    out = torch.empty(d_out, d_in)
    library().attnlab_dequantize(
        blocks.data_ptr(), out.data_ptr(), d_out, d_in, int(kind), torch.get_num_threads()
    )
    return out


def embed_blocks_call(
    ids: torch.Tensor, blocks: torch.Tensor, kind: BlockKind, out: torch.Tensor, scale: float = 1.0
) -> Call:
    """out (rows, d) = the rows ids (rows int64, read at each call) of a table in blocks (uint8
    (d_vocab, row bytes), contiguous), dequantized in C (decode.c, attnlab_embed_q: bit-equal to
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
    row_bytes, lib = blocks.shape[1], library()
    assert blocks.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
    assert row_bytes == _block_type(kind).row_bytes(d) and ids.numel() == rows
    base, at = blocks.data_ptr(), out.data_ptr()  # read at each call: the blocks may have moved
    for r, token in enumerate(ids.tolist()):
        if not 0 <= token < blocks.shape[0]:  # as torch's lookup: never a read past the table
            raise IndexError(f"token id {token} is out of range for {blocks.shape[0]} rows")
        lib.attnlab_dequantize(base + token * row_bytes, at + 4 * r * d, 1, d, int(kind), 1)


def rows_vectorized() -> tuple[bool, bool]:
    """Whether this build's prompt products (`block_linear_rows`, `linear_rows`) run vectorised:
    (the 8-bit product on AVX-512 VNNI, the float32 one on AVX-512). Generation takes them for
    prompts only then (attnlab.generate.fast_layers); elsewhere they are plain loops, for tests."""
    bits = getattr(library(), ROWS_VECTORIZED[0])()
    return bool(bits & 1), bool(bits & 2)


FLOAT_ROWS = ("amx", "c", "torch")  # ATTNLAB_FLOAT_ROWS: force the choice of float_products


def _forced_float_rows() -> str | None:
    forced = os.environ.get("ATTNLAB_FLOAT_ROWS")
    if forced and forced not in FLOAT_ROWS:
        raise UserError(
            f"ATTNLAB_FLOAT_ROWS={forced}: it takes {', '.join(FLOAT_ROWS[:-1])} or "
            f"{FLOAT_ROWS[-1]} (or unset: AMX where allowed, else measured)"
        )
    return forced or None


def float_rows() -> bool:
    """Whether float32 work of many rows (a prompt's attention, and its products where
    `float_products` says "c": forward passes without gradients, attnlab.generate.fast_layers)
    takes the C kernels: where this build's float32 tiles are vectorised (AVX-512) and multiply
    faster than torch's GEMM on this machine, measured once per machine, build and thread count
    (`_tiles_beat_torch`). Which is faster is not a matter of the instruction sets alone: MKL
    takes its AVX-512 path on Intel CPUs and not on AMD's, and torch's GEMM may be built on
    another BLAS (benchmarks/README.md, issue 25). ATTNLAB_FLOAT_ROWS=c or torch chooses instead
    (amx: the measured choice, for the attention); a name it does not take is one line in every
    build."""
    forced = _forced_float_rows()
    if not rows_vectorized()[1]:
        return False
    if forced in ("c", "torch"):
        return forced == "c"
    return _tiles_beat_torch(variant(), torch.get_num_threads())


def float_products() -> str:
    """Which product float32 matrices take for many rows (a prompt, a forward pass without
    gradients; attnlab.generate.fast_layers.KernelLinear): "amx" (`linear_amx`, AMX's bfloat16
    tiles at float32's accuracy) where this process may run them (`amx_unusable`), else "c"
    (`linear_rows`, the float32 tiles) where `float_rows`, else "torch" (its GEMM).
    ATTNLAB_FLOAT_ROWS=amx, c or torch chooses instead; amx where AMX cannot run is one line
    naming why."""
    forced = _forced_float_rows()
    if forced == "amx" or (forced is None and amx_unusable() is None):
        why = amx_unusable()
        if why is not None:
            raise UserError(f"ATTNLAB_FLOAT_ROWS=amx: {why}; use c or torch, or leave it unset")
        return "amx"
    return "c" if float_rows() else "torch"


def amx_unusable() -> str | None:
    """Why this process cannot take `linear_amx` (None: it can): no AVX-512 build of the kernels,
    or AMX_CHECK's child process failed (the CPU lacks AMX-BF16, the operating system does not
    grant the tile state, a fault, a wrong sum). Decided once per process and build."""
    return _amx_unusable(chosen_variant())


@cache
def _amx_unusable(chosen: tuple[str, Path] | None) -> str | None:
    if chosen is None or chosen[0] != "avx512":
        return "AMX tiles are only in the AVX-512 build of attnlab's kernels"
    why = self_check(chosen[1], AMX_CHECK, ".amx-checked")
    if why is not None:
        return why.replace("its self-check failed", "its AMX check failed")
    if getattr(library(), AMX_PERMITTED[0])() != 1:  # this process's own permission
        return "the operating system did not grant this process AMX's tile state"
    return None


def _tiles_beat_torch(build: str | None, threads: int) -> bool:
    """Whether the float32 tiles of `build` multiply faster than torch's GEMM on `threads`
    threads: `tiles_against_torch`'s answer, measured once per machine (attnlab.machine.measured)
    and kept under a key of the build's name and library (its source, flags and compiler) and the
    thread count."""
    return tiles_against_torch(build, threads).values["tiles_won"]


def tiles_against_torch(build: str | None, threads: int) -> machine.Measured:
    """The float32 tiles against torch's GEMM on a 256 x 576 by 576 x 576 product (SmolLM2's
    q projection of 256 tokens), each the best of 5 after one warm-up, taking turns: values
    tiles_gflops, torch_gflops and tiles_won, measured once per machine, build and thread count."""
    chosen = chosen_variant()
    library_file = chosen[1].name if chosen is not None and chosen[0] == build else None

    def measure() -> dict[str, float | bool]:
        generator = torch.Generator().manual_seed(0)  # the caller's random state left alone
        x = torch.randn(256, 576, generator=generator)
        w = torch.randn(576, 576, generator=generator)
        times = {"c": [], "torch": []}
        runs = {
            "c": lambda: linear_rows(x, w, None),
            "torch": lambda: torch.nn.functional.linear(x, w),
        }
        for _ in range(6):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        best = {name: min(seconds[1:]) for name, seconds in times.items()}
        flops = 2 * 256 * 576 * 576
        return {
            "tiles_gflops": flops / best["c"] / 1e9,
            "torch_gflops": flops / best["torch"] / 1e9,
            "tiles_won": best["c"] < best["torch"],
        }

    extra = {"build": build, "library": library_file, "threads": threads, "version": 1}
    return machine.measured("float32-tiles-against-torch", measure, extra)


def _rows_scratch(rows: int, d_in: int, threads: int) -> torch.Tensor:
    """The prompt products' scratch for rows of d_in values on `threads` threads, 64-byte
    aligned."""
    scratch = torch.empty(
        getattr(library(), ROWS_SCRATCH[0])(rows, d_in, threads) + 64, dtype=torch.int8
    )
    return scratch[-scratch.data_ptr() % 64 :]


def _rows_product(
    name: str, x: torch.Tensor, weight: torch.Tensor, kind: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """decode.c's `name` (attnlab_linear_q_rows or attnlab_linear_f_rows) for x (..., d_in):
    (..., d_out), a new tensor."""
    x = x.contiguous()
    rows, d_in, d_out = x.numel() // x.shape[-1], x.shape[-1], weight.shape[0]
    assert x.dtype == torch.float32 and weight.is_contiguous()
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32)
    threads = torch.get_num_threads()
    scratch = _rows_scratch(rows, d_in, threads)
    out = torch.empty(*x.shape[:-1], d_out)
    getattr(library(), name)(
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
    as the decode step rounds them (decode.c, attnlab_linear_q_rows: `block_linear`'s numbers up
    to float32 summation order), or "float32", each tile of weights dequantized in turn
    (attnlab_linear_f_rows: the module path's product up to summation order). Returns a new tensor
    (..., d_out). Callers check `usable`."""
    d_in = x.shape[-1]
    assert BlockKind(kind) in ROWS_KINDS
    t = _block_type(kind)
    assert d_in % t.weights == 0 and blocks.dtype == torch.uint8
    assert tuple(blocks.shape) == (blocks.shape[0], t.row_bytes(d_in))
    name = {"8-bit": LINEAR_ROWS[0][0], "float32": LINEAR_ROWS[1][0]}[activations]
    return _rows_product(name, x, blocks, int(BlockKind(kind)), bias)


def block_linear_rows_many(
    x: torch.Tensor, matrices: list[tuple[torch.Tensor, BlockKind, torch.Tensor | None]]
) -> list[torch.Tensor]:
    """[x W_iᵀ + b_i] for each (blocks, kind, bias) of `matrices` (W_i (d_out_i, d_in) in blocks of
    a kind in ROWS_KINDS), x (..., d_in) rounded to 8 bits once for all of them: a layer's q, k and
    v, or its gate and up (decode.c, attnlab_linear_q_rows_many; each product is
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
    n, lib, threads = len(matrices), library(), torch.get_num_threads()
    scratch = _rows_scratch(rows, d_in, threads)

    def addresses(tensors):  # a C array of their addresses, NULL for None
        return (ctypes.c_void_p * n)(*(t.data_ptr() if t is not None else None for t in tensors))

    getattr(lib, LINEAR_Q_ROWS_MANY[0])(
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


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every row of x (..., d) float32, the rows shared by the threads (decode.c,
    attnlab_rms_norm_rows: the decode step's RMSNorm). Returns a new tensor."""
    x = x.contiguous()
    assert x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    getattr(library(), ELEMENTWISE_ROWS[0][0])(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm_parts_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of every row of x (..., d) float32 with the parts its hooks read: (out as
    `rms_norm_rows`, scale (..., 1) = sqrt(mean(x²) + eps), normalized = x / scale), one pass over
    each row (decode.c, attnlab_rms_norm_parts_rows). New tensors."""
    x = x.contiguous()
    assert x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
    out, normalized = new_tensor(*x.shape), new_tensor(*x.shape)
    scale = torch.empty(*x.shape[:-1], 1)
    d = x.shape[-1]
    getattr(library(), ELEMENTWISE_ROWS[3][0])(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), scale.data_ptr(), normalized.data_ptr(),
        x.numel() // d, d, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, scale, normalized


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate = silu(gate) · up in place (SwiGLU's product; gate and up contiguous float32 of the same
    shape, the values shared by the threads: decode.c, attnlab_silu_mul_rows). Returns gate."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    assert gate.dtype == up.dtype == torch.float32
    getattr(library(), ELEMENTWISE_ROWS[1][0])(
        gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads()
    )
    return gate


def silu_mul_up_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """up = silu(gate) · up in place (SwiGLU's product where a hook holds the gate; contiguous
    float32 of the same shape: decode.c, attnlab_silu_mul_up_rows). Returns up."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    assert gate.dtype == up.dtype == torch.float32
    getattr(library(), ELEMENTWISE_ROWS[4][0])(
        gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads()
    )
    return up


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [batch, pos, head, d_head] by cos, sin [batch, pos, 1, rotary_dim] (each position's
    angles, as attnlab.model.positions.Rotary gives them), out of place, the rows shared by the
    threads (decode.c, attnlab_rope_rows: the decode step's rotation). Returns a new tensor."""
    B, T, H, D = x.shape
    rotary_dim = cos.shape[-1]
    assert cos.shape == sin.shape == (B, T, 1, rotary_dim) and rotary_dim <= D
    assert x.dtype == cos.dtype == sin.dtype == torch.float32
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = new_tensor(*x.shape)
    getattr(library(), ELEMENTWISE_ROWS[2][0])(
        x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, H, D, rotary_dim,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b for many rows x (..., d_in) and float32 W (d_out, d_in), as `block_linear_rows`'s
    float32 product (decode.c, attnlab_linear_f_rows). Returns a new tensor (..., d_out). Callers
    check `usable`."""
    assert weight.dtype == torch.float32 and x.shape[-1] == weight.shape[1]
    return _rows_product(LINEAR_ROWS[1][0], x, weight, -1, bias)


def _no_amx_raises() -> None:
    """An AMX instruction without the OS's permission is an illegal instruction: `amx_unusable`
    (which asks for it) must have no objection first."""
    why = amx_unusable()
    if why is not None:
        raise RuntimeError(f"attnlab's AMX product cannot run here: {why}")


_scratch_kept = threading.local()
KEPT_SCRATCH_MAX = 32 << 20  # bytes: a prompt of ~2,000 rows of SmolLM2's widest product


def _kept_scratch(nbytes: int) -> torch.Tensor:
    """A scratch buffer of at least `nbytes`, kept from call to call by this Python thread (the
    kernels release the GIL, so threads never share one): a fresh one of several MB costs a page
    fault per 4 KB at every call, a millisecond of a 4 ms product (SmolLM2's down projection).
    Larger ones (long prompts, whose products take far longer than their page faults) are not
    kept: no thread holds more than KEPT_SCRATCH_MAX."""
    if nbytes > KEPT_SCRATCH_MAX:
        return torch.empty(nbytes, dtype=torch.int8)
    kept = getattr(_scratch_kept, "buffer", None)
    if kept is None or kept.numel() < nbytes:
        kept = _scratch_kept.buffer = torch.empty(nbytes, dtype=torch.int8)
    return kept


def linear_amx(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b for many rows x (..., d_in) and float32 W (d_out, d_in) on AMX tiles (decode.c,
    attnlab_linear_amx): each float32 value split exactly into three bfloat16 parts, six products
    of parts summed in float32, a float32 GEMM's accuracy. Returns a new tensor (..., d_out).
    Callers check `usable`; `amx_unusable` (which also asks the OS for this process's permission:
    an AMX instruction without it is an illegal instruction) is checked here."""
    return linear_amx_many(x, [(weight, bias)])[0]


def linear_amx_many(
    x: torch.Tensor, matrices: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> list[torch.Tensor]:
    """[x W_iᵀ + b_i] for each (W_i, b_i) of `matrices` (float32, W_i (d_out_i, d_in)), x split
    into its bfloat16 parts once for all of them: a layer's q, k and v, or its gate and up
    (decode.c, attnlab_linear_amx_many; each product is `linear_amx`'s, bit for bit). Returns new
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
    n, lib, threads = len(matrices), library(), torch.get_num_threads()
    # each matrix's own: a panel's width does not grow with d_out (one panel of 576 features, two
    # of 512 for 1,000), and the C call sizes the threads' room for the widest panel
    needs = getattr(lib, LINEAR_AMX_SCRATCH[0])
    scratch = _kept_scratch(max(needs(rows, d_in, w.shape[0], threads) for w, _ in matrices))

    def addresses(tensors):  # a C array of their addresses, NULL for None
        return (ctypes.c_void_p * n)(*(t.data_ptr() if t is not None else None for t in tensors))

    getattr(lib, LINEAR_AMX[0])(
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
    tiles, each block's product taken while its gate and up are in the core's cache (decode.c,
    attnlab_linear_amx_swiglu): linear_amx_many's gate and silu_mul_up_rows's post, bit for bit.
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
    lib, threads = library(), torch.get_num_threads()
    scratch = _kept_scratch(getattr(lib, LINEAR_AMX_SWIGLU_SCRATCH[0])(rows, d_in, d_out, threads))
    getattr(lib, LINEAR_AMX_SWIGLU[0])(
        x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), gate.data_ptr(), post.data_ptr(),
        scratch.data_ptr(), rows, d_in, d_out, int(fresh(gate.numel() * 4)), threads,
    )  # fmt: skip
    return gate, post


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a whole prompt from position 0: softmax(q Kᵀ · scale, each query seeing
    the keys up to its own position) V, for q [batch, head, T, d_head] and k, v [batch, kv_head, T,
    d_head] (grouped-query), float32, d_head a multiple of 32 (decode.c, attnlab_attend_rows).
    Returns [batch, head, T, d_head], a view of a [batch, T, head, d_head] tensor. Callers check
    `usable`."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape == (B, Hkv, T, D) and H % Hkv == 0 and D % 32 == 0
    assert q.dtype == k.dtype == v.dtype == torch.float32
    # [batch, pos, head, d_head], as the projections made them (no copy then)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    threads = torch.get_num_threads()
    lib = library()
    scratch = torch.empty(getattr(lib, ATTEND_ROWS_SCRATCH[0])(B, T, Hkv, D, threads) // 4)
    out = torch.empty(B, T, H, D)
    getattr(lib, ATTEND_ROWS[0])(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        B,
        T,
        H,
        Hkv,
        D,
        scale,
        threads,
    )
    return out.transpose(1, 2)


def attend_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, amx: bool = False
) -> torch.Tensor:
    """The masked scores of a whole prompt's causal attention from position 0: q Kᵀ · scale where
    the query sees the key (key position ≤ query position), −∞ elsewhere (apply_mask's values), for
    q [batch, head, T, d_head], k [batch, kv_head, T, d_head] (grouped-query), float32 (decode.c,
    attnlab_attend_scores; `amx`: attnlab_attend_scores_amx, on AMX tiles at float32's accuracy,
    where `amx_unusable` has no objection). Returns a new [batch, head, T, T]. Callers check
    `usable`."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == (B, Hkv, T, D) and H % Hkv == 0
    assert q.dtype == k.dtype == torch.float32
    q, k = (t.transpose(1, 2).contiguous() for t in (q, k))  # [batch, pos, head, d_head]
    lib = library()
    scores = new_tensor(B, H, T, T)
    if amx:
        _no_amx_raises()
        threads = torch.get_num_threads()
        scratch = _kept_scratch(getattr(lib, ATTEND_AMX_SCRATCH[0])(T, T, D, threads))
        getattr(lib, ATTEND_AMX[0][0])(
            q.data_ptr(), k.data_ptr(), scores.data_ptr(), scratch.data_ptr(),
            B, T, H, Hkv, D, scale, threads,
        )  # fmt: skip
        return scores
    scratch = torch.empty(getattr(lib, ATTEND_ROWS_SCRATCH[0])(B, T, Hkv, D, 1) // 4)
    getattr(lib, ATTEND_STEPS[0][0])(
        q.data_ptr(),
        k.data_ptr(),
        scores.data_ptr(),
        scratch.data_ptr(),
        B,
        T,
        H,
        Hkv,
        D,
        scale,
        torch.get_num_threads(),
    )
    return scores


def softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """attention_pattern's softmax over the last dimension of float32 scores (−∞: weight 0; a row
    of −∞ only: zeros), in C (decode.c, attnlab_softmax_rows). Returns a new tensor of the same
    shape. Callers check `usable`."""
    assert scores.dtype == torch.float32
    scores = scores.contiguous()
    pattern = new_tensor(*scores.shape)
    n = scores.shape[-1]
    getattr(library(), ATTEND_STEPS[1][0])(
        scores.data_ptr(), pattern.data_ptr(), scores.numel() // n, n, torch.get_num_threads()
    )
    return pattern


def attend_explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attend_scores, softmax_rows and attend_mix (amx=True) in one call, for hooks between them
    that only read (decode.c, attnlab_attend_explicit_amx: a head's scores and pattern read back
    from the core's cache, the pattern's zeros above the diagonal not multiplied): their three
    results, bit for bit, for q [batch, head, T, d_head], k, v [batch, kv_head, T, d_head]; where
    `amx_unusable` has no objection. Returns (scores, pattern, z [batch, head, T, d_head])."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape == (B, Hkv, T, D) and H % Hkv == 0
    assert q.dtype == k.dtype == v.dtype == torch.float32
    _no_amx_raises()
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [batch, pos, head, d_head]
    lib, threads = library(), torch.get_num_threads()
    scores, pattern, out = new_tensor(B, H, T, T), new_tensor(B, H, T, T), new_tensor(B, T, H, D)
    scratch = _kept_scratch(getattr(lib, ATTEND_AMX_SCRATCH[0])(T, T, D, threads))
    getattr(lib, ATTEND_AMX[2][0])(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), scores.data_ptr(), pattern.data_ptr(),
        out.data_ptr(), scratch.data_ptr(), B, T, H, Hkv, D, scale, threads,
    )  # fmt: skip
    return scores, pattern, out.transpose(1, 2)


def attend_mix(pattern: torch.Tensor, v: torch.Tensor, amx: bool = False) -> torch.Tensor:
    """z = pattern V for pattern [batch, head, T, S] and v [batch, kv_head, S, d_head]
    (grouped-query), float32, d_head a multiple of 32 (decode.c, attnlab_attend_mix; `amx`: any
    d_head, attnlab_attend_mix_amx on AMX tiles at float32's accuracy, where `amx_unusable` has no
    objection). Returns [batch, head, T, d_head], a view of a [batch, T, head, d_head] tensor.
    Callers check `usable`."""
    B, H, T, S = pattern.shape
    Hkv, D = v.shape[1], v.shape[-1]
    assert v.shape == (B, Hkv, S, D) and H % Hkv == 0 and (amx or D % 32 == 0)
    assert pattern.dtype == v.dtype == torch.float32
    pattern, v = pattern.contiguous(), v.transpose(1, 2).contiguous()  # v: [batch, pos, head, D]
    out = new_tensor(B, T, H, D)
    if amx:
        _no_amx_raises()
        lib, threads = library(), torch.get_num_threads()
        scratch = _kept_scratch(getattr(lib, ATTEND_AMX_SCRATCH[0])(T, S, D, threads))
        getattr(lib, ATTEND_AMX[1][0])(
            pattern.data_ptr(), v.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            B, T, S, H, Hkv, D, threads,
        )  # fmt: skip
        return out.transpose(1, 2)
    getattr(library(), ATTEND_STEPS[2][0])(
        pattern.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        B,
        T,
        S,
        H,
        Hkv,
        D,
        torch.get_num_threads(),
    )
    return out.transpose(1, 2)


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


def attend_call(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None,
    scores: torch.Tensor,
    out: torch.Tensor,
) -> Callable[[], None]:
    """Write k_new, v_new (rows, n_kv_heads, d_head) at cache slot `slot` (a one-element int64
    tensor, read at each call) of k_cache, v_cache (rows, n_kv_heads, max_len, d_head), then out
    (rows, heads, d_head) = softmax(q Kᵀ · scale) V over slots [0, slot] that key_mask (rows,
    max_len) bool allows (None: all). `scores` is scratch of rows · heads · max_len floats; the call
    leaves there each head's unnormalised weights, exp(score − max) at the slots it attended to and
    0 at masked ones (KernelDecoder.weights reads them)."""
    rows, heads, d_head = q.shape
    n_kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    # the C code trusts these layouts: check them once here, where the call is prepared
    assert all(
        t.is_contiguous() and t.dtype == torch.float32
        for t in (q, k_new, v_new, k_cache, v_cache, scores, out)
    )
    assert (
        k_new.shape == v_new.shape == (rows, n_kv_heads, d_head) and v_cache.shape == k_cache.shape
    )
    assert (
        k_cache.shape == (rows, n_kv_heads, max_len, d_head)
        and heads % n_kv_heads == 0
        and out.shape == q.shape
    )
    assert scores.numel() >= rows * heads * max_len and slot.dtype == torch.int64
    assert key_mask is None or (
        key_mask.dtype == torch.bool
        and key_mask.stride(-1) == 1
        and key_mask.shape == (rows, max_len)
    )
    stride = key_mask.stride(0) if key_mask is not None else 0
    return Call(
        Op.ATTEND,
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        key_mask,
        stride,
        scores,
        out,
        rows,
        heads,
        n_kv_heads,
        d_head,
        max_len,
        slot,
        scale,
        torch.get_num_threads(),
    )


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


def place_in_huge_pages(tensors: list[torch.Tensor]) -> bool:
    """Move the data of `tensors` into one anonymous mapping advised MADV_HUGEPAGE, one after the
    other in the given
    order (each 64-byte aligned), so that they are read from 2 MB pages and a read running past one
    runs into the next. Each tensor keeps its identity (its `.data` is replaced; values, shape,
    dtype, requires_grad unchanged), so modules, tied weights and optimizers still hold them. True
    when they are there (moved now or before); False, changing nothing, off Linux, for tensors not
    on the CPU, or below HUGE_PAGES_FROM bytes in all."""
    tensors = list({id(t): t for t in tensors}.values())  # a tied weight once
    if all(getattr(t, "_attnlab_huge_pages", None) == t.data_ptr() for t in tensors):
        return True
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    if (
        not hasattr(mmap, "MADV_HUGEPAGE")
        or sum(sizes) < HUGE_PAGES_FROM
        or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
    ):
        return False
    try:
        arena = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return False
    # the first 2 MB boundary
    offset = -torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    with torch.no_grad():
        for t, size in zip(tensors, sizes):
            # a storage of its own per tensor (not views of one): safetensors refuses tensors that
            # share one
            placed = torch.frombuffer(arena, dtype=t.dtype, count=t.numel(), offset=offset).view(
                t.shape
            )
            placed.copy_(t)
            t.data = placed
            t._attnlab_huge_pages = t.data_ptr()
            offset += size
    return True


def read_bandwidth(megabytes: int = 1024, repeats: int = 7, threads: int | None = None) -> float:
    """The machine's streaming read bandwidth, bytes per second: the best of `repeats` read-only
    passes of each kind (decode.c, attnlab_read_pass: each thread its own part, the widest vector
    loads; a plain sequential read, and one that also prefetches as the decode products do,
    alternating) over `megabytes` of memory in 2 MB pages, as the decode step's weights are
    (place_in_huge_pages), on `threads` threads (default: torch's). The bound of a decode step,
    which streams every weight once: tokens/s <= this / bytes of weights."""
    lib = library()
    if lib is None:
        raise UserError(
            "the read bandwidth is measured by attnlab's C kernels, which are not built here "
            "(no C compiler, or ATTNLAB_KERNELS=0)"
        )
    threads = threads or torch.get_num_threads()
    nbytes = megabytes * 2**20
    buffer = torch.full((nbytes,), 1, dtype=torch.uint8)
    place_in_huge_pages([buffer])
    assert buffer.data_ptr() % 64 == 0 and nbytes % 1024 == 0
    read = getattr(lib, READ_PASS[0])
    best = float("inf")
    for _ in range(repeats):
        for ahead in (0, getattr(lib, PREFETCH_AHEAD[0])()):
            start = time.perf_counter()
            total = read(buffer.data_ptr(), nbytes, threads, ahead)
            best = min(best, time.perf_counter() - start)
            # every byte 1: each 64-bit word 0x0101...01, their sum modulo 2^64 (all were read)
            assert total == nbytes // 8 * 0x0101010101010101 % 2**64, total
    return nbytes / best
