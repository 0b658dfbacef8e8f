"""Light training snapshots: the weights alone, in float16, at evenly spaced steps (`attnlab train
--snapshots N`).

Design choices:
- A snapshot is one safetensors file, `OUT/snapshots/step-000250.safetensors`, holding the model's
  tensors as `state_dict_for_saving` gives them (a tied head once), cast to float16: half the bytes
  of the float32 checkpoint and no optimizer state. The config
  and tokenizer are the run's own (OUT/config.json, OUT/tokenizer.json): every snapshot has the same
  shape.
- The steps are evenly spaced over the run and include step 0 (the initialisation), so scrubbing
  through them shows a circuit form from nothing: `snapshot_steps(1000, 5)` is 0, 250, 500, 750,
  1000.
- Written atomically like every checkpoint file, by rank 0; a resumed run keeps the snapshots it
  has.
- Read back (`load_snapshot`) into a copy of the run's model, float16 widened to the model's dtype:
  the explorer's step slider shows the model as it was at that step.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from ..errors import UserError
from ..files import atomic_write
from ..formats.native import load_state, read_safetensors, state_dict_for_saving

SNAPSHOT_DIR = "snapshots"
SNAPSHOT_DTYPE = torch.float16
_NAME = re.compile(r"step-(\d+)\.safetensors")


def snapshot_steps(max_iters: int, n: int) -> list[int]:
    """n evenly spaced steps from 0 to max_iters, both included (one snapshot: the last step)."""
    if n < 0:
        raise UserError(f"--snapshots must be >= 0, got {n}")
    if n == 0:
        return []
    if n == 1:
        return [max_iters]
    return sorted({round(i * max_iters / (n - 1)) for i in range(n)})


def snapshot_path(out: str | Path, step: int) -> Path:
    return Path(out) / SNAPSHOT_DIR / f"step-{step:06d}.safetensors"


def save_snapshot(model, out: str | Path, step: int) -> Path:
    """The model's weights at `step`, in float16, written atomically under out/snapshots/."""
    from safetensors.torch import save_file

    path = snapshot_path(out, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.to(SNAPSHOT_DTYPE).cpu() if v.is_floating_point() else v.cpu()
        for k, v in state_dict_for_saving(model).items()
    }
    atomic_write(
        path, lambda tmp: save_file(state, tmp, metadata={"format": "pt", "step": str(step)})
    )
    return path


def list_snapshots(run: str | Path) -> dict[int, Path]:
    """step -> file of every snapshot in run/snapshots, in step order (empty when there are
    none)."""
    folder = Path(run) / SNAPSHOT_DIR
    if not folder.is_dir():
        return {}
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))}
    return dict(sorted(found.items()))


def load_snapshot(model, path: str | Path):
    """A copy of `model` (tokenizer included) holding the weights of the snapshot at `path`, in eval
    mode."""
    # the tokenizer is shared, not copied
    snap = copy.deepcopy(model, memo={id(model.tokenizer): model.tokenizer})
    dtype = next(model.parameters()).dtype
    load_state(
        snap,
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in read_safetensors(path).items()},
        path,
    )
    return snap.eval()
