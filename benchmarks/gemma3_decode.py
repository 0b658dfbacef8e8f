"""Gemma 3 270M generating: the C decode program (the default) against the module path, on the
shipped file.

.venv/bin/python benchmarks/gemma3_decode.py [--new-tokens 128] [--repeats 3] [--threads 2]

Design choices:
- The same model object, prompt and greedy decoding on both sides; only `use_kernels` differs.
  The two runs alternate within each of --repeats rounds (after one untimed run of each), and the
  table gives each side's median tokens/s and their ratio, measured in the same process.
- The greedy tokens of both sides are printed side by side as "same" or the first position where
  they part: the two paths add in different orders, so a near-tie could go either way.
- A plain prompt of 17 tokens, longer than loop.PREFILL_IN_STEPS: both sides run it through the
  module path's prefill, and the time (prompt and new tokens together) differs by the decode steps.
- The tied LM head is a float32 copy of the 262,144 x 640 table (671 MB) that every step reads on
  both sides, so the ratio is bounded by that shared read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line  # noqa: E402

import attnlab  # noqa: E402
from attnlab.generate.kernel_decoder import KernelDecoder  # noqa: E402
from attnlab.generate.loop import generate  # noqa: E402

PROMPT = "The cat sat on the mat because it was tired. The capital of France is"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = attnlab.load("gemma3-270m")
    assert KernelDecoder.unsupported(model) is None, KernelDecoder.unsupported(model)
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    print(f"# Gemma 3 270M generating\n{machine_line()}")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; prompt {ids.shape[1]} tokens, "
        f"{args.new_tokens} greedy tokens, median of {args.repeats}\n"
    )
    sides = {"C decode program (default)": True, "module path (use_kernels=False)": False}
    times = {name: [] for name in sides}
    tokens = {}
    for round in range(args.repeats + 1):
        for name, kernels in sides.items():
            start = time.perf_counter()
            out = generate(model, ids, args.new_tokens, temperature=0, use_kernels=kernels)
            if round:  # the first round warms up (builds the kernels, fills the caches)
                times[name].append(time.perf_counter() - start)
            tokens[name] = out[0, ids.shape[1] :].tolist()
    ours, theirs = tokens.values()
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print("| path | tokens/s | ratio to the module path |")
    print("|---|---|---|")
    module = args.new_tokens / statistics.median(times["module path (use_kernels=False)"])
    for name in sides:
        rate = args.new_tokens / statistics.median(times[name])
        print(f"| {name} | {rate:.1f} | {rate / module:.2f}x |")
    print(
        "\ngreedy tokens: "
        + ("the same" if parted is None else f"part at new token {parted}")
        + f" ({len(ours)} tokens)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
