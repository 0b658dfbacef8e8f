"""Which numeric path a forward pass's float32 work of many rows takes: AMX's tiles, the kernels'
float32 tiles, or torch's GEMM (`float_products`, `float_rows`).

Design choices:
- The choice comes from what this machine reports and measures, never from the instruction sets
  alone: AMX where this process may run it (builds.amx_unusable), else the float32 tiles where
  this build vectorises them (AVX-512) and they multiply faster than torch's GEMM here, else
  torch. Which is faster is a measurement, not a rule: MKL takes its AVX-512 path on Intel CPUs
  and not on AMD's, and torch's GEMM may be built on another BLAS.
- The race (`tiles_against_torch`) is run once per machine, build and thread count and cached by
  attnlab.machine.measured; `attnlab doctor` prints its verdict.
- ATTNLAB_FLOAT_ROWS=amx, c or torch chooses instead; a name it does not take, or amx where AMX
  cannot run, is one line naming why.
"""

from __future__ import annotations

import os
import time

import torch

from ... import machine
from ...errors import UserError
from .builds import amx_unusable, chosen_variant, variant
from .products import linear_rows, rows_vectorized

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
