"""Where a block decode step's time goes: SmolLM2-135M's step program taken apart, each part timed
against the whole in alternating rounds, beside the bytes it streams and the read bandwidth.

    .venv/bin/python benchmarks/decode_profile.py                       # the shipped Q4_1 file
    .venv/bin/python benchmarks/decode_profile.py --files q4_0=FILE q8_0=FILE --threads 1 2

Design choices:
- The parts are programs built from the decode step's own prepared calls
  (KernelDecoder(...).run): the whole step; the step without its barriers (every op `independent`:
  wrong numbers, the time the threads spend waiting for each other is what it saves); the products
  only (with their barriers); the products without the LM head; the LM head alone; everything but
  the products (norms, RoPE, attention, SwiGLU); the products with d_out cut to four rows, which
  still round their input to 8 bits (quantize_row_q8) but stream almost no weights: the activation
  rounding's cost; and the first block's products repeated as often as the step has products
  (their weights then come from the caches): the products' compute time without the memory.
- Each part runs `--steps` times back to back per measurement (one step at a fixed cache slot, as
  tg128's middle), the parts alternate within each round, medians over `--rounds`: a shared
  machine moves absolute times, less their ratios. `--clock cpu` reads the process's CPU time
  (divided by the threads): on a crowded host, with one thread, near what an idle core takes.
- The bound: bytes the part streams / the read bandwidth (kernels.read_bandwidth, measured at the
  start and the end).
- `--against FILE`: another build of the kernels: its unity file, with the files it includes
  beside it (say main's: `git archive main src/attnlab/generate/kernels/c | tar -x -C /tmp/main`,
  then `--against /tmp/main/src/attnlab/generate/kernels/c/kernels.c`; before the split, one
  decode.c held them all), built with this process's flags: this source's whole step, and its
  products with weights in cache, against that one's (same model, same weights in memory), A/B in
  one process, in rounds of their own after the parts', each on a decoder of its own, taking
  turns at going first. (As one more part of the parts' rounds, where the parts' decoder has its
  KV cache and activations warm in the caches, the same source read far from 1.0x itself:
  benchmarks/README.md, decode_profile.py's A/B.)
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CLOCKS, machine_line  # noqa: E402

import attnlab  # noqa: E402
from attnlab.errors import UserError  # noqa: E402
from attnlab.generate import kernels  # noqa: E402
from attnlab.generate.kernel_decoder import KernelDecoder  # noqa: E402
from attnlab.generate.kv_cache import KVCache  # noqa: E402

D_OUT = 7  # index of d_out among a LINEAR_Q call's arguments (kernels.FUNCTIONS)


def variant(call: kernels.Call, wait: bool | None = None, d_out: int | None = None):
    """A copy of `call` with its barrier and (a product's) output rows changed."""
    new = copy.copy(call)
    new.values = list(call.values)
    if wait is not None:
        new.wait = wait
    if d_out is not None:
        new.values[D_OUT] = min(d_out, call.values[D_OUT])
    return new


def parts(decoder: KernelDecoder, threads: int) -> dict[str, tuple[kernels.Program, int]]:
    """{name: (program, bytes of weights it streams)} of the step's parts (module docstring)."""
    (step,) = [p for p in decoder.run if isinstance(p, kernels.Program)]
    calls = step.calls
    linear = [c for c in calls if c.kind == kernels.Op.LINEAR_Q]
    other = [c for c in calls if c.kind != kernels.Op.LINEAR_Q]
    head = linear[-1]
    per_block = (len(linear) - 1) // len(decoder.model.blocks)

    def weight_bytes(cs):
        # rows multiplied (values[D_OUT]) times bytes per row
        return sum(
            c.values[D_OUT] * c.tensors[1].shape[1] for c in cs if c.kind == kernels.Op.LINEAR_Q
        )

    chosen = {
        "whole step": calls,
        "no barriers": [variant(c, wait=False) for c in calls],
        "products": linear,
        "products, no head": linear[:-1],
        "LM head": [head],
        "not products": other,
        "products, 4 rows each": [variant(c, d_out=4) for c in linear],
        # as many products, the first block's over and over: its weights stay in the caches
        "products, weights in cache": [linear[i % per_block] for i in range(len(linear) - 1)],
    }
    return {
        name: (kernels.Program([variant(c) for c in cs], threads), weight_bytes(cs))
        for name, cs in chosen.items()
    }


def other_library(source: Path) -> ctypes.CDLL:
    """The kernels of `source` (a unity file, or an older single decode.c) built with this
    process's flags, the functions a step program calls declared (an older source may lack newer
    ones that kernels.load declares)."""
    flags = kernels.VARIANTS[kernels.variant()][0]
    path = kernels.compile_library(source, (flags,))
    if path is None:
        raise SystemExit(f"--against {source}: it does not compile with {' '.join(flags)}")
    functions = ["attnlab_run", "attnlab_linear_q_scratch", "attnlab_dequantize"]
    return kernels.declare(ctypes.CDLL(str(path)), [op.function for op in kernels.Op] + functions)


def warm_decoder(model) -> KernelDecoder:
    """The step of `model` after 64 tokens, its cache slot then fixed at 64."""
    decoder = KernelDecoder(model, KVCache.for_model(model, 1, 256, values_position_minor=False))
    for t in range(64):
        decoder(torch.tensor([[100 + t]]), t, torch.tensor([[t]]))
    decoder.slot.fill_(64)
    return decoder


def timed_rounds(programs: dict, args, threads: int) -> dict[str, list[float]]:
    """{name: seconds per step, one per round} of `programs` ({name: (program, _)}) run in
    rounds, each round starting one program later (a program's place in a round moves its time)."""
    tick, keys = CLOCKS[args.clock], list(programs)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for r in range(args.rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            program = programs[key][0]
            program()
            start = tick()
            for _ in range(args.steps):
                program()
            elapsed = (tick() - start) / args.steps
            times[key].append(elapsed / (threads if args.clock == "cpu" else 1))
    return times


def steps_of(model, threads: int, library=None) -> dict[str, tuple[kernels.Program, int]]:
    """The whole step and its products with weights in cache (`parts`) of a decoder of its own
    (warm_decoder), built with `library`'s kernels (None: this process's)."""
    library = library or kernels.library()
    with mock.patch.object(kernels, "library", lambda: library):
        chosen = parts(warm_decoder(model), threads)
    return {key: chosen[key] for key in ("whole step", "products, weights in cache")}


def profile(name: str, file: str | Path, threads: int, args, read: float) -> list:
    steps, rounds = args.steps, args.rounds
    torch.set_num_threads(threads)
    try:
        model = attnlab.load(file, keep_blocks=True)
    except UserError as error:  # a file or name that is not a model: one line, exit 1
        raise SystemExit(f"decode_profile.py: --files {name}={file}: {error}") from None
    programs = parts(warm_decoder(model), threads)
    times = timed_rounds(programs, args, threads)
    whole = statistics.median(times["whole step"])
    lines = [
        f"\n### {name}, {threads} thread(s): {1 / whole:.1f} steps/s, median of {rounds} rounds "
        f"of {steps} steps, {args.clock} clock",
        "",
        "| part | ms per step | of the step | MiB of weights | GB/s | at the read bandwidth (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, (_, nbytes) in programs.items():
        t = statistics.median(times[key])
        rate = f"{nbytes / t / 1e9:.1f}" if nbytes > 2**20 else "–"
        lines.append(
            f"| {key} | {1e3 * t:.3f} | {100 * t / whole:.0f} % | {nbytes / 2**20:.1f} | {rate} | "
            f"{1e3 * nbytes / read:.3f} |"
        )
    if args.against:
        this, other = steps_of(model, threads), steps_of(model, threads, args.against_library)
        pair = {
            (who, key): p for who, ps in (("this", this), ("other", other)) for key, p in ps.items()
        }
        ab = timed_rounds(pair, args, threads)
        for key in this:
            a, b = ab[("this", key)], ab[("other", key)]
            lines.append(
                f"\nthis source's {key} {1e3 * statistics.median(a):.3f} ms, "
                f"{args.against.name}'s {1e3 * statistics.median(b):.3f} ms: "
                f"**{statistics.median(y / x for x, y in zip(a, b)):.3f}x** as fast (median of "
                f"{rounds} rounds' ratios, a decoder each)"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=None, help="name=GGUF file (default: q4_1)")
    parser.add_argument("--threads", nargs="+", type=int, default=[2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--clock", choices=CLOCKS, default="wall", help="cpu: process time / threads (loaded host)"
    )
    parser.add_argument(
        "--against", type=Path, default=None, help="another build's kernels.c (or decode.c) to A/B"
    )
    args = parser.parse_args()
    if args.files is None:
        from attnlab.formats import model_dir

        files = {"q4_1": model_dir("smollm2")}
    else:
        files = dict(item.split("=", 1) for item in args.files)
    if not kernels.available():
        raise SystemExit("attnlab's C kernels are not built here: nothing to profile")
    if args.against:
        args.against_library = other_library(args.against)
    read = kernels.read_bandwidth()
    lines = [
        "# benchmarks/decode_profile.py",
        machine_line(),
        f"attnlab's kernels: the {kernels.variant()} build; read bandwidth {read / 1e9:.1f} GB/s "
        "(kernels.read_bandwidth)",
    ]
    for name, file in files.items():
        for threads in args.threads:
            lines += profile(name, file, threads, args, read)  # a path or a bundled name
    lines.append(f"\nread bandwidth at the end {kernels.read_bandwidth() / 1e9:.1f} GB/s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
