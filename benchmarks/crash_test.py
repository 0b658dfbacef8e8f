"""The crash test: a training run SIGKILLed again and again, each time restarted with `--resume
auto`.

    python benchmarks/crash_test.py --kills 50            # one process, 50 kills
    python benchmarks/crash_test.py --kills 0 --ddp 3     # torchrun --max-restarts=3, a worker
    killed 3 times

Half the kills land inside a checkpoint save by construction (just before the K-th file-system
commit of a
save: each file's fsync, the folder's rename, the links into the run folder, the pruning of an old
checkpoint), the other half at a random moment after the data is ready (inside a save or not, by
chance). The kill points live in crash_hook/sitecustomize.py, loaded only into the killed processes:
attnlab itself has none. After every kill the run folder is checked:
- every checkpoint folder under checkpoints/ is complete: its manifest verifies, train_state.pt
  loads, attnlab.load reads the model (zero unreadable checkpoints), and so does the run folder
  itself;
- the newest complete checkpoint's step never goes back (never past the last complete checkpoint);
then, when the run has finished, every evaluation in metrics.jsonl equals the uninterrupted run's to
1e-6 (validation loss included), the run having been restarted from whatever each kill left.

Under `--ddp N`, torchrun (`--max-restarts N`) runs two workers, and N times a worker dies by
SIGKILL (rank 1 at a random moment, then rank 0 inside a save); torchrun restarts both each time,
they resume with `--resume auto`, and every evaluation must equal an uninterrupted two-process
run's. In both forms a run that finished before all its planned kills landed fails (exit 1): it
would have shown less than it claims. Results go into benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HOOK = Path(__file__).resolve().parent / "crash_hook"
SRC = Path(__file__).resolve().parent.parent / "src"
# Small enough to restart quickly, with dropout and accumulation so that exact resumption is tested.
SETTINGS = dict(
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=32,
    batch_size=8,
    max_iters=120,
    lr_decay_iters=120,
    warmup_iters=10,
    eval_interval=5,
    eval_iters=2,
    learning_rate=3e-3,
    min_lr=3e-4,
    seed=5,
    dropout=0.1,
    device="cpu",
)


def write_text(path: Path, n_chars: int = 30_000, seed: int = 0) -> Path:
    words = "the cat sat on a mat and saw her dog run to it while we ate bread".split()
    rng = random.Random(seed)
    lines = []
    while sum(map(len, lines)) < n_chars:
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + ".\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def train_command(data: Path, out: Path, settings: dict, ddp: int = 0) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    launcher = [sys.executable, "-m", "attnlab"]
    if ddp:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "--max-restarts",
            str(ddp),
            "-m",
            "attnlab",
        ]
    return [
        *launcher,
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        *flags,
        "--resume",
        "auto",
        "--quiet",
    ]


def run_killed(
    data: Path,
    out: Path,
    settings: dict,
    log: Path,
    plan: list[dict],
    ddp: int = 0,
) -> subprocess.CompletedProcess:
    """One start of the run (a torchrun job under `ddp`), killed as `plan` says
    (crash_hook/sitecustomize.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_CRASH_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(HOOK), str(SRC), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        ATTNLAB_CRASH_OUT=str(out),
        ATTNLAB_CRASH_LOG=str(log),
        ATTNLAB_CRASH_PLAN=json.dumps(plan),
    )
    return subprocess.run(
        train_command(data, out, settings, ddp),
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )


def reference_run(
    data: Path, out: Path, settings: dict, log: Path, ddp: int = 0
) -> tuple[float, float]:
    """The uninterrupted run; returns the seconds from the start of training to its first evaluation
    (and checkpoint), and from there to its last."""
    done = run_killed(data, out, settings, log, [], ddp)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records[0]["elapsed_s"], records[-1]["elapsed_s"] - records[0]["elapsed_s"]


def check_checkpoints(out: Path) -> int | None:
    """The newest complete checkpoint's step (None if there is none yet); raises if any checkpoint
    folder
    is unreadable: its manifest must verify, train_state.pt load and attnlab.load read its model."""
    import torch

    import attnlab
    from attnlab.files import verify_manifest
    from attnlab.training.checkpoint import checkpoint_dirs

    folders = checkpoint_dirs(out)
    for _, folder in folders:
        assert verify_manifest(folder) is not None, f"{folder}: no manifest"
        torch.load(folder / "train_state.pt", map_location="cpu", weights_only=True)
        attnlab.load(folder)
    if folders:
        attnlab.load(out)  # the model linked into the run folder reads too
    return folders[0][0] if folders else None


def evaluations(out: Path) -> list[tuple[int, float, float]]:
    records = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [(r["iter"], r["train_loss"], r["val_loss"]) for r in records]


@dataclass
class CrashReport:
    kills: int = 0
    inside_save: int = 0
    restarts: int = 0
    steps: list[int] = field(default_factory=list)  # newest complete step after each kill
    max_difference: float = 0.0
    final_val_loss: float = 0.0
    reference_val_loss: float = 0.0
    seconds: float = 0.0
    log: list[str] = field(default_factory=list)


def _compare(report: CrashReport, reference: Path, out: Path) -> None:
    want, got = evaluations(reference), evaluations(out)
    assert [r[0] for r in got] == [r[0] for r in want], (got, want)
    report.max_difference = max(max(abs(a[1] - b[1]), abs(a[2] - b[2])) for a, b in zip(got, want))
    report.final_val_loss, report.reference_val_loss = got[-1][2], want[-1][2]


def _kill_lines(log: Path) -> list[str]:
    return (
        [line for line in log.read_text().splitlines() if line.startswith("kill")]
        if log.exists()
        else []
    )


def run_crash_test(
    root: Path,
    kills: int,
    seed: int = 0,
    settings: dict | None = None,
    timer_fraction: float = 0.05,
    say=lambda line: None,
) -> CrashReport:
    """Kill a run up to `kills` times (every other kill inside a save, the rest at a random moment
    within `timer_fraction` of a run's training time), resume it each time, check it as the module
    docstring says."""
    settings = {**SETTINGS, **(settings or {})}
    rng = random.Random(seed)
    data = write_text(root / "data.txt")
    out, log = root / "run", root / "kills.log"
    start = time.perf_counter()
    first, rest = reference_run(data, root / "reference", settings, root / "reference.log")
    train_time = first + rest
    report, last_step = CrashReport(), None
    while True:
        if report.kills >= kills:
            plan = []
        # just before one of the next two saves' file-system commits (17 a save)
        elif report.kills % 2 == 0:
            plan = [{"save_event": rng.randint(1, 34)}]
        else:
            plan = [{"after": round(rng.uniform(0.0, timer_fraction * train_time), 3)}]
        done = run_killed(data, out, settings, log, plan)
        report.restarts += 1
        if done.returncode == 0:
            break  # finished (before its kill point, or with no kill planned)
        assert done.returncode == -9, f"exit {done.returncode}: {done.stderr[-2000:]}"
        report.kills += 1
        step = check_checkpoints(out)
        assert last_step is None or (step is not None and step >= last_step), (last_step, step)
        last_step = step
        report.steps.append(step if step is not None else 0)
        say(f"kill {report.kills}: {_kill_lines(log)[-1]}; newest complete checkpoint: step {step}")
    check_checkpoints(out)
    report.log = _kill_lines(log)
    report.inside_save = sum(" inside a save" in line for line in report.log)
    _compare(report, root / "reference", out)
    report.seconds = time.perf_counter() - start
    assert len(report.log) == report.kills
    assert report.max_difference <= 1e-6, report.max_difference
    return report


def run_ddp_restarts(
    root: Path, restarts: int, seed: int = 0, settings: dict | None = None
) -> CrashReport:
    """torchrun --max-restarts=RESTARTS with two workers: on the first start rank 1 (which writes
    nothing) SIGKILLs itself at a random moment, on each later start but the last rank 0 dies inside
    a save; torchrun restarts both each time and the run must end with the uninterrupted two-process
    run's losses, after exactly RESTARTS kills."""
    settings = {**SETTINGS, **(settings or {})}
    rng = random.Random(seed)
    data = write_text(root / "data.txt")
    out, log = root / "run", root / "kills.log"
    start = time.perf_counter()
    _, rest = reference_run(
        data, root / "reference", settings, root / "reference.log", ddp=restarts
    )
    # rank 1 writes nothing: its clock starts when the first checkpoint appears, and it dies while
    # training
    plan = [{"rank": 1, "clock": "checkpoint", "after": round(rng.uniform(0.1, 0.6) * rest, 3)}]
    plan += [{"rank": 0, "save_event": rng.randint(1, 17)} for _ in range(restarts - 1)]
    done = run_killed(data, out, settings, log, plan, ddp=restarts)
    assert done.returncode == 0, done.stderr[-3000:]
    report = CrashReport(log=_kill_lines(log), restarts=restarts)
    report.kills = len(report.log)
    report.inside_save = sum(" inside a save" in line for line in report.log)
    # A kill that never landed (a timer past the run's end, a save event past its last save) lets
    # the run
    # finish in fewer starts: it would pass having shown less than it claims, so it fails here.
    assert report.kills == len(plan), (
        f"{report.kills} of the {len(plan)} planned kills landed "
        f"(torchrun --max-restarts={restarts}): {report.log}"
    )
    check_checkpoints(out)
    _compare(report, root / "reference", out)
    report.seconds = time.perf_counter() - start
    assert report.max_difference <= 1e-6, report.max_difference
    return report


def main() -> None:
    sys.path.insert(0, str(SRC))
    from _common import machine_line

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument(
        "--ddp", type=int, default=3, help="torchrun --max-restarts (0 = skip the DDP part)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-iters", type=int, default=SETTINGS["max_iters"])
    parser.add_argument("--root", type=Path, default=Path("runs/crash_test"))
    args = parser.parse_args()
    print(machine_line())
    settings = {"max_iters": args.max_iters, "lr_decay_iters": args.max_iters}
    if args.kills:
        root = args.root / "single"
        root.mkdir(parents=True, exist_ok=False)
        report = run_crash_test(root, args.kills, args.seed, settings, say=print)
        # the run finished before its next kill point: less shown than asked
        if report.kills < args.kills:
            raise SystemExit(
                f"only {report.kills} of the {args.kills} planned kills landed before the run "
                "finished "
                f"({report.restarts} starts); give it more steps (--max-iters) or fewer --kills"
            )
        print(
            f"single process: {report.kills} SIGKILLs ({report.inside_save} inside a save), "
            f"{report.restarts} starts, "
            "0 unreadable checkpoints, the step never went back; final val loss "
            f"{report.final_val_loss:.6f} vs "
            f"{report.reference_val_loss:.6f} uninterrupted (largest difference over every "
            "evaluation "
            f"{report.max_difference:.1e}); {report.seconds:.0f} s"
        )
    if args.ddp:
        root = args.root / "ddp"
        root.mkdir(parents=True, exist_ok=False)
        report = run_ddp_restarts(root, args.ddp, args.seed, settings)
        for line in report.log:
            print(f"ddp kill: {line}")
        print(
            f"torchrun --max-restarts={args.ddp}, 2 workers: {report.kills} SIGKILLs of a worker, "
            "restarted each time; "
            f"final val loss {report.final_val_loss:.6f} vs {report.reference_val_loss:.6f} "
            "uninterrupted "
            f"(largest difference {report.max_difference:.1e}); {report.seconds:.0f} s"
        )


if __name__ == "__main__":
    main()
