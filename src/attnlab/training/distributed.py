"""Where a training run computes: the device and dtype it asked for, and the torchrun process group
it joins.

Design choices:
- Under torchrun (RANK/WORLD_SIZE set) the run joins a process group, gloo on CPU and nccl on GPU;
  alone it is one process (`Distributed()`: rank 0 of 1).
- bf16 autocast on GPUs that have it (`--dtype auto`); float32 on CPU: on a CPU without bf16 matrix
  units autocast only adds casts (what it cost on the CPUs measured: benchmarks/README.md, "Training
  speed").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..devices import resolve_device
from ..errors import UserError


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name == "float16" and device.type != "cuda":
        raise UserError(
            "--dtype float16 needs a CUDA GPU (it trains with a gradient scaler); on "
            f"{device.type} use bfloat16 or float32"
        )
    return getattr(torch, name)


@dataclass
class Distributed:
    rank: int = 0
    local_rank: int = 0
    world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_name: str) -> tuple[Distributed, torch.device]:
    """Join the torchrun process group if there is one (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Distributed(), resolve_device(device_name)
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo", **_restart_store(world)
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Distributed(dist.get_rank(), local_rank, dist.get_world_size()), device


def _restart_store(world: int) -> dict[str, Any]:
    """Under torchrun --max-restarts, the store of each start's process group, kept apart from the
    others'.

    torchrun shares its rendezvous store with the workers (TORCHELASTIC_USE_AGENT_STORE) and torch
    builds the process group on it without a per-start prefix, so a restarted gloo group can read a
    dead worker's address and fail to connect (pytorch/pytorch#135712; here two runs of three starts
    each lost a start so). Prefixing the keys with the restart count keeps each start's group to
    itself. Elsewhere torch's own env:// set-up is used."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart == "0":
        return {}
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(minutes=10),
    )
    return {
        "store": dist.PrefixStore(f"attnlab/start_{restart}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": world,
    }
