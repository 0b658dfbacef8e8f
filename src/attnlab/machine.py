"""The machine attnlab runs on, and the choices between paths that it measures once and keeps.

What a choice between a faster and a slower path depends on (bfloat16 products or float32 ones for
Muon's Newton-Schulz, the C kernels' float32 tiles or torch's GEMM) is what this CPU reports and,
where that does not settle it, a short measurement on this machine: never the machine the code was
written on. `attnlab doctor` prints both.

Design choices:
- `describe()` reads the machine: the CPU's model and flags (/proc/cpuinfo on Linux, sysctl on
  macOS), its architecture and cores, the instruction sets that decide attnlab's and torch's paths
  (INSTRUCTION_SETS: AVX2, FMA, F16C, AVX-512, VNNI, AVX-512 BF16 and AMX on x86; NEON, dotprod,
  i8mm, BF16 and SVE on Arm), torch's version and threads, and LIMITS: the environment variables
  with which a user (or a test emulating an AVX2 machine) keeps torch's libraries below what the
  CPU has.
- `measured(name, measure, extra)` runs a measurement once per machine and keeps its result in
  $ATTNLAB_CACHE/machine (attnlab.env.cache_root), one JSON file per measurement and key. The key
  is what decides the answer: the CPU's model and flags, torch's version, the thread count, LIMITS
  and torch's float32 matmul precision, plus what the caller adds (a kernel build, a device). With
  LIMITS in it, a process that keeps torch to AVX2 does not read the answer measured with
  AVX-512. The file is written to a temporary name and renamed (a reader never sees half of one);
  one that cannot be read or parsed is measured again and rewritten, and a cache that cannot be
  written only costs the next process the measurement: neither is an error. Within a process the
  answer is kept in memory under the parts of its key that a process may change (threads,
  LIMITS, $ATTNLAB_CACHE), so that asking again costs a dictionary lookup.
- `bfloat16_products(device)`: torch's bfloat16 matrix product against float32's, GFLOP/s on a
  512 x 512 product on this process's threads, the best of up to three after a warm-up, taking
  turns, stopping early once a round has taken long (a CPU without bfloat16 instructions runs it
  tens of times slower: the slow side is timed once). `bfloat16_is_fast`: bfloat16 at least as
  fast as float32; Muon's Newton-Schulz takes bfloat16 only then (attnlab.training.schedule).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .env import cache_root
from .files import atomic_write_text

# The environment variables that keep torch's libraries below what the CPU has: oneDNN's
# (bfloat16 and float32 products through mkldnn), MKL's (float32 GEMM), ATen's own kernels'.
LIMITS = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_DEFAULT_FPMATH_MODE",
)

# The instruction sets that decide a path, each with the CPU flags it needs (as /proc/cpuinfo
# names them, compared without '_' and case, which is how macOS's sysctl spells them).
INSTRUCTION_SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "x86": {
        "AVX2": ("avx2",),
        "FMA": ("fma",),
        "F16C": ("f16c",),
        "AVX-512 F/BW/VL/DQ": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
        "AVX-512 VNNI": ("avx512_vnni",),
        "AVX-512 BF16": ("avx512_bf16",),
        "AMX": ("amx_tile", "amx_bf16"),
    },
    "arm": {
        "NEON": ("asimd",),
        "dotprod": ("asimddp",),
        "i8mm": ("i8mm",),
        "BF16": ("bf16",),
        "SVE": ("sve",),
    },
}
# macOS's sysctl names of the Arm features above
_MACOS_ARM = {
    "hw.optional.neon": "asimd",
    "hw.optional.arm.FEAT_DotProd": "asimddp",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16",
}

PRODUCT_SIZE = 512  # n of the n x n by n x n products `bfloat16_products` times
LONG_ROUND_S = 0.1  # a round of timings that took longer ends the measurement after it


@dataclass(frozen=True)
class Machine:
    """What `describe()` read."""

    cpu: str  # the CPU's model name
    architecture: str  # platform.machine(): x86_64, arm64, aarch64, ...
    cores: int  # os.cpu_count()
    flags: tuple[str, ...]  # every flag the CPU reports, sorted
    threads: int  # torch.get_num_threads()
    torch: str  # torch.__version__
    limits: dict[str, str] = field(default_factory=dict)  # LIMITS that are set

    @property
    def family(self) -> str:
        arch = self.architecture.lower()
        if arch in ("x86_64", "amd64", "i386", "i686"):
            return "x86"
        return "arm" if arch.startswith(("arm", "aarch64")) else arch

    def has(self, name: str) -> bool:
        """Whether the CPU reports every flag of INSTRUCTION_SETS[family][name]."""
        have = {_plain(f) for f in self.flags}
        return all(_plain(f) in have for f in INSTRUCTION_SETS.get(self.family, {})[name])

    def instruction_sets(self) -> dict[str, bool]:
        """Each instruction set of INSTRUCTION_SETS for this architecture: reported or not."""
        return {name: self.has(name) for name in INSTRUCTION_SETS.get(self.family, {})}

    def key(self) -> dict[str, Any]:
        """What a measured choice depends on (module docstring), for `measured`'s key."""
        return {
            "cpu": self.cpu,
            "architecture": self.architecture,
            "flags": hashlib.sha256(" ".join(self.flags).encode()).hexdigest()[:16],
            "torch": self.torch,
            "threads": self.threads,
            "limits": self.limits,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }


def _plain(flag: str) -> str:
    return flag.lower().replace("_", "")


@functools.cache
def _cpu() -> tuple[str, tuple[str, ...]]:
    """(model name, flags) of this CPU, as the operating system reports them."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not name:
                name = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    if not name and platform.system() == "Darwin":
        name, flags = _macos_cpu()
    return name or platform.processor() or platform.machine() or "unknown", tuple(sorted(flags))


def _macos_cpu() -> tuple[str, set[str]]:
    """macOS's sysctl: the brand string and the features (x86: machdep.cpu.*features; Arm: the
    hw.optional.* entries of _MACOS_ARM that are 1)."""
    try:
        out = subprocess.run(["sysctl", "-a"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "", set()
    values = dict(line.partition(": ")[::2] for line in out.splitlines() if ": " in line)
    flags = {
        f.lower()
        for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features")
        for f in values.get(key, "").split()
    }
    flags |= {flag for key, flag in _MACOS_ARM.items() if values.get(key, "").strip() == "1"}
    return values.get("machdep.cpu.brand_string", "").strip(), flags


def describe() -> Machine:
    """This machine, as it is now (torch's thread count and LIMITS are read at each call)."""
    cpu, flags = _cpu()
    return Machine(
        cpu=cpu,
        architecture=platform.machine() or "unknown",
        cores=os.cpu_count() or 1,
        flags=flags,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        limits={name: os.environ[name] for name in LIMITS if os.environ.get(name)},
    )


def threads_phrase() -> str:
    """torch's thread count in words, as the lines that report a measurement give it."""
    threads = torch.get_num_threads()
    return f"{threads} thread{'' if threads == 1 else 's'}"


# Measured once per machine -------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """A measurement's result, the file it is kept in, and whether this call measured it."""

    values: dict[str, Any]
    path: Path
    fresh: bool


def cache_dir() -> Path:
    return cache_root() / "machine"


# this process's answers, by what their key is made of (read without hashing: the kernels ask for
# theirs in every forward pass)
_KEPT: dict[tuple, Measured] = {}


def _in_process_key(name: str, extra: dict[str, Any]) -> tuple:
    """What may change within a process among the things that decide `measured`'s key and file."""
    return (
        name,
        tuple(sorted(extra.items())),
        _cpu(),
        torch.get_num_threads(),
        tuple(os.environ.get(limit) for limit in LIMITS),
        torch.get_float32_matmul_precision(),
        os.environ.get("ATTNLAB_CACHE"),
        os.environ.get("HOME"),
    )


def measured(
    name: str, measure: Callable[[], dict[str, Any]], extra: dict[str, Any] | None = None
) -> Measured:
    """measure()'s result (a dict of JSON values) for this machine and `extra` (JSON values): from
    this process, else from its file in cache_dir(), else measured now and written there (module
    docstring)."""
    extra = extra or {}
    kept = _KEPT.get(_in_process_key(name, extra))
    if kept is not None:
        return Measured(kept.values, kept.path, fresh=False)
    key = {"measurement": name, **describe().key(), **extra}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.json"
    result = None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("key") == json.loads(json.dumps(key)) and isinstance(saved["values"], dict):
            result = Measured(saved["values"], path, fresh=False)
    # missing, unreadable, torn by hand or by another version: measured again
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    if result is None:
        result = Measured(measure(), path, fresh=True)
        with contextlib.suppress(OSError):  # a read-only cache: the next process measures again
            text = json.dumps({"key": key, "values": result.values}, indent=1) + "\n"
            atomic_write_text(path, text)
    _KEPT[_in_process_key(name, extra)] = result
    return result


def forget() -> None:
    """Drop this process's kept answers (the files stay): the next `measured` reads its file."""
    _KEPT.clear()


# bfloat16 products ---------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_products(device: torch.device, n: int = PRODUCT_SIZE) -> dict[str, float]:
    """GFLOP/s of torch's n x n by n x n product in bfloat16 and in float32 on `device`: the best
    of up to 3 timings each after one warm-up, taking turns, ending after the first round that
    took LONG_ROUND_S. A dtype the device cannot multiply in scores 0."""
    operands = {}
    generator = torch.Generator(device=device).manual_seed(0)  # torch's global one left alone
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device=device, generator=generator).to(dtype)
        b = torch.randn(n, n, device=device, generator=generator).to(dtype)
        try:
            a @ b  # the warm-up (and whether this device multiplies in dtype at all)
            _synchronize(device)
        except (RuntimeError, TypeError):
            continue
        operands[dtype] = (a, b)
    best = {dtype: float("inf") for dtype in operands}
    for _ in range(3):
        start_round = time.perf_counter()
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            a @ b
            _synchronize(device)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
        if time.perf_counter() - start_round > LONG_ROUND_S:
            break
    gflops = {dtype: 2 * n**3 / seconds / 1e9 for dtype, seconds in best.items()}
    return {
        "bfloat16_gflops": gflops.get(torch.bfloat16, 0.0),
        "float32_gflops": gflops.get(torch.float32, 0.0),
        "size": n,
    }


def _device_key(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {
            "device": f"cuda:{torch.cuda.get_device_name(device)}",
            "cuda": torch.version.cuda,
        }
    return {"device": device.type}


def bfloat16_products(device: torch.device | str = "cpu") -> Measured:
    """`time_products` on `device`, measured once per machine (`measured`): values
    bfloat16_gflops, float32_gflops and size."""
    device = torch.device(device)
    return measured(
        "bfloat16-products", lambda: time_products(device), {**_device_key(device), "version": 1}
    )


def bfloat16_is_fast(rates: dict[str, Any]) -> bool:
    """Whether bfloat16 products run at least as fast as float32 ones (`time_products`'s rates):
    where they do not, bfloat16's fewer bytes buy nothing and its rounding costs accuracy."""
    return rates["bfloat16_gflops"] > 0 and rates["bfloat16_gflops"] >= rates["float32_gflops"]
