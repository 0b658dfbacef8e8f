"""Validation loss of trained runs on their whole validation split (not the 20 sampled batches of
training).

    .venv/bin/python benchmarks/train_quality.py runs/nano runs/cpu

Design choices:
- The training log's val_loss is the mean over eval_iters random windows (nanoGPT's estimate); with
  20 batches of 12 x 64 characters its standard error is about 0.01, as large as the gaps being
  compared. This scores every token of the run's last 10% once, in consecutive block_size windows
  (attnlab.training.trainer.whole_split_loss; `attnlab train` now reports it at the end of every
  run).
- It reads the run's own tokens.bin, so the split is exactly the one the run trained beside.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attnlab
from attnlab.training.data import TokenData
from attnlab.training.trainer import whole_split_loss


def full_val_loss(run: Path) -> tuple[float, int]:
    model = attnlab.load(run)
    val = TokenData.open(run).split("val")
    return whole_split_loss(model, val, model.config.n_ctx), len(val) - 1


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        loss, tokens = full_val_loss(Path(arg))
        print(f"{arg}: val loss {loss:.4f} over all {tokens:,} validation tokens")
