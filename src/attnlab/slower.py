"""One line when attnlab takes a slower path than its usual one, once per reason per process.

Design choices:
- The line names the path taken, the usual one it replaces and why: `{taken}, not {usual}: {why}`
  (no C compiler, a hook that edits, a model the C decode step does not cover, a build without
  float32 tiles, kernels without OpenMP). Where the fallback is decided (generation's decode step,
  a forward pass's layers, the kernels' build), never in the code that only runs it.
- A warning of its own category, `SlowerPath` (a UserWarning), not a log record: Python prints a
  UserWarning on stderr with no set-up, a notebook shows it under its cell, pytest collects it,
  and `warnings.filterwarnings("ignore", category=SlowerPath)` silences exactly these lines; the
  command line prints every warning as `attnlab COMMAND: warning: ...` (attnlab.cli). A log record
  at WARNING would reach stderr only through logging's last-resort handler, and an application
  that configures logging for itself would drop or reformat it.
- Once per line per process, whatever the warnings filters say ("always" included): a fallback is
  decided per call (per token, per forward pass, per layer), while what it says is about the
  machine or the model.
- Python's own display names the first line outside attnlab that led there (the user's
  `model.generate(...)`), not attnlab's internals.
"""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parent)
TORCH_WRAPPER = str(Path("torch", "utils", "_contextlib.py"))  # torch.no_grad's, as a decorator


class SlowerPath(UserWarning):
    """attnlab took a slower path than its usual one; the message says which, instead of what, and
    why."""


_said: set[str] = set()
_lock = threading.Lock()


def say(taken: str, usual: str, why: str) -> None:
    """Warn `{taken}, not {usual}: {why}` (SlowerPath), unless this process has said it before."""
    line = f"{taken}, not {usual}: {why}"
    with _lock:
        if line in _said:
            return
        _said.add(line)
    warnings.warn(line, SlowerPath, stacklevel=_outside_attnlab())


def _outside_attnlab() -> int:
    """The stacklevel, for warnings.warn called in `say`, of the caller of the outermost frame in
    this package, past the wrappers of torch's decorators (torch.no_grad) around it."""
    files, frame = [], sys._getframe(2)  # from say's caller outward
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    inside = [i for i, name in enumerate(files) if name.startswith(PACKAGE)]
    caller = inside[-1] + 1 if inside else 0
    while caller < len(files) - 1 and files[caller].endswith(TORCH_WRAPPER):
        caller += 1
    return min(caller, len(files) - 1) + 2
