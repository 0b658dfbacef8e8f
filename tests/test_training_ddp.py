"""Distributed training: two CPU processes under torchrun (gloo) equal one process with the same
global batch.

Tolerance: 1e-5 on every logged loss. The two runs see exactly the same windows and dropout-free
updates; only the order of float32 sums differs (DDP averages two half-batch gradients, one process
sums the two micro-batches), which over a few steps moves losses by ~1e-7.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from training_tiny import tiny_config, tiny_flags

from attnlab.training.trainer import train


def torchrun(flags: list[str], *launcher: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            *launcher,
            "-m",
            "attnlab",
            "train",
            *flags,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    changes = dict(max_iters=6, lr_decay_iters=6, eval_interval=3)
    single = train(
        tiny_config(tmp_path / "one", gradient_accumulation_steps=2, **changes), progress=False
    )
    # without --gradient-accumulation-steps each process takes one micro-batch per step: two in all
    done = torchrun(tiny_flags(tmp_path / "two", **changes))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trained 6 steps" in done.stdout
    records = [
        json.loads(line)
        for line in (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    expected = [
        json.loads(line) for line in (single.out / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iter"] for r in records] == [r["iter"] for r in expected] == [3, 6]
    for got, want in zip(records, expected):
        assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-5)
        assert got["val_loss"] == pytest.approx(want["val_loss"], abs=1e-5)
    assert "| processes | 2 |" in (tmp_path / "two" / "run" / "report.md").read_text()


@pytest.mark.slow
def test_an_accumulation_that_does_not_divide_over_the_processes_is_one_line(tmp_path):
    done = torchrun(tiny_flags(tmp_path, gradient_accumulation_steps=3))
    assert done.returncode != 0
    errors = sorted(
        {line for line in done.stderr.splitlines() if line.startswith("attnlab train: error:")}
    )
    assert len(errors) == 1 and "(3) counts micro-batches over all 2 processes" in errors[0], (
        done.stderr
    )
    # torchrun prints its own failure report, but no frame of ours
    assert "attnlab/training" not in done.stderr
