"""The learning-rate schedule and the optimizers of a training run.

Design choices:
- nanoGPT's recipe: AdamW with weight decay on matrices and embeddings only (dim >= 2; never on
  biases or norm gains), linear warmup then cosine decay to min_lr (`learning_rate_at`), or wsd
  (warmup, stable, decay). AdamW runs fused (one kernel for all parameters) where torch has it, else
  foreach.
- --optimizer muon: Muon for the blocks' weight matrices and AdamW for the rest (the modded-nanogpt
  speedrun). attnlab's Muon (attnlab.training.muon) is torch.optim.Muon's update with the dtype of
  its Newton-Schulz products a choice: bfloat16 where torch's bfloat16 products are at least as
  fast as its float32 ones on this machine (attnlab.machine.bfloat16_products, measured once per
  machine), else float32 (`newton_schulz_dtype`; --muon-dtype forces one). The choice is one line
  of the run's output and of its report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import machine
from .config import TrainConfig
from .muon import Muon


def learning_rate_at(it: int, cfg: TrainConfig, elapsed_s: float = 0.0) -> float:
    """Linear warmup over warmup_iters, then, as the run goes from 0 to 1 of its decay, cosine decay
    from learning_rate to min_lr, or wsd: flat at learning_rate, then a straight line down to min_lr
    over the last
    cooldown_fraction (Hägele et al. 2024; the modded-nanogpt speedrun's schedule). The run's
    progress is counted in steps after warm-up up to decay_iters; with --max-time it is the larger
    of that and the share of the time budget spent, so a run ends fully decayed whichever limit it
    reaches first."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    progress = (it - cfg.warmup_iters) / max(1, cfg.decay_iters - cfg.warmup_iters)
    if cfg.max_time is not None:
        progress = max(progress, elapsed_s / cfg.max_time)
    progress = min(progress, 1.0)
    if cfg.schedule == "wsd":
        stable = 1.0 - cfg.cooldown_fraction
        down = 0.0 if progress <= stable else (progress - stable) / cfg.cooldown_fraction
        return cfg.learning_rate + down * (cfg.min_lr - cfg.learning_rate)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        cfg.learning_rate - cfg.min_lr
    )


class Optimizers:
    """Several optimizers stepped as one: Muon for the blocks' weight matrices and AdamW for the
    rest. It has the parts of torch.optim.Optimizer the loop uses (param_groups, step, zero_grad,
    state_dict)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)


@dataclass(frozen=True)
class NewtonSchulzChoice:
    """The dtype of Muon's Newton-Schulz products and why (`newton_schulz_dtype`)."""

    dtype: torch.dtype
    why: str  # what decided it: the measured rates, or the flag
    rates: dict[str, Any] | None = None  # attnlab.machine.bfloat16_products's, when measured

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def line(self) -> str:
        """The one line a training run prints."""
        return f"attnlab: Muon's Newton-Schulz runs in {self.name}: {self.why}"


def newton_schulz_dtype(cfg: TrainConfig, device: torch.device) -> NewtonSchulzChoice:
    """--muon-dtype bfloat16 or float32 as given; auto: bfloat16 where torch's bfloat16 products
    are at least as fast as its float32 ones on `device` here (attnlab.machine, measured once per
    machine and cached), else float32."""
    if cfg.muon_dtype != "auto":
        return NewtonSchulzChoice(getattr(torch, cfg.muon_dtype), f"--muon-dtype {cfg.muon_dtype}")
    rates = machine.bfloat16_products(device).values
    fast = machine.bfloat16_is_fast(rates)
    where = "here" if device.type == "cpu" else f"on {device.type}"
    why = (
        f"torch's bfloat16 products run at {rates['bfloat16_gflops']:,.1f} GFLOP/s {where} "
        f"against float32's {rates['float32_gflops']:,.1f} ({rates['size']} x {rates['size']}, "
        f"{machine.threads_phrase()}; measured once, kept in attnlab's cache)"
    )
    return NewtonSchulzChoice(torch.bfloat16 if fast else torch.float32, why, rates)


def make_optimizer(
    model: torch.nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    newton_schulz: NewtonSchulzChoice | None = None,
) -> torch.optim.Optimizer | Optimizers:
    """AdamW with weight decay on matrices and embeddings (dim >= 2) only; fused where this torch
    has it.

    --optimizer muon: Muon (attnlab.training.muon; Jordan et al. 2024: momentum, orthogonalised by
    Newton-Schulz) for the blocks' weight matrices, AdamW for embeddings, head, norms and biases, as
    the modded-nanogpt speedrun does. Muon's step is scaled to AdamW's size (`match_rms_adamw`, Liu
    et al. 2025), so one --learning-rate serves both. Its Newton-Schulz dtype is `newton_schulz`'s,
    else `newton_schulz_dtype`'s choice."""
    params = [p for p in model.parameters() if p.requires_grad]
    muon = []
    if cfg.optimizer == "muon":
        block_matrices = {
            id(p) for block in model.blocks for p in block.parameters() if p.dim() == 2
        }
        muon = [p for p in params if id(p) in block_matrices]
        params = [p for p in params if id(p) not in block_matrices]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")  # torch >= 2.4 has fused AdamW on both
    adamw = torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused
    )
    if not muon:
        return adamw
    if newton_schulz is None:
        newton_schulz = newton_schulz_dtype(cfg, device)
    return Optimizers(
        Muon(
            muon,
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn="match_rms_adamw",
            ns_dtype=newton_schulz.dtype,
        ),
        adamw,
    )
