"""Checks shared by every format's loader: a model file is untrusted input.

Design choices:
- A config whose sizes need more weights than the files can hold is refused before anything is
  allocated (`check_fits`): a config.json claiming d_model = 10^9 must not ask for terabytes first.
- A tensor that is not floating point is refused by name (`check_dtype`): it is not a weight, and
  would be cast silently.
- A NaN or infinite weight is a warning naming it (`warn_non_finite`): a diverged or damaged
  checkpoint still loads, for inspection, but not silently.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..errors import UserError
from ..model.config import ModelConfig


def stored_elements_at_least(config: ModelConfig) -> int:
    """A lower bound on the number of weights a checkpoint of `config` stores: the token embedding,
    each block's W_Q and W_O, and its MLP's two matrices (every format stores at least these)."""
    d, width = config.d_model, config.n_heads * config.d_head
    per_block = 2 * d * width + (0 if config.attn_only else 2 * d * config.d_mlp)
    learned = config.n_ctx * d if config.positional == "learned" else 0
    return config.d_vocab * d + learned + config.n_token_types * d + config.n_layers * per_block


def check_fits(config: ModelConfig, files: list[Path], source: str | Path) -> None:
    """Refuse a config whose weights cannot be in `files` (fewer bytes than half a byte per weight),
    before
    any of them is allocated: a config.json claiming d_model = 10^9 must not ask for terabytes
    first."""
    available = sum(file.stat().st_size for file in files)
    needed = stored_elements_at_least(config)
    if needed > 2 * available:
        raise UserError(
            f"{source}: the config needs at least {needed:,} weights, but the weight files hold "
            f"{available:,} bytes; the config does not match the weights (or claims absurd sizes)"
        )


def check_dtype(key: str, tensor_dtype: torch.dtype | str, source: str | Path) -> None:
    """Weights must be floating point: an integer or boolean tensor is not a weight (and would be
    cast silently)."""
    floating = (
        tensor_dtype.is_floating_point
        if isinstance(tensor_dtype, torch.dtype)
        # safetensors' names: F16, BF16, F32, F8_E4M3, ...
        else str(tensor_dtype).startswith(("F", "BF"))
    )
    if not floating:
        raise UserError(
            f"{source}: weight {key!r} has dtype {tensor_dtype}, not a floating-point type; "
            "the file is not a model checkpoint (or is damaged)"
        )


def warn_non_finite(tensors: dict[str, torch.Tensor], source: str | Path) -> None:
    """A warning naming the first tensor (by its name in the file) holding NaN or infinity: a
    diverged or damaged checkpoint still loads, for inspection, but not silently."""
    bad = [name for name, tensor in tensors.items() if not torch.isfinite(tensor).all()]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        warnings.warn(
            f"{source}: weight {bad[0]!r}{more} holds NaN or infinite values; outputs will be NaN",
            stacklevel=3,
        )
