"""Interventions: hook functions that knock out a head or patch in an activation from another run.

Design choices:
- Each helper returns a `(hook_name, fn)` pair ready for `model.run_with_hooks(ids,
  fwd_hooks=[...])`, as in TransformerLens; `fn(activation, hook)` returns a new tensor and never
  writes into the one it is given (another hook, or a cache, may hold it).
- A head is ablated at `blocks.{layer}.attn.hook_z` [batch, pos, head, d_head], the head's output
  before W_O mixes the heads, so one head is removed and nothing else changes. "zero" sets it to 0;
  "mean" replaces it by its mean, either given (e.g. over a reference batch, see `mean_z`) or over
  this run's batch and positions.
- `patch` copies an activation, or the part of it that `index` selects (an index into the full
  tensor, batch dim included), from a source run's cache into this run: activation patching.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UserError
from ..generate.fast_layers import inference_layers

ABLATIONS = ("zero", "mean")


def ablate_head(layer: int, head: int, mode: str = "zero", mean: torch.Tensor | None = None):
    """(name, fn) that ablates one head's output z. mean: [head, d_head] or [pos, head, d_head] for
    mode="mean"."""
    if mode not in ABLATIONS:
        raise UserError(f"ablation mode must be one of {', '.join(ABLATIONS)}; got {mode!r}")

    def fn(z: torch.Tensor, hook) -> torch.Tensor:  # z: [batch, pos, head, d_head]
        if not 0 <= head < z.shape[2]:
            raise UserError(
                f"head {head} does not exist at {hook.name}; heads are 0..{z.shape[2] - 1}"
            )
        z = z.clone()
        if mode == "zero":
            z[:, :, head] = 0.0
        elif mean is not None:
            m = mean[..., head, :].to(z.dtype)  # [d_head] or [pos, d_head]
            z[:, :, head] = m[: z.shape[1]] if m.dim() == 2 else m
        else:
            z[:, :, head] = z[:, :, head].mean(dim=(0, 1))
        return z

    return f"blocks.{layer}.attn.hook_z", fn


def mean_z(
    model, ids: torch.Tensor, layer: int, per_position: bool = False, **forward_kwargs: Any
) -> torch.Tensor:
    """Mean of `blocks.{layer}.attn.hook_z` over a reference batch: [head, d_head], or [pos, head,
    d_head]."""
    name = f"blocks.{layer}.attn.hook_z"
    start = forward_kwargs.get("start_at_layer")
    with torch.no_grad(), inference_layers(model, ids, start):
        _, cache = model.run_with_cache(ids, names_filter=name, **forward_kwargs)
    z = cache[name]  # [batch, pos, head, d_head]
    return z.mean(0) if per_position else z.mean((0, 1))


def patch(name: str, source: torch.Tensor | dict, index: Any = None):
    """(name, fn) that replaces the activation at `name` by `source` (a tensor, or a cache holding
    `name`).

    index: what to replace, e.g. `(slice(None), 5)` for position 5 of a [batch, pos, ...]
    activation, or `(slice(None), slice(None), 3)` for head 3 of hook_z; None replaces all of it.
    """
    value = source[name] if isinstance(source, dict) else source

    def fn(activation: torch.Tensor, hook) -> torch.Tensor:
        if value.shape != activation.shape:
            raise UserError(
                f"cannot patch {hook.name}: the source has shape {tuple(value.shape)} but this "
                "run has "
                f"{tuple(activation.shape)}; run both on inputs of the same shape"
            )
        if index is None:
            return value.to(activation.dtype).clone()
        out = activation.clone()
        out[index] = value[index].to(activation.dtype)
        return out

    return name, fn
