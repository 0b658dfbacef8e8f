"""The static KV cache of generation (after gpt-fast): one preallocated buffer per layer for keys
and values, written in place, so that a decode step allocates nothing that grows with the sequence.
The buffer length is rounded up to a multiple of CACHE_ROUND so that nearby lengths share one
compiled decode step.
"""

from __future__ import annotations

import torch

from ..errors import UserError

# cache lengths are rounded up to this, so nearby lengths share a compiled decode step
CACHE_ROUND = 64


def buffer_length(positions: int) -> int:
    """The length generation allocates for `positions` (prompt + new tokens): rounded up to a
    multiple of CACHE_ROUND."""
    return -(-positions // CACHE_ROUND) * CACHE_ROUND


def bytes_per_position(model) -> int:
    """What one position costs the cache: a key and a value per layer and kv head, in the model's
    dtype."""
    cfg = model.config
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_head * model.dtype.itemsize


class KVCache:
    """Keys and values of every layer for positions [0, max_len): k[layer], v[layer] of shape
    [batch, kv_head, pos, d_head].

    One tensor per layer, not one [layer, ...] tensor: a compiled step then writes each layer's own
    tensor in place, where writing a view of a shared tensor would make it copy the whole buffer.
    `values_position_minor` (the compiled decode step's layout) stores the values as [batch,
    kv_head, d_head, pos] and hands them out transposed (same shape as the keys, other strides): a
    single query's weighted sum of the values then reads each value dimension's positions
    contiguously, a loop inductor vectorises; stored position-major, it walked the positions 64
    floats apart, one dependent add at a time (benchmarks/README.md, "Generation speed"). Eager
    kernels want them position-major.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        values_position_minor: bool = False,
    ) -> None:
        shape = (batch, n_kv_heads, max_len, d_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        if values_position_minor:
            self.v = [
                torch.zeros(
                    batch, n_kv_heads, d_head, max_len, dtype=dtype, device=device
                ).transpose(-2, -1)
                for _ in range(n_layers)
            ]
        else:
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len

    @classmethod
    def for_model(
        cls, model, batch: int, max_len: int, values_position_minor: bool = False
    ) -> "KVCache":
        cfg = model.config
        return cls(
            cfg.n_layers,
            batch,
            cfg.n_kv_heads,
            max_len,
            cfg.d_head,
            model.dtype,
            model.device,
            values_position_minor,
        )

    whole_buffer = False  # hands back the keys/values of positions [0, start+T) only

    def update(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [batch, kv_head, T, d_head] at positions start..start+T; return the
        keys/values of positions [0, start+T) (from 0: the tensors given, which hold exactly those,
        contiguous whatever the cache's layout)."""
        end = start + k.shape[-2]
        if end > self.max_len:
            raise UserError(
                f"the KV cache holds {self.max_len} positions but generation reached {end}; raise "
                "max_len"
            )
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        if start == 0:
            return k, v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def at_slot(self, slot: torch.Tensor) -> "SlotView":
        """This cache as the compiled decode step writes it: at the cache slot held by the (1,)
        tensor `slot`."""
        return SlotView(self, slot)


class SlotView:
    """A KVCache seen by the compiled decode step: `update` writes the one new key and value at
    `slot` (a (1,) tensor, so that the graph does not specialise on it) and hands back the whole
    buffer, whose shape never changes. The query then sits at its slot, not last: the caller's key
    mask hides the slots not yet written and holds a sliding window (attention applies no window of
    its own to a whole buffer)."""

    whole_buffer = True

    def __init__(self, cache: KVCache, slot: torch.Tensor) -> None:
        self.cache, self.slot, self.max_len = cache, slot, cache.max_len

    def update(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.k[layer][:, :, self.slot] = k
        self.cache.v[layer][:, :, self.slot] = v
        return self.cache.k[layer], self.cache.v[layer]
