"""Two choices of the block decode path, each against its alternative in the same process: the
16-row layout (ATTNLAB_DECODE_LAYOUT=16-row: Q8_0, Q4_0, Q4_1, Q5_0 and Q4_K where the build's
16-row product is vectorised) against the file's own layout (generation takes the one that won
a race of one product, kernels.repack16_chosen; this is the whole step), and greedy generation's
loop in C (KernelDecoder.generate_greedy) against generate's Python loop around the same step
(forced by an on_token callback). tg128 as llama-bench defines it: 128 greedy tokens from one
token and an empty cache.

    .venv/bin/python benchmarks/decode_ab.py                          # SmolLM2's shipped Q4_1
    .venv/bin/python benchmarks/decode_ab.py --files q4_0=FILE q8_0=FILE --builds avx512 avx2

Each round runs every variant once per file and build, alternating; the table shows medians over
--rounds and the ratios (a shared machine moves rates, less their ratios).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line  # noqa: E402

import attnlab  # noqa: E402
from attnlab.errors import UserError  # noqa: E402
from attnlab.generate import kernels  # noqa: E402
from attnlab.generate.loop import generate  # noqa: E402

VARIANTS = {
    # (repacked, the loop in C)
    "16-row layout, loop in C": (True, True),
    "file's layout, loop in C": (False, True),
    "16-row layout, Python loop": (True, False),
}


def tg128(model, repack: bool, in_c: bool) -> float:
    os.environ["ATTNLAB_DECODE_LAYOUT"] = "16-row" if repack else "file"
    one = torch.tensor([[1]])
    start = time.perf_counter()
    generate(model, one, 128, temperature=0, on_token=None if in_c else len)
    return 128 / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=["q4_1=smollm2"], help="name=GGUF file")
    parser.add_argument("--builds", nargs="+", default=[None], help="kernels builds (default: its)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    models = {}
    for item in args.files:
        name, _, file = item.partition("=")
        try:
            models[name] = attnlab.load(file, keep_blocks=True)
        except UserError as error:  # a file or name that is not a model: one line, exit 1
            raise SystemExit(f"decode_ab.py: --files {item}: {error}") from None
    rates: dict[tuple, list[float]] = {}
    for build in args.builds:  # warm: kernels built, weights repacked and in 2 MB pages
        kernels.use_variant(build)
        for model in models.values():
            for repack, in_c in VARIANTS.values():
                tg128(model, repack, in_c)
    for _ in range(args.rounds):
        for build in args.builds:
            kernels.use_variant(build)
            for name, model in models.items():
                for variant, (repack, in_c) in VARIANTS.items():
                    key = (build or kernels.variant(), name, variant)
                    rates.setdefault(key, []).append(tg128(model, repack, in_c))
    kernels.use_variant(None)
    os.environ.pop("ATTNLAB_DECODE_LAYOUT")
    print(f"{machine_line()}; medians of {args.rounds} alternating rounds, tg128 tokens/s\n")
    print("| build | file | " + " | ".join(VARIANTS) + " | layout × | loop × |")
    print("|---|---|" + "---:|" * (len(VARIANTS) + 2))
    for build in args.builds:
        build = build or kernels.variant()
        for name in models:
            med = [statistics.median(rates[(build, name, v)]) for v in VARIANTS]
            print(
                f"| {build} | {name} | "
                + " | ".join(f"{m:.1f}" for m in med)
                + f" | {med[0] / med[1]:.2f} | {med[0] / med[2]:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
