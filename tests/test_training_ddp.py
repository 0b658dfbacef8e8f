"""Distributed training: two CPU processes under torchrun (gloo) equal one process with the same global batch.

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

from attnlab.training.trainer import train
from training_tiny import tiny_config, tiny_flags


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    changes = dict(max_iters=6, lr_decay_iters=6, eval_interval=3, gradient_accumulation_steps=2)
    single = train(tiny_config(tmp_path / "one", **changes), progress=False)
    flags = tiny_flags(tmp_path / "two", **changes)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "attnlab", "train", *flags],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trained 6 steps" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (single.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records] == [r["iter"] for r in expected] == [3, 6]
    for got, want in zip(records, expected):
        assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-5)
        assert got["val_loss"] == pytest.approx(want["val_loss"], abs=1e-5)
    assert "| processes | 2 |" in (tmp_path / "two" / "run" / "report.md").read_text()
