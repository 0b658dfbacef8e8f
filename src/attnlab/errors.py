"""The one exception type for mistakes a user can make.

Anything raised as `UserError` is printed by the command line as one line (the problem, the values,
the fix) with a non-zero exit and no traceback. Internal invariants use `assert` instead.
"""


class UserError(ValueError):
    """A problem in the user's input, config, data or files, with a message that says how to fix
    it."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for a one-line
    error that quotes what a library said."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
