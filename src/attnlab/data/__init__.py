"""The built-in corpus: text that needs no download and ships with every Python.

Design choices:
- The text is Python's own reference documentation as bundled for `help()` in the standard library
  module `pydoc_data.topics` (about 465 000 characters in Python 3.11: the language reference's
  sections on statements, expressions, the data model, and so on). It is English prose mixed with
  code, large enough to train a small model on in minutes and different enough from Shakespeare to
  be a fair test.
- It is assembled at run time (topics in sorted order, separated by blank lines), so nothing is
  stored in the repository and nothing depends on ../shared.
"""

from __future__ import annotations

BUILTIN_NAME = "Python's bundled documentation (pydoc_data.topics)"


def builtin_corpus() -> str:
    """The built-in training text: every topic of Python's bundled `help()` documentation."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics)) + "\n"
