"""A training run's folder as loading reads it: `OUT/checkpoints/step-NNNNNNN/`, each checkpoint a
folder whose manifest vouches for its files (written by attnlab.training.checkpoint).

Design choices:
- Here, below the formats' loaders, rather than in training/: `attnlab.load(run)` and `attnlab
  sample OUT` (generate/) read a run's newest checkpoint through attnlab.formats, and training sits
  above formats (its checkpoints are written with the native format). Which folder of a run is its
  newest complete checkpoint is a fact about files, so the loaders and --resume
  (attnlab.training.checkpoint.find_checkpoint) share it from here; writing, pruning and resuming
  stay in training/.
- A checkpoint is chosen by one walk, newest first (`newest_complete`), each caller with its own
  check: loading wants a verified manifest, --resume also its training state.
- When every checkpoint is damaged, the run folder's own model files load only if a checkpoint's
  manifest vouches for their bytes (`run_model_dir`).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import UserError
from ..files import MANIFEST, file_digest, verify_manifest
from .native import MODEL_FILES

# a training run's folder of checkpoints, step-NNNNNNN/ each (attnlab.training.checkpoint)
CHECKPOINTS = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"step-(\d{7,})")
T = TypeVar("T")


def checkpoint_dirs(run: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint of a training run, newest first (hidden
    temporaries, which an interrupted save leaves, excluded)."""
    root = Path(run) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _CHECKPOINT_NAME.fullmatch(p.name)) and p.is_dir()
    ]
    return sorted(found, reverse=True)


def verified_checkpoint(folder: Path) -> Path:
    """`folder`, when its manifest verifies; a UserError naming what is wrong with it otherwise."""
    if verify_manifest(folder) is None:
        raise UserError(f"{folder}: no {MANIFEST}; the checkpoint was never completed")
    return folder


def newest_complete(run: str | Path, check: Callable[[Path], T]) -> tuple[T | None, list[str]]:
    """Walk a training run's checkpoints newest first: check(folder) on each until one passes
    (returns rather than raising a UserError). Returns what it returned (None when none passed) and
    why each newer one failed. Loading a run folder (`run_model_dir`) and --resume
    (attnlab.training.checkpoint. find_checkpoint) choose their checkpoint by this one walk, with
    their own `check`."""
    problems: list[str] = []
    for _, folder in checkpoint_dirs(run):
        try:
            return check(folder), problems
        except UserError as exc:
            problems.append(str(exc))
    return None, problems


def run_model_dir(run: str | Path) -> Path:
    """The folder that loading a training run's folder reads: its newest checkpoint whose manifest
    verifies (so it never depends on the model files linked into the run folder being up to date),
    with a warning naming each newer one skipped as damaged; the run folder itself when it has no
    checkpoint folders.

    When every checkpoint is damaged, the run folder's own model files (hard links into the newest
    checkpoint, or copies) are loaded only if a checkpoint's manifest vouches for their bytes, with
    a warning naming what was damaged; if they hold the damaged bytes or no manifest vouches for
    them, a UserError names the file and the way out."""
    run = Path(run)
    checkpoints = checkpoint_dirs(run)
    if not checkpoints:
        return run
    folder, damaged = newest_complete(run, verified_checkpoint)
    if folder is not None:
        if damaged:
            warnings.warn(
                f"skipped a damaged checkpoint ({damaged[0]}); loading the previous complete one, "
                f"{folder}",
                stacklevel=3,
            )
        return folder
    why = "; ".join(damaged)
    vouching, problem = model_files_vouched_for(run, [folder for _, folder in checkpoints])
    if vouching is not None:
        warnings.warn(
            f"every checkpoint of {run} is damaged ({why}); loading the model files in {run} "
            f"itself, whose size and SHA-256 match {vouching / MANIFEST}",
            stacklevel=3,
        )
        return run
    raise UserError(
        f"{run}: every checkpoint is damaged ({why}), and {problem}; nothing here verifies, so "
        "nothing is loaded: restore the run from a backup, or train it again with --overwrite"
    )


def model_files_vouched_for(run: Path, checkpoints: list[Path]) -> tuple[Path | None, str]:
    """The first of `checkpoints` whose manifest lists the run folder's model files (MODEL_FILES
    that are there) with their exact size and SHA-256, or None and why not (the run folder's weights
    are the damaged checkpoint's own file, or hold its bytes, or no readable manifest lists
    them)."""
    present = [name for name in MODEL_FILES if (run / name).is_file()]
    weights = run / "model.safetensors"
    if "model.safetensors" not in present:
        return None, f"{weights} is missing"
    digests = {name: file_digest(run / name) for name in present}
    for folder in checkpoints:
        try:
            listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
            if all(listed[name] == digests[name] for name in present):
                return folder, ""
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            # a manifest that is missing, unreadable or silent about a file vouches for nothing
            continue
    for folder in checkpoints:
        theirs = folder / "model.safetensors"
        if theirs.is_file() and os.path.samefile(theirs, weights):
            return None, f"{weights} is the same file as {theirs} (a hard link), damaged with it"
        if theirs.is_file() and file_digest(theirs) == digests["model.safetensors"]:
            return None, f"{weights} holds the same bytes as the damaged {theirs}"
    return (
        None,
        f"no checkpoint's manifest lists {weights} with its size and SHA-256, so it cannot be "
        "verified",
    )
