"""The memory large activations are written into: a cache's tensors on pages attnlab keeps for the
next `run_with_cache`, and large fresh outputs in 2 MB pages.

Why: a cache is large (SmolLM2-135M's, 4 x 256 tokens, every hook: 1.6 GiB), and every tensor in
it is new memory. glibc's malloc gives a large block a mapping of its own and unmaps it when it is
freed (or trims the top of its heap), so the next call faults each 4 KiB page in again and the
kernel zeroes it: ~500,000 page faults a call, a time of the order of the forward pass and the
cache's writes themselves (benchmarks/README.md, "run_with_cache and the memory it writes into").

Design choices:
- `recycled()` (what run_with_cache runs its forward pass in) makes `new_tensor` take blocks of
  anonymous memory from a pool. A block comes back to the pool when the last tensor on it is freed
  (its NumPy array's finalizer: torch.from_numpy's storage holds the array), and the next tensor
  of that size is written into its pages, already there. So a loop of run_with_cache calls, each
  cache dropped for the next, stops faulting after its second call. This is PyTorch's CUDA caching
  allocator's idea, for the CPU tensors of one kind of call; malloc's settings are left alone, so
  nothing else in the process (TransformerLens in a benchmark beside it) changes.
- Only the C kernels' outputs take blocks (products, norms, attention's steps, RoPE, SwiGLU: all
  of a cache but what torch's own ops make, the residual sums and the embeddings), and only from
  SMALLEST bytes (malloc keeps smaller blocks in its heap itself).
- The pool keeps at most as many bytes as one recorded call took (one cache), never more;
  `release()` hands them back now. A block the kernel refuses (vm.max_map_count reached: every
  block is one mapping) is torch.empty's instead.
- Outside `recycled()`, `new_tensor` is torch.empty, whose inside is advised MADV_HUGEPAGE from
  FRESH_HUGE_FROM bytes (a forward pass's logits: 200 MB for SmolLM2 at 4 x 256 tokens): in 2 MB
  pages that is ~100 page faults instead of ~50,000. Blocks from SMALLEST up to it are left to
  malloc, which reuses them while their size is below its own threshold.
- `available()` is what a load may still allocate before the kernel's out-of-memory killer acts:
  the smaller of the machine's MemAvailable (/proc/meminfo: free memory plus the page cache it
  could drop) and the room left under this process's cgroup limit (v2 memory.max less
  memory.current, v1 memory.limit_in_bytes less memory.usage_in_bytes), with the source named, so
  that a refusal can say where its figure came from. Off Linux it is None (nothing to check
  against, and nothing is refused).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20
SMALLEST = 256 << 10  # bytes from which a recorded output takes a block of the pool
# outputs from which `new_tensor` asks for 2 MB pages outside `recycled()`: glibc's malloc maps
# blocks this large (its M_MMAP_THRESHOLD is at most 32 MiB) in a mapping of their own
FRESH_HUGE_FROM = 32 << 20
MADV_HUGEPAGE = 14  # linux/mman.h (Python's mmap module advises only mappings it made)
PAGE = mmap.PAGESIZE


class BlockPool:
    """Blocks of anonymous memory by size, each an mmap, kept for reuse (module docstring)."""

    def __init__(self) -> None:
        self.free: dict[int, list[mmap.mmap]] = {}
        self.kept = 0  # bytes in `free`
        self.taken = 0  # bytes taken during the recorded call now running
        self.most = 0  # the most bytes one recorded call took: what `free` may hold
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[mmap.mmap, int] | None:
        """A block of at least nbytes (a kept one of its size, else a new mapping) and its size;
        None where the kernel refuses a new mapping."""
        size = -(-nbytes // PAGE) * PAGE
        with self.lock:
            self.taken += size
            blocks = self.free.get(size)
            if blocks:
                self.kept -= size
                return blocks.pop(), size
        try:
            block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            return None
        if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                block.madvise(mmap.MADV_HUGEPAGE)
        return block, size

    def give_back(self, block: mmap.mmap, size: int) -> None:
        """Keep a block whose last tensor was freed, while the pool holds less than `most`; else
        let it go (unmapped once nothing refers to it)."""
        with self.lock:
            if self.kept + size <= self.most:
                self.free.setdefault(size, []).append(block)
                self.kept += size

    def release(self) -> int:
        """Let every kept block go; returns the bytes released."""
        with self.lock:
            released, self.free, self.kept = self.kept, {}, 0
        return released


POOL = BlockPool()
_recording: ContextVar[bool] = ContextVar("attnlab_recycled", default=False)


@contextlib.contextmanager
def recycled() -> Iterator[None]:
    """Within: `new_tensor` takes blocks of POOL (module docstring). Nested, the outer call counts
    the bytes."""
    if _recording.get() or not hasattr(mmap, "MAP_ANONYMOUS"):
        yield
        return
    token = _recording.set(True)
    with POOL.lock:
        POOL.taken = 0
    try:
        yield
    finally:
        _recording.reset(token)
        with POOL.lock:
            POOL.most = max(POOL.most, POOL.taken)


def fresh(nbytes: int) -> bool:
    """Whether `new_tensor` now puts an output of nbytes on a block of POOL (within `recycled()`,
    from SMALLEST bytes: a run_with_cache's cache), pages no cache holds, which a kernel may write
    past the caches (no read of their lines from memory before the write)."""
    return _recording.get() and nbytes >= SMALLEST


def release() -> int:
    """Hand the blocks the pool keeps back to the kernel now; returns their bytes."""
    return POOL.release()


def new_tensor(*shape: int) -> torch.Tensor:
    """An uninitialised float32 tensor of `shape` for a kernel to write: on a block of POOL within
    `recycled()` (from SMALLEST bytes), else torch.empty, advised into 2 MB pages from
    FRESH_HUGE_FROM bytes."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * 4
    if fresh(nbytes):
        taken = POOL.take(nbytes)
        if taken is not None:
            block, size = taken
            array = np.frombuffer(block, dtype=np.float32, count=numel)
            weakref.finalize(array, POOL.give_back, block, size).atexit = False
            return torch.from_numpy(array).view(shape)
    out = torch.empty(*shape, dtype=torch.float32)  # whatever torch's default dtype is
    madvise = _madvise()
    if madvise is not None and nbytes >= FRESH_HUGE_FROM:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        madvise(start, end - start, MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return out


@functools.cache
def _madvise() -> Callable | None:
    """libc's madvise on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def trim() -> None:
    """Hand the free pages of malloc's heaps back to the kernel (glibc's malloc_trim): blocks under
    its mmap threshold (32 MiB at most) live in a heap, whose free middle stays resident until
    trimmed. Nothing elsewhere."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


CGROUP_ROOT = Path("/sys/fs/cgroup")


def available() -> tuple[int, str] | None:
    """(bytes this process may still allocate, where that figure comes from), or None where the
    machine reports neither (module docstring)."""
    found = []
    meminfo = _meminfo_available()
    if meminfo is not None:
        found.append((meminfo, "MemAvailable"))
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_number(path: Path) -> int | None:
    """A cgroup file's number; None where it is missing, unreadable or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> tuple[int, str] | None:
    """(limit less usage, a description) of this process's memory cgroup, v2 or v1; None without
    a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's single hierarchy: limits on this group and each above it
            group = CGROUP_ROOT / path.lstrip("/")
            rooms = []
            while True:
                limit = _read_number(group / "memory.max")
                usage = _read_number(group / "memory.current")
                if limit is not None and usage is not None:
                    rooms.append((max(limit - usage, 0), f"the cgroup limit of {group}"))
                if group == CGROUP_ROOT or CGROUP_ROOT not in group.parents:
                    break
                group = group.parent
            if rooms:
                return min(rooms)
        elif "memory" in controllers.split(","):
            group = CGROUP_ROOT / "memory" / path.lstrip("/")
            limit = _read_number(group / "memory.limit_in_bytes")
            usage = _read_number(group / "memory.usage_in_bytes")
            # v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages)
            if limit is not None and usage is not None and limit < 1 << 60:
                return max(limit - usage, 0), f"the cgroup limit of {group}"
    return None


def gigabytes(n: int) -> str:
    """n bytes as the figure a line reports: '4.92 GB', '538.7 MB'."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
