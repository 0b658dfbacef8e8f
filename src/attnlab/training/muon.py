"""Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; the
modded-nanogpt speedrun's optimizer for a network's hidden weight matrices): momentum, then each
update orthogonalised by a few Newton-Schulz iterations, with the Newton-Schulz products in a dtype
of the caller's choice.

Design choices:
- The update is torch.optim.Muon's (torch >= 2.9), step for step: the momentum buffer
  B <- mu B + (1 - mu) g (a lerp), Nesterov's g + mu (B - g), the quintic Newton-Schulz iteration
  X <- a X + (b A + c A^2) X with A = X X^T on the update scaled to norm 1 (coefficients
  (3.4445, -4.7750, 2.0315), run on the wide orientation), decoupled weight decay, and the step
  scaled by `adjust_lr_fn` ("original": sqrt(max(1, rows / columns)); "match_rms_adamw":
  0.2 sqrt(max(rows, columns)), Liu et al. 2025, "Muon is Scalable for LLM Training", so that one
  learning rate serves Muon and AdamW). In bfloat16 its steps are torch's bit for bit
  (tests/test_training_muon.py).
- torch's runs the Newton-Schulz products in bfloat16 always: the recipe was tuned on GPUs and on
  CPUs with bfloat16 instructions (AVX-512 BF16, AMX), where they are fast. Without them torch's
  bfloat16 product is tens of times slower than its float32 one, so `ns_dtype` chooses
  (attnlab.training.schedule picks it from attnlab.machine's measurement). float32 computes the
  same iteration with less rounding: the same update up to bfloat16's rounding.
- `ns_dtype` is the optimizer's, not a param group's: it is not in the state dict, so a checkpoint
  holds the same keys as torch.optim.Muon's (either loads the other's), and a run resumed on
  another machine takes that machine's choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024, as torch.optim.Muon's
EPS = 1e-7
ADJUST_LR = (None, "original", "match_rms_adamw")


def orthogonalise(
    update: torch.Tensor,
    steps: int,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on a 2-D `update`, in `dtype`: roughly U S' V^T where
    U S V^T is update's SVD and S' has entries near 1 (Jordan et al. 2024: coefficients that
    maximise the slope at zero, so that few steps suffice). A new tensor of `dtype`."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # [columns, rows]: the Gram matrix X X^T below is the smaller one
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, polynomial, x, beta=a)  # a X + (b A + c A^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate of a matrix of `shape` (module docstring)."""
    rows, columns = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / columns))
    return lr * (0.2 * math.sqrt(max(rows, columns)))  # torch's order of rounding


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters, its Newton-Schulz products in `ns_dtype` (module docstring); the
    other arguments and the param groups' keys are torch.optim.Muon's."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"lr ({lr}), momentum ({momentum}) and weight_decay ({weight_decay}) must be >= 0"
            )
        if adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} is not one of {ADJUST_LR}")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"ns_steps ({ns_steps}) must be between 0 and 99")
        if ns_dtype not in (torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"ns_dtype {ns_dtype} is not bfloat16, float32 or float64")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got one of {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)  # B <- mu B + (1 - mu) g
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalise(
                    update, group["ns_steps"], self.ns_dtype, group["ns_coefficients"], group["eps"]
                )
                p.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
