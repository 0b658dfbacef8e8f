"""The kernels' step programs: the C enums a program names (Op, BlockKind, Activation), a kernel
call with its arguments bound (Call), and a list of them run as one C call (Program, `program`).

Design choices:
- A decode step is prepared once, as a list of Calls (the typed wrappers' *_call functions check
  what the C code trusts, once), then run many times: each Call holds its tensors (by address, and
  alive: they must never move) and its plain arguments.
- A run of Calls is one Program: a single C call (attnlab_run) that opens one OpenMP parallel
  region for all of them, instead of one Python call and one region each; a Call marked
  `independent` lets the threads go on without waiting for each other.
- An op's C function is attnlab_ and the op's name in lower case (Op.LINEAR_Q:
  attnlab_linear_q), and its record in a program (OpCall) is laid out by the function's
  parameters in the one table (interface.FUNCTIONS): its integers and pointers in order in `a`,
  its floats in order in `f`.
- Op, BlockKind and Activation hold the C enums' values in their order;
  tests/test_kernel_interface.py compares them with the C source.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from collections.abc import Callable

import torch

from . import builds
from .interface import FUNCTIONS


class Op(enum.IntEnum):
    """The C source's attnlab_op_kind: the kernels a step program can hold, in the same order."""

    LINEAR_F32 = 0
    LINEAR_I8 = 1
    ROPE = 2
    EMBED = 3
    ATTEND = 4
    RMS_NORM = 5
    LAYER_NORM = 6
    ACTIVATE = 7
    SILU_MUL = 8
    SOFTCAP = 9
    LINEAR_Q = 10
    EMBED_Q = 11
    ADD = 12
    MUL = 13
    WINDOW_MASK = 14
    ROUTE = 15
    LINEAR_EXPERTS = 16
    WEIGH_EXPERTS = 17

    @property
    def function(self) -> str:
        """The C function this op calls (its parameters: interface.FUNCTIONS)."""
        return f"attnlab_{self.name.lower()}"


class BlockKind(enum.IntEnum):
    """The C source's attnlab_block_type: the ggml block types attnlab_linear_q multiplies, in the
    same order (attnlab.quant.blocks.BLOCK_TYPES names the same numbers)."""

    Q8_0 = 0
    Q4_0 = 1
    Q4_1 = 2
    Q5_0 = 3
    Q4_K = 4
    Q5_K = 5
    Q6_K = 6


class Activation(enum.IntEnum):
    """The C source's attnlab_activation: the MLP nonlinearities attnlab_activate computes, in the
    same order."""

    GELU = 0
    GELU_TANH = 1
    RELU = 2
    RELU2 = 3


ACTIVATIONS = {
    "gelu": Activation.GELU,
    "gelu_tanh": Activation.GELU_TANH,
    "relu": Activation.RELU,
    "relu2": Activation.RELU2,
}  # ModelConfig.mlp -> attnlab_activate's kind


class OpCall(ctypes.Structure):
    """The C source's attnlab_op: one kernel call of a step program."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("wait", ctypes.c_int64),
        ("a", ctypes.c_int64 * 18),
        ("f", ctypes.c_double * 2),
    ]


class Call:
    """The kernel of op `kind` with its arguments bound: tensors by address (and kept alive by it:
    they must never move), None as NULL. Calling it runs the kernel; a decode step is a list of
    these, prepared once (by the *_call functions below, one per kernel, which check what the C code
    trusts), and `program` runs such a list
    as one. `wait` False: in a program the threads go on without waiting for each other, up to the
    next call that waits; so no call in that stretch, that one included, may read what this one
    writes or write what it reads."""

    def __init__(self, kind: Op, *args) -> None:
        self.kind = kind
        self.values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        # the memory the C code reads and writes
        self.tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.wait = True
        self._run = functools.partial(getattr(builds.library(), kind.function), *self.values)

    def __call__(self) -> None:
        self._run()

    def op(self) -> OpCall:
        """This call as one op of a step program: its arguments in order, the float ones in `f`."""
        op = OpCall(kind=self.kind, wait=int(self.wait))
        parameters = FUNCTIONS[self.kind.function].parameters
        floats = 0
        for i, (value, kind) in enumerate(zip(self.values, parameters, strict=True)):
            if kind is ctypes.c_float:
                op.f[floats] = value
                floats += 1
            else:
                op.a[i] = int(value or 0)
        return op


def independent(call: Call) -> Call:
    """`call`, marked as not needing the threads to wait for each other before the next call (see
    Call)."""
    call.wait = False
    return call


class Program:
    """Calls run as one: a single C call that opens one OpenMP parallel region for all of them
    (attnlab_run), instead of one Python call and one region each."""

    def __init__(self, calls: list[Call], threads: int) -> None:
        # a block product's scratch has one part per thread it was prepared for
        assert all(
            threads <= c.values[-1] for c in calls if c.kind in (Op.LINEAR_Q, Op.LINEAR_EXPERTS)
        )
        self.calls = calls  # which keep their tensors alive
        self.ops = (OpCall * len(calls))(*(call.op() for call in calls))
        self.threads = threads
        self._run = functools.partial(builds.library().attnlab_run, self.ops, len(calls), threads)

    def __call__(self) -> None:
        self._run()

    def generate_greedy(
        self,
        tokens: int,
        logits: torch.Tensor,
        ids: torch.Tensor,
        position: torch.Tensor,
        slot: torch.Tensor,
        key_mask: torch.Tensor | None,
        out: torch.Tensor,
        eos: int | None,
        done: torch.Tensor,
    ) -> int:
        """Greedy generation with no Python between tokens (attnlab_generate_greedy):
        `tokens` times, the argmax of each row of `logits` (rows, vocab) goes to out[:, i] and,
        unless it was the last, into this program's inputs (ids; position and slot one further;
        key_mask's new slot marked), and the program runs, computing the next logits in `logits`.
        A row that made `eos` makes it from then on (done: rows, bool), and generation ends once
        every row has. Returns the number of tokens written. This program must be a whole decode
        step that reads ids, position, slot and key_mask and writes `logits`."""
        rows, vocab = logits.shape
        assert logits.is_contiguous() and out.dtype == ids.dtype == position.dtype == torch.int64
        assert out.shape[0] == rows and out.stride(1) == 1 and 0 <= tokens <= out.shape[1]
        assert ids.numel() == position.numel() == done.numel() == rows and done.dtype == torch.bool
        assert key_mask is None or (key_mask.dtype == torch.bool and key_mask.is_contiguous())
        return builds.library().attnlab_generate_greedy(
            self.ops,
            len(self.calls),
            self.threads,
            tokens,
            logits.data_ptr(),
            rows,
            vocab,
            ids.data_ptr(),
            position.data_ptr(),
            slot.data_ptr(),
            None if key_mask is None else key_mask.data_ptr(),
            0 if key_mask is None else key_mask.shape[1],
            out.data_ptr(),
            out.stride(0),
            -1 if eos is None else eos,
            done.data_ptr(),
        )


def program(steps: list[Callable[[], object]]) -> list[Callable[[], object]]:
    """`steps` with each run of consecutive kernel calls made one Program; other steps (PyTorch
    calls) stay between them, run in order."""
    out, run = [], []
    for step in [*steps, None]:
        if isinstance(step, Call):
            run.append(step)
            continue
        if run:  # (a program's end waits for every thread: what follows may read anything it wrote)
            out.append(Program(run, torch.get_num_threads()))
            run = []
        if step is not None:
            out.append(step)
    return out
