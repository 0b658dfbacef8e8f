"""Building attnlab's C kernels, choosing the build this process runs, and loading it.

Design choices:
- Plain C, no torch headers: one `cc -O3 -fopenmp` of the unity file (SOURCE) is quick, where a
  torch C++ extension is slow to build; loaded with ctypes, a call costs little. The shared
  library is cached under ~/.cache/attnlab/kernels (or $ATTNLAB_CACHE/kernels), named by a hash of
  every *.c and *.h file of the source's folder (`source_key`: the unity file includes the
  others), the flags, the compiler and the CPU, so the build is paid once per machine, never once
  per process, and a new CPU or a changed source builds anew. Written to a temporary name, then
  renamed: a parallel build never leaves a torn file.
- The instruction set is chosen at run time, not by -march=native: the kernels have three builds
  on x86-64 (VARIANTS: AVX-512 with VNNI, AVX2 with FMA and F16C, portable C), and the process uses
  the best one that (1) the CPU reports, (2) the operating system enables (XCR0's register state,
  read by cpu.c: a CPU flag is not permission) and (3) passes a self-check in a child process
  (checks/check.py: exact integer products through each kind of kernel), so that an
  instruction that faults here kills the child, never the user's process; the verdict is cached
  beside the library. ATTNLAB_KERNELS=avx512, avx2 or portable forces one (tests, the AVX2
  benchmark column); one this machine does not allow is a one-line error. Off x86-64 the builds
  are -march=native and portable.
- AMX (Sapphire Rapids and later) is a fourth permission, asked of the operating system per
  process (arch_prctl for the tile state, Linux 5.16+): `amx_unusable` runs the amx check of
  checks/check.py (the permission, then an exact product on the tiles) in a child process once
  per build and machine, then asks for this process's own permission. llama.cpp's AMX path faults
  in the virtual machines this was written on (GCC 12's tile configuration intrinsic, the C
  source's comment); a fault here costs the child only.
- OpenMP links to libgomp.so.1, which torch's wheel has already loaded under that name: the kernels
  share torch's thread pool and its `torch.set_num_threads`. A compiler without OpenMP (Apple's
  clang, clang without libomp) builds them with -fopenmp-simd instead (`openmp_or_not`): the same
  numbers on one thread (`openmp()` False, said in one line; tests/test_kernels_without_openmp.py
  checks clang's build so, two threads asked for).
- No compiler (CC naming none, or no cc, gcc or clang; whatever ATTNLAB_KERNELS forces), a compiler
  that fails, a non-CPU tensor or ATTNLAB_KERNELS=0: `available()` is False and every caller takes
  its PyTorch path, which computes the same equation (tests/test_kernels.py holds them together);
  `unavailable()` says why, and but for ATTNLAB_KERNELS=0 so does one line (attnlab.slower), once
  per process, as it does for a better build passed over.
- The choice is made once per process (`decision`, `library`: cached); the other modules reach
  the library through `builds.library()`, so that a test replaces it in one place.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import torch

from ... import machine, slower
from ...env import cache_root
from ...errors import UserError
from .checks import AMX_CHECK, PROGRAM, SELF_CHECK
from .interface import CPU_FUNCTIONS, declare, load

# the file the compiler is given (a unity file that includes the rest of the C source), and
# cpu.c, a library of its own: what the CPU and the OS allow (CpuLevel)
SOURCE = Path(__file__).with_name("c") / "kernels.c"
CPU_SOURCE = Path(__file__).with_name("c") / "cpu.c"


class CpuLevel(enum.IntFlag):
    """cpu.c's ATTNLAB_CPU_* bits: the instruction sets of the x86 builds, usable here."""

    AVX2 = 1  # AVX2, FMA, F16C; ymm state enabled by the OS
    AVX512 = 2  # AVX-512 F, BW, VL, DQ, VNNI; zmm and opmask state enabled by the OS


_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
# the kernels' builds, best first: name -> (compiler flags, the CpuLevel it needs). On x86-64 the
# first three, each the same program on every machine: its instruction sets named, and no
# -march=native or -mtune=native (tuned for a Zen 3, gcc vectorised other loops of the AVX2 build:
# other orders of summation, an 8-bit rounding that went the other way, and SmolLM2's perplexity
# moved past tests/test_blocks.py's bound there and not here); elsewhere "native" and "portable".
VARIANTS: dict[str, tuple[list[str], CpuLevel]] = {
    "avx512": (["-O3", *_AVX512, "-fopenmp"], CpuLevel.AVX512),
    "avx2": (["-O3", *_AVX2, "-fopenmp"], CpuLevel.AVX2),
    "native": (["-O3", "-march=native", "-fopenmp"], CpuLevel(0)),
    "portable": (["-O3", "-fopenmp"], CpuLevel(0)),
}


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_id() -> str:
    """The CPU's model and feature flags: -march=native code is only valid on the CPU it was built
    for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return "\n".join(
            line
            for line in text.splitlines()
            if line.startswith(("model name", "flags", "Features"))
        )[:8192]
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> list[str] | None:
    """The C compiler's command: $CC's (split as a shell would: `CC="ccache gcc"`) where its
    program exists, else cc, gcc or clang on PATH; None when there is none (CC naming a program
    that does not exist is none: it is not replaced by another)."""
    named = os.environ.get("CC", "").strip()
    if named:
        command = shlex.split(named)
        found = shutil.which(command[0])
        return None if found is None else [found, *command[1:]]
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return None if found is None else [found]


def no_compiler() -> str | None:
    """Why there is no C compiler to build the kernels with (None: there is one), and the fix."""
    if _compiler() is not None:
        return None
    named = os.environ.get("CC", "").strip()
    where = f"CC={named} names no program here" if named else "no cc, gcc or clang on PATH"
    return (
        f"no C compiler ({where}); install one (apt-get install gcc, or xcode-select --install "
        "on macOS)"
    )


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def source_key(source: Path) -> bytes:
    """What a build of `source` is compiled from, for the cache's key: the name and bytes of every
    *.c and *.h file in its folder (the unity file includes the others, and a header changed
    alone must build anew), `source` itself first."""
    others = sorted(p for p in source.parent.glob("*.[ch]") if p.name != source.name)
    digest = hashlib.sha256()
    for path in [source, *others]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def compile_library(
    source: Path, flag_sets: tuple[list[str], ...], verbose: bool = False
) -> Path | None:
    """The cached shared library of `source` for this machine, compiled first if needed with the
    first of `flag_sets` that compiles; None when none does."""
    compiler = _compiler()
    if compiler is None:
        return None
    text = source_key(source)
    for flags in flag_sets:
        key = hashlib.sha256(
            b"\0".join(
                [text, " ".join(flags).encode(), " ".join(compiler).encode(), _cpu_id().encode()]
            )
        )
        target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            result = subprocess.run(
                [*compiler, *flags, "-shared", "-fPIC", str(source), "-o", tmp, "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode == 0:
                os.replace(tmp, target)
                return target
            if verbose:
                command = " ".join([*compiler, *flags])
                print(f"attnlab kernels: {command} failed:\n{result.stderr}")
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return None


def cpu_levels() -> CpuLevel:
    """The x86 instruction sets this CPU reports and its operating system enables (cpu.c); none
    off x86-64 or without a compiler."""
    if not _is_x86():
        return CpuLevel(0)
    path = compile_library(CPU_SOURCE, (["-O2"],))
    if path is None:
        return CpuLevel(0)
    return CpuLevel(declare(ctypes.CDLL(str(path)), CPU_FUNCTIONS).attnlab_cpu_levels())


def build_names() -> tuple[str, ...]:
    """the kernels' builds on this kind of processor, best first: avx512, avx2 and portable on
    x86-64; native and portable elsewhere."""
    return ("avx512", "avx2", "portable") if _is_x86() else ("native", "portable")


def variants_here() -> list[str]:
    """The names of VARIANTS this machine may run, best first (before the self-check)."""
    if not _is_x86():
        return list(build_names())
    levels = cpu_levels()
    return [name for name in build_names() if VARIANTS[name][1] & levels == VARIANTS[name][1]]


def instructions(name: str) -> list[str]:
    """The instruction sets build `name` is compiled for, as the CPU's flags name them (Linux's
    /proc/cpuinfo; macOS's sysctl without its underscores)."""
    flags = VARIANTS[name][0]
    named = [f.removeprefix("-m") for f in flags if f.startswith("-m") and "=" not in f]
    return [n.replace("avx512vnni", "avx512_vnni") for n in named]


def why_not_here(name: str, flags: Iterable[str] | None = None) -> str:
    """Why this CPU cannot execute build `name` (one `variants_here` leaves out): the instructions
    it lacks, by the flags it reports (`flags`, else machine.describe()'s); else (every flag
    there) that its operating system does not enable their registers (cpu.c, XCR0)."""
    reported = machine.describe().flags if flags is None else flags
    have = {flag.lower().replace("_", "") for flag in reported}
    lacking = [n for n in instructions(name) if n.replace("_", "") not in have]
    if lacking:
        return f"this CPU lacks {', '.join(lacking)} (the {name} build's instructions)"
    return (
        f"this CPU's operating system does not enable the registers of the {name} build's "
        f"instructions ({', '.join(instructions(name))}: kernels.cpu_levels)"
    )


# signals that stop a child from outside: they say nothing about the build it was checking
NOT_THE_BUILD = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def self_check(path: Path, check: str = SELF_CHECK, suffix: str = ".checked") -> str | None:
    """None when the library at `path` passes `check` of checks/check.py (SELF_CHECK, or
    AMX_CHECK) in a child process, else why not (a fault, a wrong sum). A verdict that
    would be the same next time (passed, an instruction fault, a wrong sum) is cached in a file
    beside the library (`suffix`); the child killed from outside (an out-of-memory kill, a
    Ctrl-C) or out of time is not, so the next process checks again."""
    verdict = path.with_suffix(suffix)
    if verdict.is_file():
        text = verdict.read_text()
        return None if text == "ok" else text
    try:
        result = subprocess.run(
            [sys.executable, "-I", "-S", str(PROGRAM), check, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        why = None
        if result.returncode != 0 or result.stdout.strip() != "ok":
            lines = (result.stderr.strip() or f"exit status {result.returncode}").splitlines()
            why = f"its self-check failed ({lines[-1][:200]}; exit status {result.returncode})"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"its self-check could not run ({exc})"
    if -result.returncode in NOT_THE_BUILD:
        return why
    fd, tmp = tempfile.mkstemp(prefix=".check-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(why or "ok")
    os.replace(tmp, verdict)
    return why


def choose_variant(verbose: bool = False) -> tuple[str, Path] | None:
    """(name, library) of the kernels' build this process runs: ATTNLAB_KERNELS's when it names
    one, else the best of `variants_here()` that compiles and passes its self-check; None when
    none does, without a C compiler (whatever ATTNLAB_KERNELS names: there is nothing to build),
    or with ATTNLAB_KERNELS=0. A forced build this machine does not allow is a UserError."""
    return _choose(verbose)[0]


def _choose(verbose: bool = False) -> tuple[tuple[str, Path] | None, list[str], str | None]:
    """`choose_variant`'s choice, why each better build was passed over ("the avx512 build: it
    does not compile"), and why there is none (None: there is one)."""
    wanted = os.environ.get("ATTNLAB_KERNELS", "1").strip().lower()
    if wanted == "0":
        return None, [], "ATTNLAB_KERNELS=0"
    forced = wanted not in ("1", "")
    names = build_names()
    if forced and wanted not in names:
        raise UserError(
            f"ATTNLAB_KERNELS={wanted}: not a build of attnlab's kernels on this machine; "
            f"use one of {', '.join(names)}, 1 (the best allowed) or 0 (none)"
        )
    missing = no_compiler()  # before the CPU is read: cpu.c needs the compiler too
    if missing is not None:
        return None, [], missing
    here = variants_here()
    if forced:
        if wanted not in here:
            raise UserError(
                f"ATTNLAB_KERNELS={wanted}: {why_not_here(wanted)}; use one of {', '.join(here)}"
            )
        here = [wanted]
    passed_over = []
    for name in here:
        path = compile_library(SOURCE, openmp_or_not(VARIANTS[name][0]), verbose)
        why = "it does not compile" if path is None else self_check(path)
        if why is None:
            return (name, path), passed_over, None
        if forced:
            raise UserError(f"ATTNLAB_KERNELS={wanted}: the {name} build cannot run here: {why}")
        if verbose:
            print(f"attnlab kernels: the {name} build is not used: {why}")
        passed_over.append(f"the {name} build: {why}")
    compiler = " ".join(_compiler() or [])
    return (
        None,
        passed_over,
        f"no build of them runs here ({'; '.join(passed_over)}; compiler {compiler}; "
        "kernels.build(verbose=True) prints its errors)",
    )


def openmp_or_not(flags: list[str]) -> tuple[list[str], ...]:
    """`flags`, then the same without OpenMP's runtime for a compiler that has none (Apple's clang,
    clang without libomp): -fopenmp-simd keeps the kernels' `omp simd` reductions, and so the same
    order of summation and the same numbers (without it gcc summed a float32 product's and
    RMSNorm's terms in another order), and ignores the rest, so each kernel runs on the calling
    thread (attnlab_openmp); then neither, for a compiler that knows neither flag."""
    if "-fopenmp" not in flags:
        return (flags,)
    without = [f for f in flags if f != "-fopenmp"]
    return flags, [*without, "-fopenmp-simd"], without


def build(verbose: bool = False, flag_sets: tuple[list[str], ...] | None = None) -> Path | None:
    """The cached shared library this machine runs (`choose_variant`), built first if needed; or,
    given `flag_sets`, SOURCE compiled with the first of them that compiles, each without
    OpenMP's runtime after it where the compiler has none (`openmp_or_not`; tests build the other
    variants so). None when there is none."""
    if flag_sets is not None:
        every = tuple(each for flags in flag_sets for each in openmp_or_not(flags))
        return compile_library(SOURCE, every, verbose)
    chosen = choose_variant(verbose)
    return None if chosen is None else chosen[1]


@cache
def decision() -> tuple[tuple[str, Path] | None, list[str], str | None]:
    """This process's `_choose()`, decided once; a slower choice than this CPU allows is said in
    one line (attnlab.slower): no kernels at all (but for ATTNLAB_KERNELS=0, the user's own
    choice), or a better build passed over."""
    chosen, passed_over, why_none = _choose()
    if chosen is None and why_none != "ATTNLAB_KERNELS=0":
        slower.say(
            "generation and forward passes run on torch's paths", "attnlab's C kernels", why_none
        )
    elif chosen is not None and passed_over:
        slower.say(
            f"attnlab's C kernels run their {chosen[0]} build",
            "a better one this CPU allows",
            "; ".join(passed_over),
        )
    return chosen, passed_over, why_none


def chosen_variant() -> tuple[str, Path] | None:
    """This process's `choose_variant()`, decided once (`decision`)."""
    return decision()[0]


def use_variant(name: str | None) -> None:
    """From now on this process runs the kernels' build `name` (as ATTNLAB_KERNELS=name would have
    chosen it; None: the default choice again), so that a benchmark can time two builds side by
    side in one run. Kernel calls prepared before keep the build they were prepared with."""
    if name is None:
        os.environ.pop("ATTNLAB_KERNELS", None)
    else:
        os.environ["ATTNLAB_KERNELS"] = name
    decision.cache_clear()
    library.cache_clear()


def variant() -> str | None:
    """The name of the kernels' build this process runs (VARIANTS), None without kernels."""
    chosen = chosen_variant()
    return None if chosen is None else chosen[0]


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, build failed, or ATTNLAB_KERNELS=0): callers fall
    back to PyTorch. A build without OpenMP (`openmp`) is said in one line: its kernels run on
    one thread."""
    chosen = chosen_variant()
    try:
        lib = None if chosen is None else load(chosen[1])
    except OSError:
        return None
    if lib is not None and not lib.attnlab_openmp():
        slower.say(
            "attnlab's C kernels run on one thread",
            "on torch's threads",
            f"{' '.join(_compiler() or ['the compiler'])} built them without OpenMP (-fopenmp "
            "failed); gcc, or clang with libomp (apt-get install libomp-dev), builds them with it",
        )
    return lib


def unavailable() -> str | None:
    """Why this process runs no C kernels (None: it runs them): ATTNLAB_KERNELS=0, no C
    compiler, no build that compiles and passes its self-check, or one that does not load."""
    if library() is not None:
        return None
    chosen, _, why_none = decision()
    return why_none or f"the {chosen[0]} build of attnlab's kernels does not load"


def openmp() -> bool | None:
    """Whether the kernels this process runs were built with OpenMP, so that they run on
    torch.get_num_threads() threads (False: on one thread, attnlab_openmp); None without
    kernels."""
    lib = library()
    return None if lib is None else bool(lib.attnlab_openmp())


def available() -> bool:
    return library() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernels can stand in for PyTorch here: built, every tensor on the CPU, and no
    gradient wanted (the kernels have no backward)."""
    grad = torch.is_grad_enabled()
    if not all(t.device.type == "cpu" and not (grad and t.requires_grad) for t in tensors):
        return False
    return library() is not None


def amx_unusable() -> str | None:
    """Why this process cannot take `linear_amx` (None: it can): no AVX-512 build of the kernels,
    or the amx check of checks/check.py failed in its child process (the CPU lacks AMX-BF16, the
    operating system does not grant the tile state, a fault, a wrong sum). Decided once per
    process and build."""
    return _amx_unusable(chosen_variant())


@cache
def _amx_unusable(chosen: tuple[str, Path] | None) -> str | None:
    if chosen is None or chosen[0] != "avx512":
        return "AMX tiles are only in the AVX-512 build of attnlab's kernels"
    why = self_check(chosen[1], AMX_CHECK, ".amx-checked")
    if why is not None:
        return why.replace("its self-check failed", "its AMX check failed")
    if library().attnlab_amx_permitted() != 1:  # this process's own permission
        return "the operating system did not grant this process AMX's tile state"
    return None
