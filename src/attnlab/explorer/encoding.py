"""Numbers shaped for the page: matrices as JSON lists, base64 float32 or scaled float16
(service.py's design notes say why), and non-finite values as null."""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

F16_MAX = 65504.0  # float16's largest finite value
F16_TINY = 2.0**-14  # float16's smallest normal value: below it, fewer significant bits


def encode_matrix(tensor: torch.Tensor, encoding: str, lower: bool = False) -> Any:
    """A tensor as nested lists ("json"), as {"shape", "f32": base64 of little-endian float32}
    ("f32"), or as {"shape", "f16": base64 of little-endian float16, "scale", "tiny", "lower"}
    ("f16"): the numbers are f16 × scale, exact to float16's precision down to `tiny`. lower (a
    square matrix, "f16" only): only the lower triangle travels, row by row, the diagonal included
    (a causal pattern is zero above it)."""
    tensor = tensor.detach().float().cpu().contiguous()
    if encoding == "f32":
        data = tensor.numpy().astype("<f4").tobytes()
        return {"shape": list(tensor.shape), "f32": base64.b64encode(data).decode("ascii")}
    if encoding == "f16":
        top = float(tensor.abs().amax()) if tensor.numel() else 0.0
        # −∞ or NaN somewhere: the largest finite value (rare; a boolean gather is slow)
        if not math.isfinite(top):
            top = float(torch.nan_to_num(tensor.abs(), nan=0.0, posinf=0.0).amax())
        # the largest power of two that keeps the largest value finite in float16 (bounded: 2^±100
        # is a float32)
        exponent = max(-100, min(100, math.floor(math.log2(F16_MAX / top)))) if top > 0 else 0
        # the lower triangle row by row: T slices beat a gather by T(T+1)/2 indices
        values = (
            torch.cat([row[: i + 1] for i, row in enumerate(tensor)]) if lower else tensor.flatten()
        )
        data = (values * 2.0**exponent).to(torch.float16).numpy().astype("<f2").tobytes()
        return {
            "shape": list(tensor.shape),
            "f16": base64.b64encode(data).decode("ascii"),
            "lower": lower,
            "scale": 2.0**-exponent,
            "tiny": F16_TINY * 2.0**-exponent,
        }
    return finite(tensor.tolist())


def finite(values: Any) -> Any:
    """JSON has no infinities: masked scores (−∞) travel as None, which the page draws as masked."""
    if isinstance(values, list):
        return [finite(v) for v in values]
    return None if isinstance(values, float) and not math.isfinite(values) else values
