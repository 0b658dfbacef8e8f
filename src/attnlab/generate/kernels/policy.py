"""Which numeric path a forward pass's float32 work of many rows takes: AMX's tiles, the kernels'
float32 tiles, or torch's GEMM (`float_products`, `float_rows`), a prompt's attention: the
kernels' C steps or torch's (`attention_rows`), and the layout a decode step streams a block
matrix in: the 16-row layout or the file's (`repack16_chosen`).

Design choices:
- The choice comes from what this machine reports and measures, never from the instruction sets
  alone: AMX where this process may run it (builds.amx_unusable), else the float32 tiles where
  this build vectorises them (AVX-512, or AVX2 with FMA) and they multiply faster than torch's
  GEMM here, else
  torch. Which is faster is a measurement, not a rule: MKL takes its AVX-512 path on Intel CPUs
  and not on AMD's, and torch's GEMM may be built on another BLAS.
- A prompt's attention (its scores, pattern and z in C: attnlab_attend_explicit, or its three
  steps) has a race of its own against torch's steps (`attention_against_torch`): it saves
  torch's T x T copies and the masked half of a causal pattern, so it may win where the products
  lose (MKL's AVX2 GEMM against AVX2's tiles).
- A decode step's block products stream a matrix in the 16-row layout (kernels.repack16) only
  where this build's 16-row product of that kind is vectorised (repack16_vectorised; the
  portable build's is a lane at a time, for tests) and ran faster than the product on the file's
  layout here (`repack16_against_file`, per block kind): which layout streams faster depends on
  the instructions per block (VNNI's dpbusd or AVX2's maddubs + madd), the caches and the
  prefetchers, not on the build alone.
- The races (`tiles_against_torch`, `attention_against_torch`, `repack16_against_file`) are run
  once per machine, build and thread count and cached by attnlab.machine.measured; `attnlab
  doctor` prints their verdicts.
- ATTNLAB_FLOAT_ROWS=amx, c or torch chooses instead (c or torch: the attention's too);
  ATTNLAB_DECODE_LAYOUT=16-row or file the decode layout (16-row: where it is vectorised); a
  name they do not take, or amx where AMX cannot run, is one line naming why.
"""

from __future__ import annotations

import os
import time

import torch

from ... import machine
from ...errors import UserError
from ...model.attention import causal_mask, expand_kv
from .attention import attend_explicit
from .builds import amx_unusable, chosen_variant, variant
from .products import (
    REPACKABLE,
    _block_type,
    block_linear_call,
    linear_rows,
    repack16,
    repack16_vectorised,
    rows_vectorized,
)
from .programs import BlockKind

FLOAT_ROWS = ("amx", "c", "torch")  # ATTNLAB_FLOAT_ROWS: force the choice of float_products
DECODE_LAYOUTS = ("16-row", "file")  # ATTNLAB_DECODE_LAYOUT: force the choice of repack16_chosen
# the matrix the decode layouts race on (d_out, d_in): a 1B model's q projection (Llama 3.2 1B),
# past the level-2 cache in every kind, so that the race streams as a step does
RACE_SHAPE = (2048, 2048)


def best_of_alternating(runs: dict, rounds: int) -> dict:
    """Each of `runs` (name -> callable) timed `rounds` times, taking turns so that a machine's
    slow moments fall on every side; the best time of each in seconds, its first (warm-up) left
    out."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: min(seconds[1:]) for name, seconds in times.items()}


def _forced_float_rows() -> str | None:
    forced = os.environ.get("ATTNLAB_FLOAT_ROWS")
    if forced and forced not in FLOAT_ROWS:
        raise UserError(
            f"ATTNLAB_FLOAT_ROWS={forced}: it takes {', '.join(FLOAT_ROWS[:-1])} or "
            f"{FLOAT_ROWS[-1]} (or unset: AMX where allowed, else measured)"
        )
    return forced or None


def float_rows() -> bool:
    """Whether a prompt's float32 products of many rows where `float_products` says "c" (forward
    passes without gradients, attnlab.generate.fast_layers), and those of dequantized blocks,
    take the C kernels: where this build's float32 tiles are vectorised (AVX-512, AVX2) and
    multiply faster than torch's GEMM on this machine, measured once per machine, build and thread
    count (`_tiles_beat_torch`). Which is faster is not a matter of the instruction sets alone:
    MKL takes its AVX-512 path on Intel CPUs and not on AMD's, and torch's GEMM may be built on
    another BLAS (benchmarks/README.md, issue 25). ATTNLAB_FLOAT_ROWS=c or torch chooses instead
    (amx: the measured choice, for the attention); a name it does not take is one line in every
    build."""
    forced = _forced_float_rows()
    if not rows_vectorized()[1]:
        return False
    if forced in ("c", "torch"):
        return forced == "c"
    return _tiles_beat_torch(variant(), torch.get_num_threads())


def attention_rows() -> bool:
    """Whether a prompt's causal attention from position 0 (scores, pattern and z, or the three
    fused: attnlab.generate.fast_layers.KernelAttention) takes the C kernels' float32 tiles: where
    this build vectorises them and its attention ran faster than torch's steps on this machine,
    measured once per machine, build and thread count (`attention_against_torch`).
    ATTNLAB_FLOAT_ROWS=c or torch chooses instead (amx: the measured choice; AMX's own attention
    is `float_products`'s); a name it does not take is one line in every build."""
    forced = _forced_float_rows()
    if not rows_vectorized()[1]:
        return False
    if forced in ("c", "torch"):
        return forced == "c"
    return _attention_beats_torch(variant(), torch.get_num_threads())


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
        best = best_of_alternating(
            {
                "c": lambda: linear_rows(x, w, None),
                "torch": lambda: torch.nn.functional.linear(x, w),
            },
            rounds=6,
        )
        flops = 2 * 256 * 576 * 576
        return {
            "tiles_gflops": flops / best["c"] / 1e9,
            "torch_gflops": flops / best["torch"] / 1e9,
            "tiles_won": best["c"] < best["torch"],
        }

    extra = {"build": build, "library": library_file, "threads": threads, "version": 1}
    return machine.measured("float32-tiles-against-torch", measure, extra)


def _attention_beats_torch(build: str | None, threads: int) -> bool:
    """Whether the C kernels' attention of `build` ran faster than torch's steps on `threads`
    threads: `attention_against_torch`'s answer, kept as `_tiles_beat_torch`'s is."""
    return attention_against_torch(build, threads).values["attention_won"]


def attention_against_torch(build: str | None, threads: int) -> machine.Measured:
    """A prompt's causal attention with its pattern (the hooked path: scores, pattern, z) in the C
    kernels (attend_explicit, run_with_cache's one call; hooks that may edit take its three
    steps) against torch's (as KernelAttention takes
    them where they are the faster: Attention's numbers, fewer copies) on SmolLM2's heads (9
    queries, 3 keys and values, d_head 64) over 256 positions, each the best of 5 after one
    warm-up, taking turns: values attention_ms, torch_ms and attention_won, measured once per
    machine, build and thread count."""
    chosen = chosen_variant()
    library_file = chosen[1].name if chosen is not None and chosen[0] == build else None

    def measure() -> dict[str, float | bool]:
        generator = torch.Generator().manual_seed(0)  # the caller's random state left alone
        # [batch, head, pos, d_head], as Attention hands them on
        q = torch.randn(1, 256, 9, 64, generator=generator).transpose(1, 2)
        k, v = (torch.randn(1, 256, 3, 64, generator=generator).transpose(1, 2) for _ in "kv")

        def with_torch() -> torch.Tensor:
            # the steps KernelAttention takes where torch's are the faster: the scores scaled and
            # masked in place, the softmax without the all-masked guard (no row needs it here)
            scores = torch.matmul(q, expand_kv(q, k).transpose(-2, -1)).mul_(0.125)
            scores.masked_fill_(~causal_mask(256, 256), float("-inf"))
            return torch.matmul(torch.softmax(scores, dim=-1), expand_kv(q, v))

        runs = {
            "c": lambda: attend_explicit(q, k, v, 0.125),
            "torch": with_torch,
        }
        best = best_of_alternating(runs, rounds=6)
        return {
            "attention_ms": best["c"] * 1e3,
            "torch_ms": best["torch"] * 1e3,
            "attention_won": best["c"] < best["torch"],
        }

    extra = {"build": build, "library": library_file, "threads": threads, "version": 1}
    return machine.measured("attention-against-torch", measure, extra)


def _forced_decode_layout() -> str | None:
    forced = os.environ.get("ATTNLAB_DECODE_LAYOUT")
    if forced and forced not in DECODE_LAYOUTS:
        raise UserError(
            f"ATTNLAB_DECODE_LAYOUT={forced}: it takes {' or '.join(DECODE_LAYOUTS)} (or unset: "
            "measured per block kind)"
        )
    return forced or None


def repack16_chosen(kind: BlockKind) -> bool:
    """Whether a decode step streams a block matrix of `kind` in the 16-row layout
    (kernels.repack16) rather than the file's: where the kind has that layout (REPACKABLE), this
    build's 16-row product of it is vectorised (`repack16_vectorised`) and it ran faster than the
    product on the file's layout on this machine, measured once per machine, build, thread count
    and kind (`repack16_against_file`). ATTNLAB_DECODE_LAYOUT=16-row or file chooses instead
    (16-row: where vectorised); a name it does not take is one line in every build."""
    forced = _forced_decode_layout()
    if kind not in REPACKABLE or not repack16_vectorised(kind):
        return False
    if forced is not None:
        return forced == "16-row"
    return repack16_against_file(kind, variant(), torch.get_num_threads()).values["repacked_won"]


def _race_blocks(kind: BlockKind, generator: torch.Generator) -> torch.Tensor:
    """RACE_SHAPE's blocks of `kind`: random quants and scales, every block's float16 d (and Q4_1's
    m, Q4_K's dmin) set to 2^-6, a normal number (random halves would hold NaNs and subnormals,
    which some floating-point units take slowly)."""
    d_out, d_in = RACE_SHAPE
    t = _block_type(kind)
    shape = (d_out * d_in // t.weights, t.nbytes)  # one block a row
    blocks = torch.randint(0, 256, shape, generator=generator).to(torch.uint8)
    halves = 2 if kind in (BlockKind.Q4_1, BlockKind.Q4_K) else 1
    blocks[:, : 2 * halves] = torch.tensor([0x00, 0x24] * halves, dtype=torch.uint8)
    return blocks.reshape(d_out, -1).contiguous()


def repack16_against_file(kind: BlockKind, build: str | None, threads: int) -> machine.Measured:
    """The decode product of one row with a RACE_SHAPE matrix of `kind` in the 16-row layout
    against the same blocks in the file's layout, on this process's threads, each the best of 10
    after one warm-up (a product takes a fraction of a millisecond: more turns, fewer verdicts
    decided by another process's slice of the cores), taking turns: values repacked_us, file_us
    and repacked_won, measured once per machine, build, thread count and kind."""
    chosen = chosen_variant()
    library_file = chosen[1].name if chosen is not None and chosen[0] == build else None

    def measure() -> dict[str, float | bool]:
        generator = torch.Generator().manual_seed(0)  # the caller's random state left alone
        d_out, d_in = RACE_SHAPE
        blocks = _race_blocks(kind, generator)
        x = torch.randn(1, d_in, generator=generator)
        out = torch.empty(1, d_out)
        runs = {
            "16-row": block_linear_call(
                x, repack16(blocks, kind, d_in), kind, None, out, repacked=True
            ),
            "file": block_linear_call(x, blocks, kind, None, out),
        }
        best = best_of_alternating(runs, rounds=11)
        return {
            "repacked_us": best["16-row"] * 1e6,
            "file_us": best["file"] * 1e6,
            "repacked_won": best["16-row"] < best["file"],
        }

    extra = {
        "build": build,
        "library": library_file,
        "threads": threads,
        "kind": BlockKind(kind).name,
        "shape": "x".join(map(str, RACE_SHAPE)),
        "version": 1,
    }
    return machine.measured("repack16-against-file", measure, extra)
