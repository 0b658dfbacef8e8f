"""A mixture of experts' ops for a decode step's program, each a typed wrapper of one C function
(c/moe.c): the router's choice (`route_call`), the chosen experts' products (`linear_experts_call`)
and their outputs weighed into the residual stream (`weigh_experts_call`).

Design choices:
- The experts' matrices are read through a table (int64 [n_experts, 3], made here from an
  `ExpertWeight` per expert): the product op that multiplies each (float32, int8 or blocks), its
  weights' address, its scales' address or its block type; the router's choice indexes it at run
  time, so only the chosen experts' weights are read, each by the dense step's product for its
  kind. The Call keeps every expert's tensors alive (they must never move).
- The router's logits come from the ordinary product (the router is a Linear); its softmax is
  written over them in place, so the buffer then holds the router's scores.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import builds
from .products import REPACKABLE, REPACKED, _block_type
from .programs import BlockKind, Call, Op


class ExpertWeight(NamedTuple):
    """One expert's matrix (d_out, d_in) as the decode step multiplies it: float32 weights; int8
    weights with one float32 scale per output feature; or ggml blocks (uint8 (d_out, row bytes)) of
    `kind`, in the 16-row layout where `repacked`."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    kind: BlockKind | None = None
    repacked: bool = False


def route_call(
    scores: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    normalize: bool,
) -> Call:
    """The router's choice for each row, prepared: scores (rows, n_experts) float32 holds the
    router's logits and gets their softmax; weights (rows, k) float32 and chosen (rows, k) int64
    get the k largest scores in descending order (of equal ones, the lowest expert first) and their
    experts; the k weights divided by their sum where `normalize`."""
    rows, n_experts = scores.shape
    k = weights.shape[1]
    assert scores.dtype == weights.dtype == torch.float32 and chosen.dtype == torch.int64
    assert weights.shape == chosen.shape == (rows, k) and 1 <= k <= n_experts
    assert scores.is_contiguous() and weights.is_contiguous() and chosen.is_contiguous()
    return Call(Op.ROUTE, scores, weights, chosen, rows, n_experts, k, int(normalize))


def expert_table(experts: list[ExpertWeight], d_in: int, d_out: int) -> torch.Tensor:
    """The C table of `experts` (int64 [n_experts, 3]: product op, weights' address, scales'
    address or block type | REPACKED), each checked as the dense products check theirs."""
    rows = []
    for e in experts:
        w = e.weight
        assert w.is_contiguous() and w.shape[0] == d_out
        if e.kind is not None:
            t = _block_type(e.kind)
            assert w.dtype == torch.uint8 and d_in % t.weights == 0
            assert tuple(w.shape) == (d_out, t.row_bytes(d_in))
            assert not e.repacked or (e.kind in REPACKABLE and d_out % 16 == 0)
            code = int(BlockKind(e.kind)) | (REPACKED if e.repacked else 0)
            rows.append([int(Op.LINEAR_Q), w.data_ptr(), code])
        elif w.dtype == torch.int8:
            assert e.scale is not None and e.scale.dtype == torch.float32
            assert e.scale.is_contiguous() and e.scale.numel() == d_out and w.shape[1] == d_in
            rows.append([int(Op.LINEAR_I8), w.data_ptr(), e.scale.data_ptr()])
        else:
            assert w.dtype == torch.float32 and w.shape[1] == d_in
            rows.append([int(Op.LINEAR_F32), w.data_ptr(), 0])
    return torch.tensor(rows, dtype=torch.int64)


def linear_experts_call(
    x: torch.Tensor,
    experts: list[ExpertWeight],
    chosen: torch.Tensor,
    out: torch.Tensor,
    x_per_slot: bool = False,
) -> Call:
    """out[r, j] = W^(chosen[r, j]) x_rj, prepared, for each row r and slot j of chosen (rows, k)
    int64 (the router's choice, read at each call: values below len(experts)): x_rj = x[r] (x
    (rows, d_in)) or, `x_per_slot`, x[r, j] (x (rows, k, d_in)); out (rows, k, d_out); float32
    and contiguous."""
    rows, k = chosen.shape
    d_in, d_out = x.shape[-1], out.shape[-1]
    assert chosen.dtype == torch.int64 and chosen.is_contiguous()
    assert x.shape == ((rows, k, d_in) if x_per_slot else (rows, d_in))
    assert out.shape == (rows, k, d_out) and x.is_contiguous() and out.is_contiguous()
    assert x.dtype == out.dtype == torch.float32
    table = expert_table(experts, d_in, d_out)
    threads = torch.get_num_threads()
    per_thread = builds.library().attnlab_linear_q_scratch(1, d_in)
    scratch = torch.empty(threads * per_thread + 64, dtype=torch.int8)
    scratch = scratch[-scratch.data_ptr() % 64 :]  # 64-byte aligned
    call = Call(
        Op.LINEAR_EXPERTS, x, table, chosen, out, scratch, rows, k, d_in, d_out,
        int(x_per_slot), threads,
    )  # fmt: skip
    # the experts' weights, which the table names by address
    call.tensors += [t for e in experts for t in (e.weight, e.scale) if t is not None]
    return call


def weigh_experts_call(
    x: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    accumulate: bool = True,
) -> Call:
    """x += Σ_j weights[:, j] y[:, j] (+ sigmoid(shared_gate) shared), prepared (x = that sum,
    not accumulate): x (rows, d), y (rows, k, d) the experts' outputs, weights (rows, k) their
    router weights, shared (rows, d) the shared expert's output and shared_gate (rows, 1) its
    gate's logit (both or neither); float32, contiguous."""
    rows, d = x.shape
    k = weights.shape[1]
    assert y.shape == (rows, k, d) and weights.shape == (rows, k)
    assert (shared is None) == (shared_gate is None)
    assert shared is None or (shared.shape == (rows, d) and shared_gate.numel() == rows)
    tensors = [t for t in (x, y, weights, shared, shared_gate) if t is not None]
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    return Call(Op.WEIGH_EXPERTS, x, y, weights, shared, shared_gate, rows, k, d, int(accumulate))
