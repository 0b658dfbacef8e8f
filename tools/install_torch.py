"""Install torch into the Python that runs this script (`make venv` runs it with .venv's python).

    python tools/install_torch.py [--torch SPEC] [--print] [--ignore-installed]

The choice, the first that applies:
1. --torch SPEC (the Makefile's TORCH=SPEC): that requirement, as written.
2. A torch already installed in this Python, at least the version pyproject.toml asks for: kept
   (a user's CPU or CUDA build, or what an earlier `make venv` installed). Nothing is installed.
3. The CPU build LOCAL (below), when pip as configured here can see it: a local wheel folder or
   index (pip's find-links, extra-index-url), as on a machine without internet. Asked of pip's own
   resolver (`pip install --dry-run --no-deps`), so every pip setting counts (config files, PIP_*).
4. Otherwise the same version from PyTorch's index of CPU wheels, PYTORCH_CPU_INDEX: the public
   index has no "+cpu" builds, and a plain `pip install torch` would fetch the CUDA build (GBs).

--print prints the choice and the pip command it would run, and installs nothing.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

LOCAL = "torch==2.13.0+cpu"  # the build the test suite runs on (README, "Install")
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
PIP = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]


def lower_bound() -> tuple[int, ...]:
    """The oldest torch attnlab accepts: pyproject.toml's `torch>=X.Y`."""
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (spec,) = [d for d in dependencies if re.match(r"torch\s*>=", d)]
    return release(spec.split(">=")[1])


def release(version: str) -> tuple[int, ...]:
    """ "2.13.0+cpu" -> (2, 13, 0): the release numbers, before any pre-release or local label."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def installed_torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def pip_sees(requirement: str) -> bool:
    """Whether pip, configured as it is, finds `requirement` (resolved only: nothing is installed,
    only index pages and the wheel's metadata are read)."""
    probe = [*PIP, "--dry-run", "--no-deps", "--ignore-installed", requirement]
    return subprocess.run(probe, capture_output=True, text=True).returncode == 0


def choose(override: str | None, ignore_installed: bool = False) -> tuple[list[str] | None, str]:
    """(the pip command to run, or None to keep the installed torch; why)."""
    if override:
        return [*PIP, override], f"TORCH={override}"
    version = None if ignore_installed else installed_torch()
    if version is not None and release(version) >= lower_bound():
        return None, f"keeping the installed torch {version}"
    older = f"torch {version} is older than pyproject.toml allows; " if version else ""
    if pip_sees(LOCAL):
        return [*PIP, LOCAL], older + f"pip can see {LOCAL} (a local wheel)"
    same_version = LOCAL.split("+")[0]
    return (
        [*PIP, "--index-url", PYTORCH_CPU_INDEX, same_version],
        older + f"pip cannot see {LOCAL} here: the CPU build from PyTorch's index",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", default=None, metavar="SPEC", help="install this requirement")
    parser.add_argument(
        "--print", action="store_true", help="print the choice and its command; install nothing"
    )
    parser.add_argument(
        "--ignore-installed",
        action="store_true",
        help="choose as for a Python without torch (what a fresh .venv gets)",
    )
    args = parser.parse_args(argv)
    command, why = choose(args.torch, args.ignore_installed)
    print(f"torch: {why}" + (f"\n{shlex.join(command)}" if command else ""), flush=True)
    if command is None or args.print:
        return 0
    return subprocess.run(command).returncode


if __name__ == "__main__":
    raise SystemExit(main())
