"""The settings attnlab reads from the environment, read when a command uses them, never at import
(ATTNLAB_KERNELS belongs to attnlab.generate.kernels).

- ATTNLAB_CACHE=DIR: attnlab's cache (default ~/.cache/attnlab): the compiled kernels, the bundled
  models that are joined from parts (`cache_root`).

- ATTNLAB_MAX_STEPS=N: every training run (attnlab train, the demo, the experiments' models) stops
  after at most N optimizer steps, its schedule and snapshots laid out over those N, and evaluates
  on at most N batches.
- ATTNLAB_MAX_NEW_TOKENS=N: `attnlab sample` generates at most N tokens per sample.
- ATTNLAB_PORT=N: the explorer's port where no --port is given (attnlab explore, the demo, the
  induction experiment's --explore); 8000 without it, 0 picks a free one.

The first two make a documented command short without changing its text: the suite runs every
command of the README and the docs that way (tests/test_readme_commands.py). What they shorten
is said on stderr, so a capped run is never taken for a whole one. A value that is not a whole
number is one line naming the variable.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import UserError

DEFAULT_PORT = 8000


def cache_root() -> Path:
    """$ATTNLAB_CACHE, else ~/.cache/attnlab."""
    root = os.environ.get("ATTNLAB_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "attnlab"


def env_int(name: str, minimum: int) -> int | None:
    """The whole number in the environment variable `name` (None when unset or empty)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < minimum:
        raise UserError(f"{name}={text!r}: give a whole number >= {minimum}, or unset it")
    return int(text)


def capped(value: int, name: str, what: str, announce: bool = True) -> int:
    """`value` (a count of `what`), or the cap in the environment variable `name` where that is
    smaller, which is then said on stderr (with `announce`)."""
    cap = env_int(name, 1)
    if cap is None or value <= cap:
        return value
    if announce:
        print(
            f"attnlab: note: {name}={cap} caps {what} at {cap} (of {value})",
            file=sys.stderr,
            flush=True,
        )
    return cap


def explorer_port(port: int | None) -> int:
    """--port as given, else ATTNLAB_PORT, else 8000."""
    if port is not None:
        return port
    from_env = env_int("ATTNLAB_PORT", 0)
    return DEFAULT_PORT if from_env is None else from_env
