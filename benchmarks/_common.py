"""Shared pieces of the benchmarks: timing by median of repeats, the machine line, copy bandwidth,
and the one writer of results files (`write_result`).

Design choices:
- Every number is the median of a few repeats, and each benchmark runs its baseline in the same
  process, so the ratios survive a loaded, shared machine better than the absolute times do.
- The machine line names the CPU, its cores and vector extensions, the torch version and the load
  average at the start (and the GPU, when the benchmark runs on one), so a table says under what
  conditions it was measured.
- `--device cuda`: CUDA queues work and returns at once, so every timed run ends with a synchronize,
  and the copy bandwidth is measured on the device's own memory.
- Results are data: every benchmark hands its figures to `write_result`, which writes one JSON
  record to benchmarks/results/ (or --results DIR), and benchmarks/render_results.py makes
  docs/results.md from them. A record carries the benchmark, what it measures, the machine
  (`machine_description`: CPU, the instruction sets that pick a path, cores, caches, the read
  bandwidth where the benchmark measured it, the load average, the variables that limit torch or
  attnlab's kernels), the versions (attnlab's commit, torch, the anchor's), the exact command, and
  each figure beside the anchor's figure measured in the same run, with their ratio.
- One file per benchmark, setup and machine (`<benchmark>[-<setup>]--<machine>.json`), not one per
  run: a new run on the same machine replaces the old record (git keeps the history), so the page
  shows the latest figures of each machine and the folder does not grow with every run. The record
  keeps its UTC time (`recorded`) to order the rows, newest first; the page prints no date.
- A ratio is always "how many times better attnlab is": the anchor's time over attnlab's, or
  attnlab's rate over the anchor's, so that above 1 means attnlab is ahead whatever the unit.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnlab.machine import LIMITS, describe

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the committed records that docs/results.md is rendered from
# the variables, besides LIMITS, that change what a benchmark measures: they go into its command
COMMAND_ENVIRONMENT = ("ATTNLAB_KERNELS", "OMP_NUM_THREADS")

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


def git_commit(folder: Path) -> str | None:
    """The commit checked out in `folder` ("+" where its files differ from it), None outside git."""
    run = lambda *a: subprocess.run(["git", *a], cwd=folder, capture_output=True, text=True)
    try:
        head = run("rev-parse", "HEAD")
    except OSError:  # no git on this machine
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+" if run("status", "--porcelain").stdout.strip() else "")


def cpu_caches() -> dict[str, str]:
    """{"L1d": "48K", "L1i": "64K", "L2": "2048K", "L3": "491520K"} of the first CPU, as Linux's
    sysfs gives them (empty elsewhere)."""
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = (
                (index / name).read_text().strip() for name in ("level", "type", "size")
            )
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[f"L{level}{suffix}"] = size
    return caches


def machine_description(
    device: torch.device | str = "cpu", read_bandwidth: float | None = None, **measured: float
) -> dict[str, Any]:
    """The machine of a record: attnlab.machine.describe() (CPU, instruction sets, cores, LIMITS)
    plus the caches, the load average now, attnlab's kernel build when forced, the read bandwidth
    in bytes/s where the benchmark measured it, what else it measured of the machine (`measured`:
    copy_bandwidth in bytes/s, matmul_flops), and the GPU when `device` is one."""
    machine = describe()
    limits = dict(machine.limits)
    if os.environ.get("ATTNLAB_KERNELS"):
        limits["ATTNLAB_KERNELS"] = os.environ["ATTNLAB_KERNELS"]
    description = {
        "cpu": machine.cpu,
        "architecture": machine.architecture,
        "cores": machine.cores,
        "instruction_sets": [name for name, has in machine.instruction_sets().items() if has],
        "caches": cpu_caches(),
        "threads": machine.threads,
        "limits": limits,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "read_bandwidth": read_bandwidth,
        **measured,
    }
    if torch.device(device).type == "cuda":
        description["gpu"] = torch.cuda.get_device_name(device)
    return description


def machine_name(machine: dict[str, Any]) -> str:
    """A record's machine in a few words: the CPU without its trademarks, the cores, the widest
    instruction sets, and "as AVX2 only" where LIMITS kept torch and attnlab's kernels to AVX2."""
    cpu = re.sub(r"\((?:R|TM)\)|\bCPU\b|@.*$|\s+Processor\b", "", machine["cpu"])
    cpu = " ".join(cpu.split())
    sets = machine["instruction_sets"]
    if "AVX-512 F/BW/VL/DQ" in sets:
        extras = [s.removeprefix("AVX-512 ") for s in ("AVX-512 VNNI", "AVX-512 BF16") if s in sets]
        widest = ["AVX-512" + (f" {' '.join(extras)}" if extras else "")]
        widest += ["AMX"] if "AMX" in sets else []
    else:
        widest = [s for s in ("AVX2", "NEON", "dotprod", "i8mm", "SVE") if s in sets][-1:]
    name = f"{cpu}, {machine['cores']} cores, {', '.join(widest) or machine['architecture']}"
    limits = " ".join(machine["limits"].values()).lower()
    if "avx2" in limits:
        name += ", as AVX2 only"
    if machine.get("gpu"):
        name += f", {machine['gpu']}"
    return name


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this benchmark, from the repository's root: the variables that limit
    torch, attnlab's kernels or the threads, then `python benchmarks/NAME.py` and its arguments."""
    argv = sys.argv if argv is None else argv
    env = [f"{k}={os.environ[k]}" for k in (*LIMITS, *COMMAND_ENVIRONMENT) if os.environ.get(k)]
    script = Path(argv[0])
    script = f"benchmarks/{script.name}" if script.parent.resolve() == HERE else str(script)
    return shlex.join([*env, "python", script, *argv[1:]])


def figure(
    name: str, unit: str, attnlab: float, anchor: float | None = None, better: str = "higher"
) -> dict[str, Any]:
    """One figure of a record: attnlab's value and the anchor's, in `unit`, and their ratio (module
    docstring: above 1 when attnlab is ahead). better is "higher" (a rate), "lower" (a time, a
    loss) or "" (neither: no ratio)."""
    assert better in ("higher", "lower", ""), better
    ratio = None
    if anchor is not None and better and attnlab > 0 and anchor > 0:
        ratio = attnlab / anchor if better == "higher" else anchor / attnlab
    return {
        "name": name,
        "unit": unit,
        "attnlab": attnlab,
        "anchor": anchor,
        "ratio": ratio,
        "better": better,
    }


def add_results_argument(parser) -> None:
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="the folder the results record goes to (default benchmarks/results/, which "
        "docs/results.md is rendered from)",
    )


def write_result(
    folder: Path,
    benchmark: str,
    *,
    measures: str,
    anchor: str | None,
    anchor_version: str | None,
    figures: list[dict[str, Any]],
    setup: str = "",
    machine: dict[str, Any] | None = None,
    command: str | None = None,
    details: dict[str, Any] | None = None,
) -> Path:
    """Write one results record (module docstring) and return its path.

    measures: what the benchmark measures, one sentence; anchor: what it is measured against
    ("nanoGPT", "llama.cpp's llama-bench", ...), None where it has none; setup: what this run's
    figures depend on besides the machine (a model, a format), part of the file's name; details:
    the benchmark's own numbers, kept beside the figures."""
    machine = machine or machine_description()
    record = {
        "benchmark": benchmark,
        "measures": measures,
        "setup": setup,
        "anchor": anchor,
        "machine": machine,
        "versions": {
            "attnlab": git_commit(HERE),
            "torch": torch.__version__,
            "python": platform.python_version(),
            **({"anchor": anchor_version} if anchor else {}),
        },
        "command": command or command_line(),
        "recorded": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "figures": figures,
        "details": details or {},
    }
    folder.mkdir(parents=True, exist_ok=True)
    name = "-".join(part for part in (benchmark, slug(setup)) if part)
    path = folder / f"{name}--{slug(machine_name(machine))}.json"
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"results: {path}")
    return path
