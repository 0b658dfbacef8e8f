"""How a model's weights are stored: `quantize(model, scheme)` (attnlab.quantize) swaps its Linear
modules for int8 or ggml-block ones for good; `store_weights_as` keeps its float weights in a
narrower dtype.

Design choices:
- Weight-only: activations, norms and embeddings keep their dtype; only the Linear weights, which
  a decode step reads from memory at every token, shrink.
- `quantize` is for good: the model remembers its scheme (`model.quantization`) and is saved that
  way (attnlab.save); quantizing it again to another scheme is refused (rounding rounded weights
  loses more), and every row is checked to divide into blocks before any module changes.
- Both find the Linear modules as nn.Linear, so this room needs nothing of the model: in attnlab's
  models each is the model's Linear (attnlab.model.layers), which widens a weight that
  `store_weights_as` stored narrower to the activations' dtype where it is used.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError
from .blocks import BLOCK, QUANTIZABLE, BlockLinear
from .int8 import Int8Linear

QUANTIZATIONS = ("int8", *QUANTIZABLE)


def quantize(model: nn.Module, scheme: str = "int8") -> nn.Module:
    """Store every Linear's weight in fewer bits, in place, for inference (weight-only: activations,
    norms, embeddings stay as they are): "int8" (Int8Linear), or ggml's blocks "q8_0", "q4_0",
    "q4_1" (attnlab.quant.blocks.BlockLinear, the bytes llama-quantize would write). A tied LM
    head gets its own copy; the token embedding it shares keeps its dtype, since a lookup reads one
    row. The model remembers it (`model.quantization`), so attnlab.save writes it that way."""
    if scheme not in QUANTIZATIONS:
        raise UserError(
            f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    current = getattr(model, "quantization", None)
    if current == scheme:
        return model
    if current is not None:
        raise UserError(
            f"this model is already quantized ({current}); quantize its float original to "
            f"{scheme} instead (rounding rounded weights again loses more)"
        )
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if scheme in QUANTIZABLE:  # every row must divide into blocks, checked before any change
        for parent, name, child in linears:
            if child.in_features % BLOCK:
                raise UserError(
                    f"{scheme}: a Linear ({name}) takes {child.in_features} inputs, not a multiple "
                    f"of the block size {BLOCK}; use int8 for this model"
                )
    for parent, name, child in linears:
        if scheme == "int8":
            setattr(parent, name, Int8Linear.from_float(child.weight, child.bias))
        else:
            setattr(parent, name, BlockLinear.from_float(child.weight, scheme, child.bias))
    model.quantization = scheme
    return model


def store_weights_as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store every Linear's weight matrix in `dtype` (bfloat16: half the bytes a decode step reads),
    in place, for inference; activations, norms, embeddings and biases keep their dtype, so only the
    weights are rounded. A weight shared with an embedding (a tied LM head) is left as it is, so the
    residual stream keeps its dtype."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in embedding_weights:
            module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
    return model
