"""The CPU speedrun, side by side: nanoGPT's README CPU command against `attnlab train --preset
speedrun`.

    .venv/bin/python benchmarks/speedrun.py --nanogpt ../anchors/nanoGPT --data
    ../shared/data/tinyshakespeare.txt

Design choices:
- Each program runs as its own whole process, timed from start to exit (imports, reading the data,
  training, evaluation and checkpoints all count), one at a time, the two alternating which goes
  first from seed to seed, so a change in the machine's load falls on both. The table gives both
  wall times and their ratio, and each process's own CPU time. On a machine crowded by other work,
  `--concurrent` starts a seed's two programs at the same moment instead, so both run under the very
  same load.
- nanoGPT runs from its own folder (a clone of karpathy/nanoGPT with
  `data/shakespeare_char/prepare.py` run on the same text; none of its code is in this repository),
  with its README's CPU flags and its defaults (bias=False). nanoGPT has no seed flag: for a seed
  other than its 1337 the script starts train.py with torch.manual_seed offset by (seed - 1337),
  nothing else changed. Its checkpoint is saved at every
  evaluation (--always_save_checkpoint=True, a few ms each) so the final model is the one scored.
- Both final models are scored on the whole validation split, every token once in consecutive
  64-token
  windows: attnlab reports it itself (metrics.jsonl, val_loss_full); nanoGPT's checkpoint is scored
  by nanoGPT's own model code, in its folder, after its timed run.
- The machine line (CPU, load average, a float32 matmul GFLOP/s and a copy GB/s) is measured once,
  before the
  runs (the load average it gives is the one they started under; each seed's row has its own), and
  printed, put in the table and saved with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    add_results_argument,
    copy_bandwidth,
    figure,
    git_commit,
    machine_description,
    machine_line,
    write_result,
)
from train_speed import measure_matmul_peak  # noqa: E402

NANOGPT_FLAGS = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
    "--always_save_checkpoint=True",
]

# Runs nanoGPT's train.py with its seed moved from 1337 to SEED (argv[1]); the rest of argv is
# train.py's.
SEEDED_NANOGPT = """import sys, torch
seed = int(sys.argv.pop(1)); manual_seed = torch.manual_seed
torch.manual_seed = lambda s: manual_seed(s - 1337 + seed)
sys.argv[0] = 'train.py'; exec(compile(open('train.py').read(), 'train.py', 'exec'))"""

# nanoGPT's checkpoint, scored by nanoGPT's model on every token of val.bin once (64-token windows).
SCORE_NANOGPT = """import json, sys, numpy as np, torch
import torch.nn.functional as F
from model import GPT, GPTConfig
ckpt = torch.load(sys.argv[1] + '/ckpt.pt', map_location='cpu')
model = GPT(GPTConfig(**ckpt['model_args']))
state = {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()}
model.load_state_dict(state); model.eval()
val = np.fromfile('data/shakespeare_char/val.bin', dtype=np.uint16)
val = torch.from_numpy(val.astype(np.int64))
T = ckpt['model_args']['block_size']; n = len(val) - 1; rows = n // T
x, y = val[:rows * T].view(rows, T), val[1:rows * T + 1].view(rows, T)
batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, rows, 64)]
if n % T:
    batches.append((val[rows * T:n][None], val[rows * T + 1:][None]))
with torch.no_grad():
    total = sum(F.cross_entropy(model(a, b)[0].flatten(0, 1), b.flatten(), reduction='sum').item()
                for a, b in batches)
print(json.dumps({'iter': ckpt['iter_num'], 'val_loss_full': total / n}))"""


# issue 13: nanoGPT's own 20-batch estimate, and the bound on any seed
GOAL_LOSS, WORST_LOSS = 1.886, 1.90


class Timed:
    """One whole process, started now: `wait()` gives its wall seconds (start to exit) and CPU
    seconds (its own user + system time, from wait4), which on a crowded machine says what it cost
    when the wall time cannot."""

    def __init__(self, argv: list[str], cwd: Path, log: Path) -> None:
        self.argv, self.log = argv, log
        self.file = open(log, "w")
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=self.file, stderr=subprocess.STDOUT)

    def wait(self) -> dict:
        _, status, usage = os.wait4(self.proc.pid, 0)
        wall = time.perf_counter() - self.start
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.file.close()
        if self.proc.returncode:
            raise SystemExit(
                f"{' '.join(self.argv[:4])} ... failed (exit {self.proc.returncode}); see "
                f"{self.log}"
            )
        return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}


def start_nanogpt(nanogpt: Path, seed: int, out: Path) -> Timed:
    flags = [*NANOGPT_FLAGS, f"--out_dir={out / f'nanogpt-{seed}'}"]
    argv = (
        [sys.executable, "train.py", *flags]
        if seed == 1337
        else [sys.executable, "-c", SEEDED_NANOGPT, str(seed), *flags]
    )
    return Timed(argv, nanogpt, out / f"nanogpt-{seed}.log")


def score_nanogpt(nanogpt: Path, seed: int, out: Path) -> dict:
    scored = subprocess.run(
        [sys.executable, "-c", SCORE_NANOGPT, str(out / f"nanogpt-{seed}")],
        cwd=nanogpt,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(scored.stdout.splitlines()[-1])


def start_attnlab(data: str, seed: int, out: Path, extra: list[str]) -> Timed:
    argv = [
        sys.executable,
        "-m",
        "attnlab",
        "train",
        "--preset",
        "speedrun",
        "--data",
        data,
        "--seed",
        str(seed),
        "--out",
        str(out / f"attnlab-{seed}"),
        "--overwrite",
        "--quiet",
        *extra,
    ]
    return Timed(argv, Path.cwd(), out / f"attnlab-{seed}.log")


def score_attnlab(seed: int, out: Path) -> dict:
    last = json.loads((out / f"attnlab-{seed}" / "metrics.jsonl").read_text().splitlines()[-1])
    return {"iter": last["iter"], "val_loss_full": last["val_loss_full"]}


def run_pair(args: argparse.Namespace, seed: int, order: tuple[str, str]) -> dict:
    """Both programs on one seed: one after the other in `order`, or with --concurrent both at
    once."""
    start = {
        "nanogpt": lambda: start_nanogpt(args.nanogpt, seed, args.out),
        "attnlab": lambda: start_attnlab(args.data, seed, args.out, args.attnlab_flags.split()),
    }
    times = {}
    # each process is waited for in its own thread, so each wall time ends at its own exit
    if args.concurrent:
        from concurrent.futures import ThreadPoolExecutor

        running = {name: start[name]() for name in order}
        with ThreadPoolExecutor(len(running)) as pool:
            times = dict(zip(running, pool.map(Timed.wait, running.values())))
    else:
        for name in order:
            times[name] = start[name]().wait()
    return {
        "nanogpt": {**times["nanogpt"], **score_nanogpt(args.nanogpt, seed, args.out)},
        "attnlab": {**times["attnlab"], **score_attnlab(seed, args.out)},
    }


def markdown_table(rows: list[dict], mean: dict, machine: str, args: argparse.Namespace) -> str:
    """The run as a table for benchmarks/README.md: every seed, the mean, the goal's verdict, and
    the conditions."""
    lines = [
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset (torch default)')}, "
        f"{'both programs at once' if args.concurrent else 'one program at a time, alternating'}"
        f"{', attnlab flags: ' + args.attnlab_flags if args.attnlab_flags else ''}",
        "",
        "| seed | first | load | nanoGPT val, whole split | nanoGPT wall s (CPU s) | attnlab val, "
        "whole split "
        "| attnlab wall s (CPU s) | steps | wall ratio | CPU ratio |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        n, a = r["nanogpt"], r["attnlab"]
        lines.append(
            f"| {r['seed']} | {r['first']} | {r['load_before']:.1f} -> {r['load_after']:.1f} | "
            f"{n['val_loss_full']:.4f} | {n['wall_s']:.1f} ({n['cpu_s']:.1f}) | "
            f"{a['val_loss_full']:.4f} | "
            f"{a['wall_s']:.1f} ({a['cpu_s']:.1f}) | {a['iter']} | "
            f"{a['wall_s'] / n['wall_s']:.3f} | "
            f"{a['cpu_s'] / n['cpu_s']:.3f} |"
        )
    n, a = mean["nanogpt"], mean["attnlab"]
    lines.append(
        f"| mean | | | {n['val_loss_full']:.4f} | {n['wall_s']:.1f} ({n['cpu_s']:.1f}) | "
        f"**{a['val_loss_full']:.4f}** | {a['wall_s']:.1f} ({a['cpu_s']:.1f}) | | "
        f"**{a['wall_s'] / n['wall_s']:.3f}** | {a['cpu_s'] / n['cpu_s']:.3f} |"
    )
    worst = max(r["attnlab"]["val_loss_full"] for r in rows)
    first = rows[0]
    holds = (
        first["attnlab"]["val_loss_full"] <= GOAL_LOSS
        and first["attnlab"]["wall_s"] <= first["nanogpt"]["wall_s"] / 3
        and a["val_loss_full"] <= GOAL_LOSS
        and a["wall_s"] <= n["wall_s"] / 3
        and worst <= WORST_LOSS
    )
    lines += [
        "",
        f"Goal (first seed and the mean: val <= {GOAL_LOSS}, wall <= 1/3 of nanoGPT's; no seed "
        "above "
        f"{WORST_LOSS}): {'met' if holds else 'NOT met'} (worst seed {worst:.4f}).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nanogpt", required=True, type=Path, help="a nanoGPT clone with shakespeare_char prepared"
    )
    parser.add_argument(
        "--data", required=True, help="the Tiny Shakespeare text nanoGPT's prepare.py read"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 2, 3])
    parser.add_argument("--out", type=Path, default=Path("runs/speedrun-bench"))
    parser.add_argument(
        "--attnlab-flags", default="", help="extra flags for attnlab train, e.g. '--max-iters 300'"
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run each seed's two programs at the same time (a crowded machine: both see the same "
        "load)",
    )
    add_results_argument(parser)
    args = parser.parse_args()
    if not (args.nanogpt / "data" / "shakespeare_char" / "val.bin").is_file():
        raise SystemExit(
            f"--nanogpt {args.nanogpt}: no data/shakespeare_char/val.bin; run its prepare.py first"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    # measured once, before the runs: printed, tabled, saved
    peak, copy = measure_matmul_peak(), copy_bandwidth()
    machine = f"{machine_line()}; matmul {peak / 1e9:.1f} GFLOP/s, copy {copy / 1e9:.1f} GB/s"
    print(machine, flush=True)
    rows = []
    for i, seed in enumerate(args.seeds):
        order = ("nanogpt", "attnlab") if i % 2 == 0 else ("attnlab", "nanogpt")
        row = {
            "seed": seed,
            "first": "both" if args.concurrent else order[0],
            "load_before": os.getloadavg()[0],
        }
        row.update(run_pair(args, seed, order))
        row["load_after"] = os.getloadavg()[0]
        rows.append(row)
        n, a = row["nanogpt"], row["attnlab"]
        print(
            f"seed {seed} ({row['first']} first, load {row['load_before']:.1f} -> "
            f"{row['load_after']:.1f}): "
            f"nanoGPT {n['val_loss_full']:.4f} in {n['wall_s']:.1f} s (CPU {n['cpu_s']:.1f} s) | "
            "attnlab "
            f"{a['val_loss_full']:.4f} in {a['wall_s']:.1f} s (CPU {a['cpu_s']:.1f} s, "
            f"{a['iter']} steps) | ratio: "
            f"wall {a['wall_s'] / n['wall_s']:.3f}, CPU {a['cpu_s'] / n['cpu_s']:.3f}",
            flush=True,
        )
    mean = {
        name: {
            key: statistics.mean(r[name][key] for r in rows)
            for key in ("wall_s", "cpu_s", "val_loss_full")
        }
        for name in ("nanogpt", "attnlab")
    }
    print(
        f"mean over {len(rows)} seeds: nanoGPT {mean['nanogpt']['val_loss_full']:.4f} in "
        f"{mean['nanogpt']['wall_s']:.1f} s | attnlab {mean['attnlab']['val_loss_full']:.4f} in "
        f"{mean['attnlab']['wall_s']:.1f} s | wall ratio "
        f"{mean['attnlab']['wall_s'] / mean['nanogpt']['wall_s']:.3f}"
    )
    table = markdown_table(rows, mean, machine, args)
    print("\n" + table)
    (args.out / "speedrun.md").write_text(table)
    write_record(args, rows, mean, peak, copy)


def write_record(args, rows: list[dict], mean: dict, peak: float, copy: float) -> Path:
    """The run as a results record: the mean wall and CPU times and whole-split losses of both
    programs over the seeds; each seed's numbers in its details."""
    n, a = mean["nanogpt"], mean["attnlab"]
    seeds = f"mean of {len(rows)} seed{'s' if len(rows) > 1 else ''}"
    return write_result(
        args.results,
        "speedrun",
        measures="Training on Tiny Shakespeare to nanoGPT's loss: `attnlab train --preset "
        "speedrun` against nanoGPT's README CPU command, each a whole process, alternating.",
        anchor="nanoGPT",
        anchor_version=git_commit(args.nanogpt),
        figures=[
            figure(f"wall time, {seeds}", "s", a["wall_s"], n["wall_s"], "lower"),
            figure(f"CPU time, {seeds}", "s", a["cpu_s"], n["cpu_s"], "lower"),
            figure(
                f"validation loss, whole split, {seeds}",
                "",
                a["val_loss_full"],
                n["val_loss_full"],
                "",
            ),
        ],
        machine=machine_description(copy_bandwidth=copy, matmul_flops=peak),
        details={"rows": rows, "concurrent": args.concurrent},
    )


if __name__ == "__main__":
    main()
