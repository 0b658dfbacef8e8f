"""attnlab's version, the one place it is written (pyproject.toml reads it; `attnlab --version`
prints it)."""

__version__ = "0.1.0"
