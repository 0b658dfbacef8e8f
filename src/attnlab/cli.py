"""The `attnlab` command line: one subcommand per job, each defined next to the code it runs.

Design choices:
- Each module in COMMAND_MODULES has `add_commands(subparsers)`, which adds its subcommands and sets
  `func(args) -> int` on each; this file only dispatches, so a command's flags live beside its code.
- A user's mistake (UserError, a missing file, a full disk) is printed as one line on stderr with
  exit code 2, never a traceback; Ctrl-C exits 130.
- A warning is one line too, `attnlab COMMAND: warning: ...`, in place of Python's format (the file,
  line number, category and the source line that raised it); Python's own display is restored when
  the command ends.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
import warnings

from .errors import UserError
from .version import __version__

COMMAND_MODULES = (
    "attnlab.demo",  # demo
    "attnlab.formats.cli",  # compare, convert
    "attnlab.training.cli",  # train
    "attnlab.generate.sample",  # sample
    "attnlab.generate.chat",  # chat
    "attnlab.inspection.cli",  # heads, experiment, attribute, patch
    "attnlab.explorer.cli",  # explore, export-html
    "attnlab.doctor",  # doctor
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", description="Attention, real, fast and visible."
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # restores warnings.showwarning (and the filters) when the command ends
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warnings(args.command)
        return _run(args)


def one_line_warnings(command: str):
    """A warnings.showwarning that prints `attnlab COMMAND: warning: message` (a message's lines
    joined)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
        try:
            print(f"attnlab {command}: warning: {text}", file=file or sys.stderr)
        except OSError:  # stderr gone (a closed pipe): a warning is not worth a crash
            pass

    return show


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"attnlab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130
    except FileNotFoundError as exc:
        print(
            f"attnlab {args.command}: error: no such file or directory: {exc.filename}",
            file=sys.stderr,
        )
        return 2
    # the file system refused (permissions, a file where a folder should be, ...)
    except OSError as exc:
        # no space, over quota, over the file size limit
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            print(
                f"attnlab {args.command}: error: the disk is full "
                f"({exc.filename or 'while writing'}); "
                "free some space and run again (the last good checkpoint is kept)",
                file=sys.stderr,
            )
        else:
            where = f": {exc.filename}" if exc.filename else ""
            print(
                f"attnlab {args.command}: error: {exc.strerror or exc}{where}; check the path and "
                "its "
                "permissions",
                file=sys.stderr,
            )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
