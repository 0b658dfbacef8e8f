"""Attention speed and memory against sequence length: explicit, fused and chunked paths, torch's
SDPA as baseline.

    .venv/bin/python benchmarks/attention_speed.py                    # T = 256 … 16384, writes the
    PNGs
    .venv/bin/python benchmarks/attention_speed.py --max-t 2048       # a quick look
    .venv/bin/python benchmarks/attention_speed.py --min-t 16384 --paths fused chunked --out
    /tmp/t16k   # one T
    python benchmarks/attention_speed.py --device cuda --dtype bfloat16 --out /tmp/gpu   # on a GPU:
    flash kernels
    .venv/bin/python benchmarks/attention_speed.py --window 256 --out /tmp/window   # attnlab's
    paths with a sliding window

Design choices:
- One head shape for all: batch 1, 8 heads, d_head 64, float32, causal self-attention (T = S),
  dropout 0 (on the CPU torch's SDPA uses its flash kernel only without dropout).
- Paths: explicit = scaled_dot_product_attention(return_weights=True) (the chapter's equation, T × S
  scores and pattern); fused = attnlab's scaled_dot_product_attention (torch's kernel behind
  attnlab's mask handling); chunked = attnlab's chunked_attention (online softmax over 256-key
  blocks); baseline = torch.nn.functional.scaled_dot_product_attention(is_causal=True) called
  directly.
- Time: for each T the paths take turns in one process, --repeats rounds, median per path, so the
  ratios to the baseline compare runs made under the same load.
- Peak memory: one fresh subprocess per (path, T, pass): after creating the inputs and one tiny
  warm-up run, it resets the kernel's peak-RSS counter (/proc/self/clear_refs) and reports the peak
  resident memory of one run above what it held before (the CPU allocator keeps no statistics of its
  own). Inputs are not counted; gradients of q, k, v are.
- `--device cuda`: times end with a synchronize, and peak memory is CUDA's allocator peak above what
  was allocated before the run (in this process: the allocator keeps statistics). torch's flash
  kernel on a GPU takes only half precision, so `--dtype bfloat16` (or float16) is the GPU run that
  compares against it.
- `--window W`: attnlab's three paths attend with a sliding window of W keys (Mistral), the baseline
  stays plain causal SDPA, so the ratios say what the window costs or saves against full causal
  attention.
- The explicit path's memory grows as T²: it runs only where its peak, extrapolated from the largest
  T
  measured (×4 per doubling), fits under --max-gib and the memory available now; the table says
  where it stops and what the next T would have needed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    CLOCKS,
    add_results_argument,
    benchmark_device,
    figure,
    machine_description,
    machine_line,
    synchronize,
    write_result,
)

from attnlab.model.attention import chunked_attention, scaled_dot_product_attention  # noqa: E402

HERE = Path(__file__).resolve().parent
B, H, D = 1, 8, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATHS = ("sdpa", "fused", "chunked", "explicit")
PASSES = ("forward", "forward+backward")


def attend(path: str, q, k, v, window: int | None = None):
    if path == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if path == "fused":
        return scaled_dot_product_attention(q, k, v, causal=True, window=window)
    if path == "chunked":
        return chunked_attention(q, k, v, causal=True, window=window)
    return scaled_dot_product_attention(q, k, v, causal=True, return_weights=True, window=window)[0]


def inputs(
    T: int, grad: bool, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
):
    g = torch.Generator().manual_seed(T)
    return [
        torch.randn(B, H, T, D, generator=g).to(device, dtype).requires_grad_(grad)
        for _ in range(3)
    ]


def run_once(path: str, pass_: str, q, k, v, window: int | None = None) -> None:
    if pass_ == "forward":
        with torch.no_grad():
            attend(path, q, k, v, window)
    else:
        attend(path, q, k, v, window).sum().backward()


def rss_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process, in
    bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_cuda_memory(
    path: str,
    pass_: str,
    T: int,
    device: torch.device,
    dtype: torch.dtype,
    window: int | None = None,
) -> float | None:
    """Bytes of CUDA memory at the allocator's peak during one run, above what was allocated before
    it."""
    q, k, v = inputs(T, pass_ != "forward", device, dtype)
    run_once(path, pass_, *inputs(64, pass_ != "forward", device, dtype), window)
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        run_once(path, pass_, q, k, v, window)
        synchronize(device)
    except torch.OutOfMemoryError:
        print(f"  {path} {pass_} T={T}: out of GPU memory", flush=True)
        return None
    return torch.cuda.max_memory_allocated(device) - before


def measure_memory(
    path: str, pass_: str, T: int, dtype: torch.dtype, window: int | None = None
) -> float:
    """(In a subprocess) bytes of peak resident memory above the inputs, for one run."""
    q, k, v = inputs(T, pass_ != "forward", dtype=dtype)
    # thread pools and kernels: not the run's memory
    run_once(path, pass_, *inputs(64, pass_ != "forward", dtype=dtype), window)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    before = rss_bytes("VmRSS")
    run_once(path, pass_, q, k, v, window)
    return rss_bytes("VmHWM") - before


def memory_in_subprocess(
    path: str, pass_: str, T: int, dtype: str, window: int | None = None
) -> float | None:
    cmd = [
        sys.executable,
        __file__,
        "--memory-probe",
        path,
        pass_,
        str(T),
        "--threads",
        str(torch.get_num_threads()),
        "--dtype",
        dtype,
        *(["--window", str(window)] if window else []),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(
            f"  memory probe {path} {pass_} T={T} failed: {done.stderr.strip().splitlines()[-1:]}",
            flush=True,
        )
        return None
    return float(done.stdout.strip().splitlines()[-1])


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def time_paths(
    paths: list[str],
    pass_: str,
    T: int,
    repeats: int,
    clock: str,
    device: torch.device,
    dtype: torch.dtype,
    window: int | None = None,
) -> dict[str, float]:
    """Median seconds per path; the paths take turns within each round, in reverse order every other
    round so that none always runs right after the same other one (after one warm-up round while
    runs are short, or on a GPU, which compiles and tunes kernels on first use: long CPU runs need
    none)."""
    q, k, v = inputs(T, pass_ != "forward", device, dtype)
    tick = CLOCKS[clock]
    if T <= 4096 or device.type == "cuda":
        for path in paths:
            run_once(path, pass_, q, k, v, window)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(repeats):
        for path in paths if r % 2 == 0 else paths[::-1]:
            q.grad = k.grad = v.grad = None
            synchronize(device)
            start = tick()
            run_once(path, pass_, q, k, v, window)
            synchronize(device)
            times[path].append(tick() - start)
    return {p: statistics.median(t) for p, t in times.items()}


def plot(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, ylabel, name in (
        ("time", "seconds", "attention_time.png"),
        ("memory", "peak memory above inputs (MiB)", "attention_memory.png"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, pass_ in zip(axes, PASSES):
            for path in PATHS:
                pts = [(r["T"], r[key][pass_].get(path)) for r in results["rows"]]
                pts = [(t, y / 2**20 if key == "memory" else y) for t, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=path)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T (= S)")
            ax.set_ylabel(ylabel)
            window = f", window {results['window']}" if results.get("window") else ""
            ax.set_title(
                f"{pass_}, B={B}, {H} heads, d_head {D}, {results.get('dtype', 'float32')}, "
                f"causal{window}"
            )
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(results["machine"], fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written


def figures_of(results: dict) -> list[dict]:
    """The record's figures: each path's time and peak memory at the longest T it ran, beside
    SDPA's at that T (every T is in the record's details)."""
    figures = []
    for pass_ in PASSES:
        for path in PATHS[1:]:
            rows = [r for r in results["rows"] if path in r["time"].get(pass_, {})]
            if not rows:
                continue
            row = rows[-1]
            time, memory = row["time"][pass_], row["memory"][pass_]
            name = f"{path}, {pass_}, T={row['T']}"
            figures.append(
                figure(f"{name}, time", "ms", 1e3 * time[path], 1e3 * time["sdpa"], "lower")
            )
            if memory.get(path) is not None and memory.get("sdpa") is not None:
                figures.append(
                    figure(
                        f"{name}, peak memory",
                        "MiB",
                        memory[path] / 2**20,
                        memory["sdpa"] / 2**20,
                        "lower",
                    )
                )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-t", type=int, default=256, help="first T (doubling from there)")
    parser.add_argument("--max-t", type=int, default=16384)
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=list(PATHS),
        help="paths to run (sdpa, the baseline, always runs); leave out explicit when starting at "
        "a large --min-t",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-gib", type=float, default=20.0, help="largest predicted peak for the explicit path"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="cpu: this process's CPU time (use with --threads 1 on a crowded machine)",
    )
    parser.add_argument(
        "--long-repeats",
        type=int,
        default=1,
        help="--repeats for T >= 8192, where one run takes seconds",
    )
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="of q, k, v; on a GPU torch's flash kernel needs bfloat16 or float16",
    )
    parser.add_argument(
        "--window", type=int, default=None, help="sliding window of attnlab's paths (default: none)"
    )
    parser.add_argument(
        "--memory-probe", nargs=3, metavar=("PATH", "PASS", "T"), help=argparse.SUPPRESS
    )
    add_results_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        path, pass_, T = args.memory_probe
        print(measure_memory(path, pass_, int(T), DTYPES[args.dtype], args.window))
        return

    device, dtype = benchmark_device(args.device), DTYPES[args.dtype]
    machine = machine_line(device)
    description = machine_description(device)  # the load average before the timed runs
    window = f", attnlab's paths with a sliding window of {args.window}" if args.window else ""
    print(
        f"# Attention speed\n{machine}, clock: {args.clock}\nB={B}, heads={H}, d_head={D}, "
        f"{args.dtype}, causal, "
        f"dropout 0{window}",
        flush=True,
    )
    results: dict = {
        "machine": f"{machine}, clock: {args.clock}",
        "device": device.type,
        "dtype": args.dtype,
        "window": args.window,
        "rows": [],
        "explicit_stops": {},
    }
    explicit_peak: dict[str, tuple[int, float]] = {}
    T = args.min_t
    while T <= args.max_t:
        row = {"T": T, "time": {}, "memory": {}}
        for pass_ in PASSES:
            paths = [p for p in PATHS if p in args.paths or p == "sdpa"]
            # extrapolate the explicit path's T² memory before running it
            if pass_ in explicit_peak:
                last_T, peak = explicit_peak[pass_]
                predicted = peak * (T / last_T) ** 2
                budget = min(args.max_gib * 2**30, 0.8 * available_bytes(device))
                if predicted > budget:
                    paths.remove("explicit")
                    results["explicit_stops"].setdefault(
                        pass_,
                        {"T": T, "predicted_gib": predicted / 2**30, "budget_gib": budget / 2**30},
                    )
            if device.type == "cuda":
                memory = {
                    p: measure_cuda_memory(p, pass_, T, device, dtype, args.window) for p in paths
                }
            else:
                memory = {
                    p: memory_in_subprocess(p, pass_, T, args.dtype, args.window) for p in paths
                }
            if memory.get("explicit") is not None:
                explicit_peak[pass_] = (T, memory["explicit"])
            repeats = args.repeats if T < 8192 or device.type == "cuda" else args.long_repeats
            times = time_paths(paths, pass_, T, repeats, args.clock, device, dtype, args.window)
            row["time"][pass_], row["memory"][pass_] = times, memory
            base = times["sdpa"]
            cells = "  ".join(
                f"{p} {times[p] * 1e3:8.1f} ms ×{times[p] / base:5.2f} "
                f"{memory[p] / 2**20 if memory[p] else float('nan'):8.0f} MiB"
                for p in paths
            )
            print(f"T={T:6d} {pass_:17s} {cells}", flush=True)
        results["rows"].append(row)
        T *= 2
    results["end_machine"] = machine_line(device)
    args.out.mkdir(parents=True, exist_ok=True)
    window = f", window {args.window}" if args.window else ""
    write_result(
        args.results,
        "attention_speed",
        measures=f"Causal attention (B={B}, {H} heads, d_head {D}), time and peak memory of "
        "attnlab's fused, chunked and explicit paths against torch's "
        "scaled_dot_product_attention called directly, taking turns in one process.",
        anchor="torch's SDPA",
        anchor_version=torch.__version__,
        figures=figures_of(results),
        setup=f"{device.type}, {args.dtype}{window}, clock {args.clock}",
        machine=description,
        details=results,
    )
    for pass_, stop in results["explicit_stops"].items():
        print(
            f"explicit path, {pass_}: stops before T={stop['T']} (predicted "
            f"{stop['predicted_gib']:.1f} GiB > "
            f"budget {stop['budget_gib']:.1f} GiB)"
        )
    print("wrote", ", ".join(str(p) for p in plot(results, args.out)))
    print(f"end: {results['end_machine']}")


if __name__ == "__main__":
    main()
