"""`attnlab doctor`: what this machine is and what attnlab chose on it, and why, in a few lines.

Design choices:
- Each line is one topic (TOPICS, in order): a fact read or measured here, and the choice it
  decides with its reason. The measured choices (bfloat16 against float32 products, the float32
  tiles against torch's GEMM, the decode step's 16-row layout against the file's) come from
  attnlab.machine's cache, so the command measures only what no process on this machine has
  measured yet, and prints what training and inference will use.
- It reads what the other commands read (attnlab.generate.kernels' build choice, float product
  path and huge pages; attnlab.training.schedule's Newton-Schulz dtype rule), so the line says what
  they do, not a second opinion.
- It never raises: a topic that cannot be read (a forced kernel build the CPU refuses, no
  compiler, no /proc) is a line saying so, and the other topics still print. `--json` prints the
  same topics as one JSON object, each with its line and its values.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import machine, slower
from .env import cache_root
from .errors import UserError

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# a symbol a library built with -fopenmp calls -> the OpenMP runtime it calls it in
OPENMP_CALLS = {b"GOMP_parallel": "GCC's libgomp", b"__kmpc_fork_call": "LLVM's libomp"}
HUGE_PAGE_PROBE = 8 << 20  # bytes of the block `huge_pages` places in 2 MB pages


@dataclass
class Line:
    topic: str
    text: str
    values: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.topic}: {self.text}"


def _listed(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def machine_line() -> Line:
    here = machine.describe()
    return Line(
        "machine",
        f"{here.cpu}, {here.architecture}, {here.cores} cores",
        {"cpu": here.cpu, "architecture": here.architecture, "cores": here.cores},
    )


def instruction_sets_line() -> Line:
    """What the CPU reports, and (x86) what its operating system enables: the kernels' cpu.c."""
    from .generate import kernels

    sets = machine.describe().instruction_sets()
    have = [name for name, present in sets.items() if present]
    lacking = [name for name, present in sets.items() if not present]
    text = f"{_listed(have)}; not reported: {_listed(lacking)}"
    values: dict[str, Any] = {"reported": have, "not_reported": lacking}
    if kernels.builds._is_x86():
        if kernels.compile_library(kernels.CPU_SOURCE, (["-O2"],)) is None:
            text += "; the operating system's permission not checked (cpu.c, which reads it, did "
            text += "not compile)"
        else:
            levels = kernels.cpu_levels()
            enabled = [level.name for level in kernels.CpuLevel if level & levels]
            values["enabled_by_the_os"] = enabled
            text += f"; enabled by the operating system (XCR0): {_listed(enabled)}"
    return Line("instruction sets", text, values)


def threads_line() -> Line:
    threads, interop = torch.get_num_threads(), torch.get_num_interop_threads()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    omp = os.environ.get("OMP_NUM_THREADS")
    source = f"OMP_NUM_THREADS={omp}" if omp else "OMP_NUM_THREADS unset: torch's default"
    return Line(
        "threads",
        f"torch runs {machine.threads_phrase()} ({source}) of the {allowed} cores this process "
        f"may use, {interop} between ops; attnlab's kernels run on torch's threads",
        {"threads": threads, "interop_threads": interop, "cores_allowed": allowed},
    )


def torch_line() -> Line:
    """torch's version, its BLAS, MKL and oneDNN, ATen's CPU capability, and the LIMITS set."""
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", config)
    onednn = re.search(r"MKL-DNN (v[\w.]+)", config)
    capability = torch.backends.cpu.get_cpu_capability()
    parts = [f"BLAS {blas.group(1) if blas else 'unknown'}"]
    if mkl and torch.backends.mkl.is_available():
        parts.append(f"MKL {mkl.group(1)}")
    parts.append(
        f"oneDNN {onednn.group(1)}"
        if onednn and torch.backends.mkldnn.is_available()
        else "no oneDNN"
    )
    limits = machine.describe().limits
    limited = (
        "limited by " + ", ".join(f"{k}={v}" for k, v in limits.items())
        if limits
        else "no instruction-set limit set (" + ", ".join(machine.LIMITS[:5]) + ")"
    )
    return Line(
        "torch",
        f"{torch.__version__}, {', '.join(parts)}, ATen's CPU capability {capability}; {limited}",
        {
            "version": torch.__version__,
            "blas": blas.group(1) if blas else None,
            "mkl": mkl.group(1) if mkl else None,
            "onednn": onednn.group(1) if onednn else None,
            "aten_capability": capability,
            "limits": limits,
        },
    )


def compiler_line() -> Line:
    from .generate import kernels

    compiler = kernels.builds._compiler()
    if compiler is None:
        why = kernels.no_compiler()
        return Line("compiler", f"{why}: every path is torch's", {"compiler": None})
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30)
        version = (done.stdout or done.stderr).strip().splitlines()[0]
        if done.returncode != 0:
            version = f"its --version failed: {version}"
    except (OSError, subprocess.SubprocessError, IndexError):
        version = "its --version did not answer"
    command = " ".join(compiler)
    return Line("compiler", f"{command} ({version})", {"compiler": command, "version": version})


def kernels_line() -> Line:
    """The kernels' build this process runs, its self-check, and why each better build is not:
    the kernels' own choice (kernels.builds._choose, which generation and forward passes take), the
    builds this CPU cannot execute named with what it lacks (kernels.why_not_here)."""
    from .generate import kernels

    try:
        chosen, passed_over, why_none = kernels.builds._choose()
    except UserError as exc:
        return Line("kernels", f"none: {exc}", {"build": None, "error": str(exc)})
    if why_none == "ATTNLAB_KERNELS=0":
        return Line("kernels", "off (ATTNLAB_KERNELS=0): every caller takes torch's path", {})
    if kernels.no_compiler() is not None:
        return Line("kernels", f"not built ({why_none}): every caller takes torch's path", {})
    wanted = os.environ.get("ATTNLAB_KERNELS", "1").strip().lower()
    forced = wanted not in ("1", "")
    names, here = kernels.build_names(), kernels.variants_here()
    better = names if chosen is None else names[: names.index(chosen[0])]
    reasons = [
        f"the {name} build: {kernels.why_not_here(name)}"
        if name not in here
        else f"the {name} build: not tried (ATTNLAB_KERNELS={wanted})"
        for name in better
        if name not in here or forced
    ] + passed_over
    values: dict[str, Any] = {"build": None if chosen is None else chosen[0], "not_used": reasons}
    if chosen is None:
        text = f"none runs here ({why_none}): every caller takes torch's path"
        return Line("kernels", text, values)
    name, path = chosen
    how = f"ATTNLAB_KERNELS={wanted}" if forced else "the best build this machine allows"
    values["library"] = str(path)
    text = f"the {name} build ({how}), passed its self-check in a child process ({path.name})"
    if reasons:
        text += "; better builds not used: " + "; ".join(reasons)
    return Line("kernels", text, values)


def openmp_line() -> Line:
    """Whether the kernels run on OpenMP's threads (kernels.openmp: c/probe.c, attnlab_openmp),
    and which runtime they call (the library's dynamic symbols: GCC's libgomp, which torch's
    wheel loads too, or LLVM's libomp)."""
    from .generate import kernels

    if _chosen_quietly() is None:
        return Line("OpenMP", "no kernels run here", {"openmp": None})
    if not kernels.openmp():
        compiler = " ".join(kernels.builds._compiler() or ["the compiler"])
        return Line(
            "OpenMP",
            f"the kernels were built without OpenMP ({compiler} has none): they run on one thread",
            {"openmp": False},
        )
    library = Path(kernels.chosen_variant()[1]).read_bytes()
    runtime = next((name for symbol, name in OPENMP_CALLS.items() if symbol in library), "")
    text = "the kernels run on OpenMP's threads" + (f" ({runtime})" if runtime else "")
    return Line("OpenMP", text, {"openmp": True, "runtime": runtime or None})


def _chosen_quietly() -> tuple[str, Path] | None:
    from .generate import kernels

    try:
        return kernels.chosen_variant()
    except UserError:
        return None


def float_products_line() -> Line:
    """How float32 products of many rows run (kernels.float_products), and a prompt's attention
    (kernels.float_rows: fused; kernels.attention_rows: the steps hooks see), and why."""
    from .generate import kernels

    forced = os.environ.get("ATTNLAB_FLOAT_ROWS")
    if _chosen_quietly() is None:
        return Line(
            "float products",
            "torch's GEMM and attention for many rows (no kernels run here)",
            {"path": "torch"},
        )
    try:
        path = kernels.float_products()
    except UserError as exc:
        return Line("float products", f"none: {exc}", {"path": None, "error": str(exc)})
    values: dict[str, Any] = {"path": path, "forced": forced}
    if forced:
        why = f"ATTNLAB_FLOAT_ROWS={forced}"
    elif path == "amx":
        why = (
            "AMX's bfloat16 tiles at float32's accuracy (the AVX-512 build passed its AMX check "
            "in a child process, and this process holds the tile state)"
        )
    else:
        values["amx_unusable"] = kernels.amx_unusable()
        why = f"no AMX ({values['amx_unusable']})"
    text = f"{path} for many rows: {why}"
    if not kernels.rows_vectorized()[1]:
        text += (
            "; the float32 tiles are vectorised in the AVX-512 and AVX2 builds only "
            "(attention: torch)"
        )
    elif not forced:
        tiles = kernels.tiles_against_torch(kernels.variant(), torch.get_num_threads())
        values.update(tiles.values)
        steps = kernels.attention_against_torch(kernels.variant(), torch.get_num_threads())
        values.update(steps.values)
        text += (
            f"; {'the tiles' if tiles.values['tiles_won'] else 'torch'} for the fused attention"
            f"{'' if path == 'amx' else ' and the products'}: the float32 tiles ran "
            f"{tiles.values['tiles_gflops']:,.0f} GFLOP/s against torch's "
            f"{tiles.values['torch_gflops']:,.0f} (256 x 576 by 576 x 576, "
            f"{machine.threads_phrase()}; measured once); "
            f"{'C' if steps.values['attention_won'] else 'torch'} for the attention's scores, "
            f"pattern and z{' (AMX: its own)' if path == 'amx' else ''}: "
            f"{steps.values['attention_ms']:.1f} ms against torch's "
            f"{steps.values['torch_ms']:.1f} (SmolLM2's heads, 256 positions; measured once)"
        )
    return Line("float products", text, values)


def decode_layout_line() -> Line:
    """Which layout a decode step streams each block kind's matrices in (kernels.repack16_chosen:
    the 16-row layout where this build's 16-row product is vectorised and won its race against the
    file's layout here, measured once per kind), and why."""
    from .generate import kernels

    if _chosen_quietly() is None:
        return Line("decode layout", "no kernels run here: the module path", {"kinds": {}})
    try:
        forced = kernels.policy._forced_decode_layout()
    except UserError as exc:
        return Line("decode layout", f"none: {exc}", {"kinds": {}, "error": str(exc)})
    build, threads = kernels.variant(), torch.get_num_threads()
    kinds: dict[str, Any] = {}
    said, lanes = [], []
    for kind in kernels.REPACKABLE:
        chosen = kernels.repack16_chosen(kind)
        kinds[kind.name] = entry = {"layout": "16-row" if chosen else "file"}
        if not kernels.repack16_vectorised(kind):
            lanes.append(kind.name)
            continue
        if forced:
            said.append(f"{kind.name} {entry['layout']} (ATTNLAB_DECODE_LAYOUT={forced})")
            continue
        race = kernels.repack16_against_file(kind, build, threads).values
        entry.update(race)
        said.append(
            f"{kind.name} {entry['layout']} ({race['repacked_us']:,.0f} us against "
            f"{race['file_us']:,.0f} in the file's)"
        )
    d_out, d_in = kernels.policy.RACE_SHAPE
    text = "; ".join(said)
    if said and not forced:
        text += (
            f" (one row by {d_out} x {d_in}, {machine.threads_phrase()}; measured once per kind)"
        )
    if lanes:
        text += (
            f"{'; ' if said else ''}{', '.join(lanes)} file (the {build} build's 16-row "
            f"product{'s are' if len(lanes) > 1 else ' is'} a lane at a time)"
        )
    text += "; other kinds: the file's"
    return Line("decode layout", text, {"kinds": kinds, "forced": forced})


def bfloat16_line() -> Line:
    """torch's bfloat16 products against float32's here, and what takes bfloat16 because of it."""
    from .training.config import TrainConfig
    from .training.schedule import newton_schulz_dtype

    choice = newton_schulz_dtype(TrainConfig(optimizer="muon"), torch.device("cpu"))
    kept = machine.bfloat16_products("cpu")  # the measurement it was made from
    rates = kept.values
    return Line(
        "bfloat16",
        f"products at {rates['bfloat16_gflops']:,.1f} GFLOP/s against float32's "
        f"{rates['float32_gflops']:,.1f} ({rates['size']} x {rates['size']}, "
        f"{machine.threads_phrase()}; measured once): Muon's Newton-Schulz runs in "
        f"{choice.name} (--muon-dtype auto); training's autocast (--dtype auto) stays float32 "
        "on a CPU",
        {**rates, "muon_newton_schulz": choice.name, "kept_in": str(kept.path)},
    )


def huge_pages() -> int | None:
    """Bytes of 2 MB pages that a block of HUGE_PAGE_PROBE bytes placed as the kernels place
    weights (kernels.place_in_huge_pages) got (/proc/self/smaps' AnonHugePages of its mapping);
    None where that cannot be read."""
    from .generate import kernels

    probe = torch.ones(HUGE_PAGE_PROBE // 4)
    if not kernels.place_in_huge_pages([probe]):
        return None
    address = probe.data_ptr()
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


def huge_pages_line() -> Line:
    try:
        setting = THP_ENABLED.read_text().strip()
        mode = re.search(r"\[(\w+)\]", setting).group(1)
    except (OSError, AttributeError):
        return Line(
            "huge pages",
            "no transparent huge pages here (not Linux, or no " + str(THP_ENABLED) + "): "
            "weights and large outputs sit on the system's pages",
            {"mode": None},
        )
    granted = huge_pages()
    values = {"mode": mode, "probe_bytes": HUGE_PAGE_PROBE, "granted_bytes": granted}
    if granted is None:
        got = "a block placed as the weights are could not be read back"
    else:
        got = (
            f"a block of {HUGE_PAGE_PROBE >> 20} MiB placed as the weights are got "
            f"{granted >> 20} MiB of them"
        )
    in_use = "in use" if granted else "not in use"
    return Line(
        "huge pages",
        f"transparent huge pages '{mode}'; attnlab asks for 2 MB pages with madvise (a decode "
        f"step's weights, large outputs): {in_use} ({got})",
        {**values, "in_use": bool(granted)},
    )


def caches_line() -> Line:
    from huggingface_hub import constants

    root = cache_root()
    kept = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    measured = len(list(machine.cache_dir().glob("*.json"))) if machine.cache_dir().is_dir() else 0
    return Line(
        "caches",
        f"models from the Hugging Face Hub in {constants.HF_HUB_CACHE} (HF_HUB_CACHE); "
        f"attnlab's own in {root} (ATTNLAB_CACHE: {_listed(kept)}; measured choices kept: "
        f"{measured})",
        {"hub": str(constants.HF_HUB_CACHE), "attnlab": str(root), "measured": measured},
    )


TOPICS: list[Callable[[], Line]] = [
    machine_line,
    instruction_sets_line,
    threads_line,
    torch_line,
    compiler_line,
    kernels_line,
    openmp_line,
    float_products_line,
    decode_layout_line,
    bfloat16_line,
    huge_pages_line,
    caches_line,
]


def report() -> list[Line]:
    """One Line per topic of TOPICS; a topic that raises is a line saying what failed. The
    slower-path lines the kernels' choice says elsewhere (attnlab.slower) are not said again: the
    report's own lines say it."""
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", slower.SlowerPath)
        for topic in TOPICS:
            lines.append(_line(topic))
    return lines


def _line(topic: Callable[[], Line]) -> Line:
    name = topic.__name__.removesuffix("_line").replace("_", " ")
    try:
        return topic()
    # a report of the machine must not die of what it reports: the failure is its line
    except Exception as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return Line(name, f"could not be read ({why})", {"error": why})


def run_doctor(args: argparse.Namespace) -> int:
    lines = report()
    if args.json:
        json.dump({line.topic: {"line": line.text, **line.values} for line in lines}, sys.stdout)
        print()
    else:
        print("\n".join(str(line) for line in lines))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="what this machine is, and which paths attnlab chose on it and why",
        description="Print this machine (CPU, instruction sets, threads, torch and its libraries) "
        "and what attnlab chose on it (the kernels' build, the float product path, bfloat16 for "
        "Muon, huge pages) with the reason for each, measured once per machine where the machine "
        "does not settle it.",
    )
    p.add_argument("--json", action="store_true", help="the same as one JSON object")
    p.set_defaults(func=run_doctor)
