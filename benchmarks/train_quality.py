"""Validation loss of trained runs on their whole validation split (not the 20 sampled batches of training).

    .venv/bin/python benchmarks/train_quality.py runs/nano runs/cpu

Design choices:
- The training log's val_loss is the mean over eval_iters random windows (nanoGPT's estimate); with 20
  batches of 12 x 64 characters its standard error is about 0.01, as large as the gaps being compared.
  This scores every non-overlapping block_size window of the run's last 10% of tokens, once.
- It reads the run's own tokens.bin, so the split is exactly the one the run trained beside.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import attnlab
from attnlab.training.data import TokenData
from attnlab.training.trainer import next_token_loss


@torch.no_grad()
def full_val_loss(run: Path, batch: int = 32) -> tuple[float, int]:
    model = attnlab.load(run)
    val = torch.from_numpy(TokenData.open(run).split("val").astype("int64"))
    T = model.config.n_ctx
    n = (len(val) - 1) // T
    x, y = val[: n * T].view(n, T), val[1 : n * T + 1].view(n, T)  # (windows, T), y shifted by one
    total = sum(next_token_loss(model(x[i:i + batch]), y[i:i + batch]).item() * len(x[i:i + batch])
                for i in range(0, n, batch))
    return total / n, n * T


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        loss, tokens = full_val_loss(Path(arg))
        print(f"{arg}: val loss {loss:.4f} over all {tokens:,} validation tokens")
