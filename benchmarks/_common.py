"""Shared pieces of the benchmarks: timing by median of repeats, the machine line, copy bandwidth.

Design choices:
- Every number is the median of a few repeats, and each benchmark runs its baseline in the same
  process, so the ratios survive a loaded, shared machine better than the absolute times do.
- The machine line names the CPU, its cores and vector extensions, the torch version and the load
  average at the start (and the GPU, when the benchmark runs on one), so a table says under what
  conditions it was measured.
- `--device cuda`: CUDA queues work and returns at once, so every timed run ends with a synchronize,
  and the copy bandwidth is measured on the device's own memory.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from attnlab.machine import LIMITS

# headless chromium as the explorer benchmarks start it (Debian's chromium, no network of its own)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait until the device has finished the work queued on it (a no-op on the CPU, which runs it
    in line)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object],
    repeats: int = 3,
    warmup: int = 1,
    clock: str = "wall",
    device: torch.device | str = "cpu",
) -> float:
    """Median seconds of `fn()` over `repeats` runs, after `warmup` untimed runs; on a GPU each run
    is timed until its queued work has finished.

    clock "wall" is wall-clock time; "cpu" is this process's CPU time, which on a machine crowded by
    other processes is, with one thread, close to the wall time the same run takes on an idle
    core."""
    tick = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = tick()
        fn()
        synchronize(device)
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


def machine_line(device: torch.device | str = "cpu") -> str:
    """CPU, cores, SIMD level, torch version and threads, load average, and the GPU when `device` is
    one:
    the conditions of a measurement."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    line = (
        f"{cpu_name()}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), load average {load}"
    )
    limits = {name: os.environ[name] for name in (*LIMITS, "ATTNLAB_KERNELS") if name in os.environ}
    if limits:  # torch's libraries or attnlab's kernels kept below what the CPU has
        line += "; limited by " + ", ".join(f"{k}={v}" for k, v in limits.items())
    if torch.device(device).type == "cuda":
        line += f"; GPU: {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return line


def benchmark_device(name: str) -> torch.device:
    """The --device a benchmark runs on; exits with one line when it is not there."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: the benchmarks run on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {name}: this torch ({torch.__version__}) sees no CUDA GPU; run on a "
            "machine with one, "
            "or leave --device out for the CPU"
        )
    return device


def copy_bandwidth(
    megabytes: int = 256, repeats: int = 7, clock: str = "wall", device: torch.device | str = "cpu"
) -> float:
    """Bytes per second moved by copying a float32 buffer (read + write, as STREAM counts a copy),
    large enough (default 256 MB, 8× a 32 MB L3, 5× an H100's L2) to measure main memory, not
    cache."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.zeros_like(src)
    seconds = median_time(
        lambda: dst.copy_(src), repeats=repeats, warmup=2, clock=clock, device=device
    )
    return 2 * src.numel() * src.element_size() / seconds
