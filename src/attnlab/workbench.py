"""The Transformer you hold: the plain model (attnlab.model) with the code that runs it fast.

    model = attnlab.Transformer(config)          # this module's Transformer
    model = attnlab.load("smollm2")              # the same class, loaded
    model.generate(ids, 20)                      # attnlab.generate.loop.generate
    logits, cache = model.run_with_cache(ids)    # within the C kernels' layers

Design choices:
- attnlab.model's Transformer is the chapter's model and nothing else: its forward runs its own
  modules, and it imports nothing of generation. This subclass adds methods only, no state: the
  fast paths stay out of the model, and the model stays below generation in the import graph.
- `run_with_hooks` (which `run_with_cache` calls) runs its pass within the fast layers
  (attnlab.generate.fast_layers.inference_layers: a pass without gradients over many float32 rows
  on the CPU gets RoPE, RMSNorm, SwiGLU, attention and the products in C), entered with the hooks
  already attached, as the interpretability work wants it fast. A plain `model(ids)` is the model's
  own modules, with or without gradients.
- `load` is attnlab.formats' load, the model's class then swapped to this one (`model.__class__`,
  the project's class-swap idiom, as the fast layers are swapped in): the formats build the plain
  model and import neither this module nor generation.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .generate import fast_layers
from .generate.loop import generate as generate_tokens
from .lens.hooks import HookFn
from .model import transformer


class Transformer(transformer.Transformer):
    """attnlab.model.transformer.Transformer, with `generate` and a `run_with_hooks` (so a
    `run_with_cache`) in the C kernels' layers."""

    def generate(self, ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        """Prompt followed by new tokens (B, T + new), decoded with a KV cache; see
        attnlab.generate.loop.generate."""
        return generate_tokens(self, ids, max_new_tokens, **kwargs)

    def run_with_hooks(
        self, *args: Any, fwd_hooks: Iterable[tuple[str, HookFn]] = (), **kwargs: Any
    ) -> Any:
        """The forward pass with `fwd_hooks` attached (removed afterwards, even on error), within
        the fast layers (`inference_layers`, decided with the hooks attached)."""
        ids = args[0] if args else kwargs.get("ids")
        start = kwargs.get("start_at_layer")
        with self.hooks(fwd_hooks), fast_layers.inference_layers(self, ids, start):
            return self(*args, **kwargs)


def workbench(model: transformer.Transformer) -> Transformer:
    """`model` as this module's Transformer (its class swapped in place; the same modules)."""
    if not isinstance(model, Transformer):
        model.__class__ = Transformer
    return model


def load(
    path: str | Path,
    device: str = "cpu",
    revision: str | None = None,
    file: str | None = None,
    keep_blocks: bool | None = None,
) -> Transformer:
    """attnlab.formats.load (its parameters are described there), the model as this module's
    Transformer: `attnlab.load("smollm2")`."""
    from .formats import load as load_plain

    return workbench(
        load_plain(path, device=device, revision=revision, file=file, keep_blocks=keep_blocks)
    )
