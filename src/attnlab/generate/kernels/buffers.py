"""Memory the kernels read and write beside the tensors' own: scratch kept from call to call, and
weights moved into 2 MB pages.

Design choices:
- The weights a decode step streams are moved once into 2 MB pages (`place_in_huge_pages`,
  Linux's transparent huge pages, asked for with madvise), in the order the step reads them:
  fewer TLB misses, and the hardware prefetcher runs on past where a 4 KB page would stop it
  (measured in benchmarks/README.md, issue 14). llama.cpp asks for no huge pages: it reads the
  weights through a plain mmap of the GGUF file or from buffers of posix_memalign, which get
  whatever pages the kernel's transparent-huge-page setting gives.
- A product's scratch of several MB is kept per Python thread (`_kept_scratch`): a fresh one costs
  a page fault per 4 KB at every call, a noticeable part of a prompt's product; the kernels
  release the GIL, so threads never share one.
"""

from __future__ import annotations

import mmap
import threading

import torch

from ... import memory
from ...memory import HUGE_PAGE

# bytes of weights from which `place_in_huge_pages` moves them (smaller ones sit in cache)
HUGE_PAGES_FROM = 4 << 20

_scratch_kept = threading.local()
KEPT_SCRATCH_MAX = 32 << 20  # bytes: a prompt of ~2,000 rows of SmolLM2's widest product


def _kept_scratch(nbytes: int) -> torch.Tensor:
    """A scratch buffer of at least `nbytes`, kept from call to call by this Python thread (the
    kernels release the GIL, so threads never share one): a fresh one of several MB costs a page
    fault per 4 KB at every call, a noticeable part of a prompt's product (SmolLM2's down
    projection; benchmarks/README.md). Larger ones (long prompts, whose products take far longer
    than their page faults) are not kept: no thread holds more than KEPT_SCRATCH_MAX."""
    if nbytes > KEPT_SCRATCH_MAX:
        return torch.empty(nbytes, dtype=torch.int8)
    kept = getattr(_scratch_kept, "buffer", None)
    if kept is None or kept.numel() < nbytes:
        kept = _scratch_kept.buffer = torch.empty(nbytes, dtype=torch.int8)
    return kept


TRIM_EVERY = 256 << 20  # bytes moved between two trims of malloc's heaps


def place_in_huge_pages(tensors: list[torch.Tensor]) -> bool:
    """Move the data of `tensors` into one anonymous mapping advised MADV_HUGEPAGE, one after the
    other in the given order (each 64-byte aligned), so that they are read from 2 MB pages and a
    read running past one runs into the next. Each tensor keeps its identity (its `.data` is
    replaced; values, shape, dtype, requires_grad unchanged), so modules, tied weights and
    optimizers still hold them. True when they are there (moved now or before); False, changing
    nothing, off Linux, for tensors not on the CPU, or below HUGE_PAGES_FROM bytes in all."""
    tensors = list({id(t): t for t in tensors}.values())  # a tied weight once
    if all(getattr(t, "_attnlab_huge_pages", None) == t.data_ptr() for t in tensors):
        return True
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    if (
        not hasattr(mmap, "MADV_HUGEPAGE")
        or sum(sizes) < HUGE_PAGES_FROM
        or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
    ):
        return False
    try:
        arena = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return False
    # the first 2 MB boundary
    offset = -torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    moved = 0  # bytes moved since malloc's heaps were last trimmed
    with torch.no_grad():
        for t, size in zip(tensors, sizes):
            # a storage of its own per tensor (not views of one): safetensors refuses tensors that
            # share one
            placed = torch.frombuffer(arena, dtype=t.dtype, count=t.numel(), offset=offset).view(
                t.shape
            )
            placed.copy_(t)
            t.data = placed
            t._attnlab_huge_pages = t.data_ptr()
            offset += size
            # the tensors' old memory is freed one by one; what malloc keeps of it in its heaps
            # goes back to the kernel as it goes, so the weights are never held twice
            moved += size
            if moved >= TRIM_EVERY:
                memory.trim()
                moved = 0
    memory.trim()
    return True
