"""The machine's streaming read bandwidth, measured by the kernels themselves (`read_bandwidth`):
the bound of a decode step, which streams every weight once.

Design choices:
- Measured by the C source's attnlab_read_pass (every thread its part, the build's widest loads,
  integer sums, 2 MB pages; the best of a plain and a prefetching pass), not by a torch
  reduction, which reads slower than the float32 decode step streams (benchmarks/README.md,
  issue 25).
- Every byte read is checked by its sum: a pass the compiler shortened would show.
"""

from __future__ import annotations

import time

import torch

from ...errors import UserError
from . import builds
from .buffers import place_in_huge_pages


def read_bandwidth(megabytes: int = 1024, repeats: int = 7, threads: int | None = None) -> float:
    """The machine's streaming read bandwidth, bytes per second: the best of `repeats` read-only
    passes of each kind (attnlab_read_pass: each thread its own part, the widest vector
    loads; a plain sequential read, and one that also prefetches as the decode products do,
    alternating) over `megabytes` of memory in 2 MB pages, as the decode step's weights are
    (place_in_huge_pages), on `threads` threads (default: torch's). The bound of a decode step,
    which streams every weight once: tokens/s <= this / bytes of weights."""
    lib = builds.library()
    if lib is None:
        raise UserError(
            "the read bandwidth is measured by attnlab's C kernels, which are not built here "
            "(no C compiler, or ATTNLAB_KERNELS=0)"
        )
    threads = threads or torch.get_num_threads()
    nbytes = megabytes * 2**20
    buffer = torch.full((nbytes,), 1, dtype=torch.uint8)
    place_in_huge_pages([buffer])
    assert buffer.data_ptr() % 64 == 0 and nbytes % 1024 == 0
    read = lib.attnlab_read_pass
    best = float("inf")
    for _ in range(repeats):
        for ahead in (0, lib.attnlab_prefetch_ahead()):
            start = time.perf_counter()
            total = read(buffer.data_ptr(), nbytes, threads, ahead)
            best = min(best, time.perf_counter() - start)
            # every byte 1: each 64-bit word 0x0101...01, their sum modulo 2^64 (all were read)
            assert total == nbytes // 8 * 0x0101010101010101 % 2**64, total
    return nbytes / best
