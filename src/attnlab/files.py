"""Files that survive a kill or a power cut: each one written to a temporary name in its own folder,
fsynced, renamed over the old one, and the folder fsynced so that the rename itself is durable.
Readers see the old file or the new one, never half of one. Checkpoints, training metrics,
experiment outputs and exported pages are all written this way.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


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
