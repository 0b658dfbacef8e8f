"""torch.compile as attnlab calls it: the compiled decode step (attnlab.generate.loop) and the
compiled training step (attnlab.training.trainer).

Design choices:
- Inductor's on-disk FX graph cache (torch 2.13) keys a graph's generated C++ by the graph, the
  inductor config and the torch version, not by the vector instruction set it wrote the code for,
  which ATEN_CPU_CAPABILITY chooses (pytorch/pytorch#123514; avx2 on an AVX-512 machine is how an
  AVX2-only machine is emulated). A later process on the same machine without it gets the cached
  source, written for AVX2's 8 float lanes, and compiles it for AVX-512, whose vectors hold 16:
  each full-vector store writes 8 floats past its chunk, the last past the end of its buffer. The
  heap is corrupted and a later free aborts ("double free or corruption", exit -6; a segmentation
  fault in the compiled training step), or, where the heap's layout hides it, nothing shows. The
  same kind of gap as the thread count's (pytorch/pytorch#167463, keyed since #184444).
- The fix names the vector width in the config inductor hashes: `cpp.simdlen` set to the width of
  the instruction set inductor picks by itself (`pick_vec_isa`, which reads ATEN_CPU_CAPABILITY
  and what the compiler accepts). With simdlen set, inductor takes the first instruction set of
  that width in its own list, the one it picked: the same code, and a cache entry per width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def inductor_options() -> dict[str, int]:
    """The inductor config attnlab compiles with: the vector width inductor picks here, so that its
    FX graph cache keeps code written for one width apart from another's."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": pick_vec_isa().bit_width()}


def compile_function(fn: Callable, backend: str | Callable = "inductor", **kwargs) -> Callable:
    """torch.compile(fn, backend=backend, **kwargs), with `inductor_options()` where the backend is
    inductor (the others, "aot_eager" or a callable, take no options: tests trace with them)."""
    if backend == "inductor":
        kwargs["options"] = {**inductor_options(), **kwargs.get("options", {})}
    return torch.compile(fn, backend=backend, **kwargs)
