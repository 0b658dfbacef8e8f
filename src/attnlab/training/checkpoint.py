"""Training checkpoints: each one a folder that is complete or absent, whatever happens while it is
written.

Design choices:
- A checkpoint is a folder `OUT/checkpoints/step-NNNNNNN/`: `train_state.pt` (what --resume reads),
  the native model (`config.json`, `model.safetensors`, `tokenizer.json`: what sample, load and the
  explorer read), `train.json` (the run's config) and `manifest.json` (every other file's size and
  SHA-256, attnlab.files.ManifestFolder.write_manifest).
- It commits in one step. The files go into a fresh hidden folder (`.step-NNNNNNN.XXXX.tmp`), each
  one written once and fsynced once, its size and SHA-256 taken from the bytes written
  (attnlab.files.ManifestFolder: nothing is read back), the manifest last; the hidden folder is
  fsynced (its entries), renamed to its final name (one atomic rename) and `checkpoints/` is fsynced
  so the rename survives a power cut.
  No file inside needs a rename of its own: no reader sees the folder before its rename. This is
  Orbax's AtomicRenameTemporaryPath (orbax/checkpoint/_src/path/atomicity.py: a
  `<step>.orbax-checkpoint-tmp` folder renamed when final, unfinished ones removed before the next
  save) with PyTorch DCP's rule that the metadata file is written
  last (torch/distributed/checkpoint/filesystem.py, FileSystemWriter.finish and its `.metadata`,
  which DCP also renames into place; here the folder's rename is the commit, so the manifest is
  written in place). A kill at any moment leaves the previous checkpoint whole and at worst a hidden
  temporary folder, which the next save removes.
- The newest KEEP complete checkpoints stay, so a damaged newest one has a fallback. An older one is
  renamed to a hidden name before it is deleted: a kill mid-delete never leaves half a checkpoint
  under a real name.
- After each commit the model files are hard-linked into OUT itself (each link swapped in by an
  atomic rename; a copy where links are not possible), so `attnlab sample OUT` reads the newest
  checkpoint without a second copy on disk. Config and tokenizer are the same for the whole run, so
  OUT always holds a consistent model, at worst one checkpoint behind until the next save.
- Finding a checkpoint (`find_checkpoint`): the newest `step-N` whose manifest verifies. A damaged
  newer one is skipped, and the run says which and why; with none complete, --resume stops with one
  line. The walk is attnlab.formats.runs.newest_complete, the one loading a run folder takes too.
- Runs written before checkpoints had folders (train_state.pt and train.json in OUT) still resume.
- Only rank 0 writes; every rank finds the same checkpoint from the same files.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..files import ManifestFolder, fsync_dir, fsync_file, verify_manifest
from ..formats.native import MODEL_FILES
from ..formats.runs import CHECKPOINTS, checkpoint_dirs, newest_complete, verified_checkpoint

STATE_FILE = "train_state.pt"
TRAIN_JSON = "train.json"
KEEP = 2  # complete checkpoints kept: the newest and one to fall back on
PUBLISHED = MODEL_FILES  # linked into OUT, the config last


@dataclass
class Checkpoint:
    path: Path
    step: int
    train_config: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # why newer checkpoints were passed over


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def has_checkpoint(out: Path) -> bool:
    """Whether OUT holds anything --resume would read (a checkpoint folder, or a run from before
    them)."""
    out = Path(out)
    return bool(checkpoint_dirs(out)) or (out / STATE_FILE).is_file()


def _read_train_json(folder: Path) -> dict[str, Any]:
    try:
        saved = json.loads((folder / TRAIN_JSON).read_text(encoding="utf-8"))
        step, config = saved["iter"], saved["config"]
        if not isinstance(step, int) or not isinstance(config, dict):
            raise TypeError("iter must be an integer and config an object")
    except FileNotFoundError:
        raise UserError(f"{folder / TRAIN_JSON}: missing; the checkpoint is incomplete") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(
            f"{folder / TRAIN_JSON}: not a readable training record ({exc!r})"
        ) from None
    return saved


def _complete(folder: Path, legacy: bool = False) -> Checkpoint:
    """The checkpoint in `folder`, its manifest verified; a UserError names what is wrong with
    it."""
    if legacy:  # a run folder from before checkpoint folders: its manifest, if any, still verifies
        verify_manifest(folder)
    else:
        verified_checkpoint(folder)
    if not (folder / STATE_FILE).is_file():
        raise UserError(f"{folder / STATE_FILE}: missing; the checkpoint is incomplete")
    saved = _read_train_json(folder)
    return Checkpoint(folder, saved["iter"], saved["config"])


def no_checkpoint_error(out: Path) -> UserError:
    return UserError(
        f"--resume: no checkpoint in {out} (no {CHECKPOINTS}/step-N folder); "
        "check --out, or run without --resume to start fresh"
    )


def find_checkpoint(out: str | Path, *, required: bool, announce: bool = True) -> Checkpoint | None:
    """The newest complete checkpoint in OUT. A damaged newer one is skipped (said on stderr when
    `announce`); none complete: a UserError if there were damaged ones or `required`, else None."""
    out = Path(out)
    found, problems = newest_complete(out, _complete)
    if found is None and (out / STATE_FILE).is_file():  # a run from before checkpoint folders
        try:
            found = _complete(out, legacy=True)
        except UserError as exc:
            problems.append(str(exc))
    if found is None:
        if problems:
            raise UserError(
                f"--resume: no complete checkpoint in {out}: {problems[0]}; "
                "start fresh with --overwrite"
            )
        if required:
            raise no_checkpoint_error(out)
        return None
    found.skipped = problems
    if announce:
        for problem in problems:
            print(
                f"attnlab train: warning: skipping a damaged checkpoint ({problem}); resuming "
                "from the previous "
                f"complete one, step {found.step}",
                file=sys.stderr,
            )
    return found


def state_bytes(state: dict[str, Any]) -> memoryview:
    """torch.save of `state`, made in memory: torch's own file writer reports a failed write (a full
    disk) as a RuntimeError without its cause, so the bytes are written by Python, whose OSError
    names it."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer()


def _hide(path: Path) -> Path:
    """Rename a folder to a hidden temporary name in the same place (one atomic step) and return
    it."""
    hidden = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.rename(path, hidden)
    return hidden


def remove_leftovers(out: Path) -> None:
    """Delete what interrupted saves left: hidden temporary folders in checkpoints/, temporary links
    in OUT."""
    root = out / CHECKPOINTS
    hidden = [
        *(root.glob(".*.tmp") if root.is_dir() else []),
        *out.glob(f".{CHECKPOINTS}.*.tmp"),
        *(path for name in PUBLISHED for path in out.glob(f".{name}.*.tmp")),
    ]
    for path in hidden:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def write_checkpoint(out: str | Path, step: int, write: Callable[[ManifestFolder], None]) -> Path:
    """Commit a checkpoint of step `step`: write(files) fills a fresh hidden folder through `files`
    (each file written and fsynced once), the manifest is added last, one rename makes it real; then
    older ones are pruned and the model is linked into OUT."""
    out = Path(out)
    root = out / CHECKPOINTS
    if not root.is_dir():
        root.mkdir(parents=True)
        fsync_dir(out)
    remove_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{checkpoint_name(step)}.", suffix=".tmp", dir=root))
    final = root / checkpoint_name(step)
    try:
        files = ManifestFolder(tmp)
        write(files)
        files.write_manifest({"step": step})
        fsync_dir(tmp)  # the files' names, before the rename that makes them visible
        if final.exists():  # a damaged one a resume skipped, now rewritten
            _hide(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    prune(out, step)
    publish(final, out)
    return final


def prune(out: Path, step: int) -> None:
    """Keep the KEEP newest checkpoints up to `step`; those past it (damaged ones a resume skipped)
    and older ones go, each hidden first, then deleted. A run from before checkpoint folders loses
    its old files."""
    kept = 0
    for other, folder in checkpoint_dirs(out):
        if other <= step and kept < KEEP:
            kept += 1
            continue
        shutil.rmtree(_hide(folder), ignore_errors=True)
    for name in (STATE_FILE, TRAIN_JSON):
        (out / name).unlink(missing_ok=True)


def publish(checkpoint: Path, out: Path) -> None:
    """Link the checkpoint's model files into OUT, each swapped in by one atomic rename."""
    for name in PUBLISHED:
        source = checkpoint / name
        if not source.is_file():
            continue
        tmp = out / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            os.link(source, tmp)
        except OSError:  # a file system without hard links: copy
            shutil.copyfile(source, tmp)
            fsync_file(tmp)
        os.replace(tmp, out / name)
    fsync_dir(out)


def remove_checkpoints(out: Path) -> None:
    """--overwrite: every checkpoint of the old run, its linked model files and old-style state
    go."""
    root = out / CHECKPOINTS
    if root.is_dir():
        shutil.rmtree(_hide(root), ignore_errors=True)
    for name in (STATE_FILE, TRAIN_JSON, *PUBLISHED):
        (out / name).unlink(missing_ok=True)
