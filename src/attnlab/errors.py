"""The one exception type for mistakes a user can make.

Anything raised as `UserError` is printed by the command line as one line (the problem, the values, the
fix) with a non-zero exit and no traceback. Internal invariants use `assert` instead.
"""


class UserError(ValueError):
    """A problem in the user's input, config, data or files, with a message that says how to fix it."""
