"""What a training run leaves to read: metrics.jsonl (one line per evaluation), loss.png and
report.md."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_write, atomic_write_text
from .config import flag_name

METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainResult:
    """What `train` returns: the run's folder, its steps, losses and evaluations, and its speed."""

    out: Path
    iters: int  # steps completed, over every session of this run
    # step -> training loss, this session's steps
    losses: dict[int, float] = field(default_factory=dict)
    train_loss: float | None = None  # at the last evaluation
    val_loss: float | None = None
    # at the end: every validation token, once (Trainer.full_val_loss)
    val_loss_full: float | None = None
    tokens_per_s: float = 0.0
    elapsed_s: float = 0.0  # wall time of the run, evaluations included, over every session
    interrupted: bool = False
    complete: str | None = None  # --resume auto on a finished run: why there was nothing to train


def first_reaching(records: list[dict[str, Any]], target: float | None) -> dict[str, Any] | None:
    """The first evaluation record whose val loss (the eval_iters estimate, or at the end the whole
    split) is at most `target`; None if none is, or no target was set."""
    if target is None:
        return None
    return next(
        (r for r in records if min(r["val_loss"], r.get("val_loss_full", math.inf)) <= target), None
    )


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_loss_plot(out: Path) -> None:
    records = read_metrics(out)
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["iter"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["train_loss"] for r in records], marker="o", label="train")
    ax.plot(steps, [r["val_loss"] for r in records], marker="o", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(f"{out.name}: val {records[-1]['val_loss']:.3f} at step {steps[-1]}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(out / "loss.png", lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def _git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}"
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} CPUs"
    )


def write_report(trainer, result: TrainResult) -> None:
    """report.md of the run that `trainer` (attnlab.training.trainer.Trainer) ran, ending in
    `result`."""
    cfg = trainer.cfg
    config_rows = "\n".join(f"| `{flag_name(k)}` | {v} |" for k, v in cfg.to_dict().items())
    fmt = lambda v: f"{v:.4f}" if v is not None else "n/a"  # noqa: E731
    reached_row = ""
    if cfg.target_loss is not None:
        first = first_reaching(read_metrics(trainer.out), cfg.target_loss)
        when = (
            f"step {first['iter']}, {first['elapsed_s']:.1f} s"
            if first is not None
            else "not reached"
        )
        reached_row = f"| first evaluation with val loss <= {cfg.target_loss:g} | {when} |\n"
    choice = trainer.newton_schulz
    muon_row = f"| Muon's Newton-Schulz | {choice.name}: {choice.why} |\n" if choice else ""
    n_train = trainer.data.n_train
    n_val = len(trainer.data.tokens) - n_train
    text = f"""# Training report: {trainer.out}

| | |
| --- | --- |
| steps | {result.iters} of {cfg.max_iters}{" (interrupted)" if result.interrupted else ""} |
| final train loss | {fmt(result.train_loss)} |
| final val loss (eval_iters batches) | {fmt(result.val_loss)} |
| final val loss, whole split (every token once) | {fmt(result.val_loss_full)} |
{reached_row}| tokens/s (training steps, this session) | {result.tokens_per_s:,.0f} |
| wall time (evaluations included) | {result.elapsed_s:.1f} s |
| parameters | {trainer.raw_model.num_params():,} |
| tokenizer | {trainer.tokenizer.kind}, {trainer.tokenizer.vocab_size} tokens |
| tokens in corpus (train / val) | {n_train:,} / {n_val:,} |
| processes | {trainer.dist.world} |
| device, dtype | {trainer.device}, {str(trainer.dtype).removeprefix("torch.")} |
{muon_row}| hardware | {_hardware(trainer.device)} |
| torch | {torch.__version__} |
| python | {platform.python_version()} |
| git commit | {_git_commit()} |
| finished | {time.strftime("%Y-%m-%d %H:%M:%S %Z")} |

![loss](loss.png)

## Config

| flag | value |
| --- | --- |
{config_rows}
"""
    atomic_write_text(trainer.out / "report.md", text)
