"""Files that survive a kill or a power cut: each one written to a temporary name in its own folder,
fsynced, renamed over the old one, and the folder fsynced so that the rename itself is durable.
Readers see the old file or the new one, never half of one. Checkpoints, training metrics,
experiment outputs and exported pages are all written this way.

Design choices:
- A folder that readers may look at while it is written (a model saved by attnlab.save) has each
  of its files swapped in whole (`AtomicFiles`). A training checkpoint's files go instead into a
  hidden folder that no reader sees until one rename commits it whole (`ManifestFolder`, renamed by
  attnlab.training.checkpoint): there each file is written once under its own name and fsynced
  once, and hashed from the bytes written.
- A folder may carry `manifest.json` (every file's size and SHA-256, written last: training
  checkpoints do). Loading verifies it when it is there (`verify_manifest`), so a truncated or
  bit-flipped file is refused with one line naming it instead of loading silently.
- Tensors are written by safetensors (imported when first used); nothing here needs torch itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
# what a manifest says of itself: attnlab's checkpoint format and its version
MANIFEST_FORMAT = {"format": "attnlab", "version": 1}


def fsync_file(path: str | Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (a rename, a new file) durable; a no-op where directories cannot
    be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    # Windows: directories cannot be opened, and renames there are durable by themselves
    except OSError:
        return
    try:
        os.fsync(fd)
    # some file systems refuse fsync on a directory; their renames are as durable as they get
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path), fsync, rename onto `path`, fsync the folder: readers see the old file
    or the new, never a torn one, and the rename survives a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _as_bytes(data: bytes | memoryview | str) -> bytes | memoryview:
    return data.encode("utf-8") if isinstance(data, str) else data


class AtomicFiles:
    """The files of a folder that readers may look at while it is written: each one swapped in whole
    (`atomic_write`); tensors are streamed to the file by safetensors, never held as one more copy
    in memory."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, data: bytes | memoryview | str) -> None:
        atomic_write(self.folder / name, lambda tmp: Path(tmp).write_bytes(_as_bytes(data)))

    def write_tensors(
        self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
    ) -> None:
        from safetensors.torch import save_file

        atomic_write(self.folder / name, lambda tmp: save_file(tensors, tmp, metadata=metadata))


class ManifestFolder:
    """The files of a fresh folder that no reader sees until it is renamed into place (a training
    checkpoint's hidden folder, attnlab.training.checkpoint.write_checkpoint), and its manifest.

    Each file is written once under its own name and fsynced once; its size and SHA-256 come from
    the bytes as they are written, so the manifest reads nothing back. A temporary name and a rename
    per file would add
    nothing here: the folder's own rename is the commit, and the caller fsyncs the folder before it.
    Tensors are serialized in memory first, so that the bytes hashed are the bytes written:
    safetensors' `save` builds its buffer and copies it out, so the peak is about twice the weights'
    bytes, still below train_state.pt's bytes with the optimizer's moments, which a training save
    holds before this."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files: dict[str, dict] = {}

    def write(self, name: str, data: bytes | memoryview | str) -> None:
        data = _as_bytes(data)
        # x: a name written twice is a bug, never an overwrite
        with open(self.folder / name, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {
            "bytes": memoryview(data).nbytes,
            "sha256": hashlib.sha256(data).hexdigest(),
        }

    def write_tensors(
        self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
    ) -> None:
        from safetensors.torch import save

        self.write(name, save(tensors, metadata=metadata))

    def write_manifest(self, extra: dict | None = None) -> None:
        """manifest.json, written last: every file written so far with its size and SHA-256, so a
        folder whose manifest verifies holds exactly what was written."""
        files = dict(sorted(self.files.items()))
        self.write(
            MANIFEST,
            json.dumps({**MANIFEST_FORMAT, **(extra or {}), "files": files}, indent=1) + "\n",
        )


def file_digest(file: str | Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of a file, read in 1 MiB blocks."""
    digest, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


# Folders whose manifest verified in this process, with the (size, mtime, inode) of every file it
# lists then:
# loading a run folder verifies its newest checkpoint to choose it and then loads it, and the second
# check of unchanged files would hash every byte again. Any write to a listed file changes its
# mtime, so it is hashed anew.
_verified: dict[Path, tuple] = {}


def _stamp(path: Path, names) -> tuple:
    stats = [(path / name).stat() for name in names]
    return tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in zip(names, stats))


def verify_manifest(path: str | Path) -> dict | None:
    """Check every file manifest.json lists (size, then SHA-256); None when there is no manifest. A
    file that is missing, of another size or another digest is a UserError naming it. Files
    unchanged since they last verified in this process are not hashed again."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        files = manifest["files"]
        listed = {
            str(name): (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()
        }
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
    ) as exc:
        raise UserError(
            f"{file}: not a readable manifest ({exc!r}); the checkpoint is damaged"
        ) from None
    for name, (size, sha256) in listed.items():
        target = path / name
        if Path(name).name != name or not target.is_file():
            raise UserError(f"{target}: missing, but {file} lists it; the checkpoint is incomplete")
        actual = target.stat().st_size
        if actual != size:
            raise UserError(
                f"{target}: {actual} bytes, but {file} says {size}; the file is truncated or "
                "damaged"
            )
    stamp = _stamp(path, [MANIFEST, *listed])
    if _verified.get(path.resolve()) == stamp:
        return manifest
    for name, (size, sha256) in listed.items():
        target = path / name
        if file_digest(target)["sha256"] != sha256:
            raise UserError(
                f"{target}: its SHA-256 differs from {file}'s; the file is damaged (a flipped bit)"
            )
    _verified[path.resolve()] = stamp
    return manifest
