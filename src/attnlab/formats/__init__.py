"""Loading and saving models: attnlab's native format and Hugging Face-format directories.

`load(path)` and `save(model, path, format=...)` are the two entry points (re-exported as attnlab.load /
attnlab.save). The Hugging Face readers and writers live in attnlab.formats.hf.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .native import is_native, load_native, save_native


def load(path: str | Path, device: str = "cpu"):
    """A model from a directory (attnlab or Hugging Face format), in eval mode, with .config and .tokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such model directory")
    if is_native(path):
        return load_native(path, device=device)
    raise UserError(f"{path}: not an attnlab checkpoint (no config.json with format 'attnlab')")


def save(model, path: str | Path, format: str = "attnlab") -> Path:
    if format == "attnlab":
        return save_native(model, path)
    raise UserError(f"unknown format {format!r}; choose 'attnlab' or 'hf'")
