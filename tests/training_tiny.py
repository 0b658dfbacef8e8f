"""Tiny training runs for the training tests: a small text and a config that trains in a second;
and the command line's answers to damaged models (one line, never a traceback)."""

from __future__ import annotations

import random
import subprocess
import sys
import warnings
from pathlib import Path

import attnlab
from attnlab.errors import UserError
from attnlab.training.config import TrainConfig


def write_text(path: Path, n_chars: int = 20_000, seed: int = 0) -> Path:
    """Pseudo-English with structure a model can learn quickly (repeated words, newlines)."""
    words = "the cat sat on a mat and saw her dog run to it while we ate bread".split()
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + ".\n"
        out.append(line)
        size += len(line)
    path.write_text("".join(out), encoding="utf-8")
    return path


def tiny_config(tmp_path: Path, **changes) -> TrainConfig:
    data = tmp_path / "data.txt"
    if not data.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        write_text(data)
    values = dict(
        data=str(data),
        out=str(tmp_path / "run"),
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=16,
        batch_size=4,
        max_iters=6,
        lr_decay_iters=6,
        warmup_iters=2,
        eval_interval=3,
        eval_iters=2,
        learning_rate=3e-3,
        min_lr=3e-4,
        seed=5,
        device="cpu",
    )
    values.update(changes)
    return TrainConfig(**values)


def tiny_flags(tmp_path: Path, **changes) -> list[str]:
    """The same tiny run as command-line flags."""
    cfg = tiny_config(tmp_path, **changes)
    flags = []
    for name in (
        "data",
        "out",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "batch_size",
        "max_iters",
        "lr_decay_iters",
        "warmup_iters",
        "eval_interval",
        "eval_iters",
        "learning_rate",
        "min_lr",
        "seed",
        "device",
        "gradient_accumulation_steps",
    ):
        if getattr(cfg, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(cfg, name))]
    return flags + ["--quiet"]


def run_cli(argv, capsys) -> tuple[int, str]:
    """Run `attnlab ARGV` in this process; its exit code and stderr."""
    from attnlab.cli import main

    code = main(argv)
    return code, capsys.readouterr().err


def one_line_error(err: str) -> str:
    """The one line a refused command printed (asserting it is one line and no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def sample_damaged(path, env: dict[str, str], prompt: str) -> int:
    """`attnlab sample PATH` in a child process on a mutated model: it samples (0) or is refused in
    one line (2), never a traceback; returns the exit code."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnlab",
            "sample",
            str(path),
            "--max-new-tokens",
            "2",
            "--prompt",
            prompt,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 2), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if done.returncode == 2:
        one_line_error(done.stderr)
    return done.returncode


def load_or_one_line(path: Path) -> str:
    """'ok' or the one line a refusal gives; any other exception fails the property."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = attnlab.load(path)
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc), repr(exc)
        return str(exc)
    assert all(t.is_floating_point() for t in model.state_dict().values())
    return "ok"
