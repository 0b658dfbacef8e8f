"""Shared pieces of the benchmarks: timing by median of repeats, the machine line, copy bandwidth.

Design choices:
- Every number is the median of a few repeats, and each benchmark runs its baseline in the same
  process, so the ratios survive a loaded, shared machine better than the absolute times do.
- The machine line names the CPU, its cores and vector extensions, the torch version and the load
  average at the start, so a table says under what conditions it was measured.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1, clock: str = "wall") -> float:
    """Median seconds of `fn()` over `repeats` runs, after `warmup` untimed runs.

    clock "wall" is wall-clock time; "cpu" is this process's CPU time, which on a machine crowded by
    other processes is, with one thread, close to the wall time the same run takes on an idle core."""
    tick = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = tick()
        fn()
        times.append(tick() - start)
    return statistics.median(times)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """CPU, cores, SIMD level, torch version and threads, load average: the conditions of a measurement."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu_name()}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), load average {load}")


def copy_bandwidth(megabytes: int = 256, repeats: int = 7, clock: str = "wall") -> float:
    """Bytes per second moved by copying a float32 buffer (read + write, as STREAM counts a copy),
    large enough (default 256 MB, 8× a 32 MB L3) to measure main memory, not cache."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.zeros_like(src)
    seconds = median_time(lambda: dst.copy_(src), repeats=repeats, warmup=2, clock=clock)
    return 2 * src.numel() * src.element_size() / seconds
