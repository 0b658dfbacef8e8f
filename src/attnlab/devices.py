"""The device a command runs on, from its --device flag: auto (CUDA, then MPS, then the CPU), cpu,
cuda, cuda:N or mps."""

from __future__ import annotations

import torch

from .errors import UserError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(
            f"--device {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"--device {name}: this machine has no CUDA GPU (or torch was built without CUDA); "
            "use --device cpu"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device
