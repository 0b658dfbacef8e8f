"""Float32 products on AMX tiles against torch's (MKL's) float32 GEMM, on SmolLM2's shapes.

attnlab's AMX product (c/amx.c, attnlab_linear_amx_many; kernels.linear_amx) splits each float32
value into three bfloat16 parts and sums six products of parts in float32: a float32 GEMM's
accuracy on the tiles. For each of SmolLM2-135M's products of a 4 x 256-token forward pass
(1,024 rows), and a layer's q, k, v and its gate, up in one call each (as forward passes take
them), this prints the median time of both (the two alternating, each allocating its outputs as a
forward pass does: `kernels.linear_amx_many` against `F.linear`), their ratio, and each one's
largest error against float64 relative to max |y|.

    .venv/bin/python benchmarks/amx_products.py --repeats 9

Where the CPU or its operating system does not allow AMX, it says why and exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line  # noqa: E402

from attnlab.generate import kernels  # noqa: E402

ROWS = 1024
# (what, d_in, the d_out of each matrix that shares x): SmolLM2's products
PRODUCTS = [
    ("q or o", 576, [576]),
    ("k or v alone", 576, [192]),
    ("q, k, v in one call", 576, [576, 192, 192]),
    ("gate or up alone", 576, [1536]),
    ("gate, up in one call", 576, [1536, 1536]),
    ("down", 1536, [576]),
    ("LM head", 576, [49152]),
]


def timed(runs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs alternating, after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    reference = x.double() @ w.double().T
    return ((y.double() - reference).abs().max() / reference.abs().max()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    why = kernels.amx_unusable() if kernels.available() else "attnlab's C kernels are not built"
    if why is not None:
        print(f"amx_products: no AMX product here: {why}", file=sys.stderr)
        return 1
    print(machine_line())
    print(f"{ROWS} rows, medians of {args.repeats} alternating rounds\n")
    print("| product | K x N | AMX (ms) | MKL float32 (ms) | MKL / AMX | error AMX | error MKL |")
    print("|---|---|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for what, d_in, d_outs in PRODUCTS:
        x = torch.randn(ROWS, d_in, generator=g)
        ws = [torch.randn(n, d_in, generator=g) for n in d_outs]

        def amx(x=x, ws=ws):
            return kernels.linear_amx_many(x, [(w, None) for w in ws])

        def mkl(x=x, ws=ws):
            return [F.linear(x, w) for w in ws]

        seconds = timed({"amx": amx, "mkl": mkl}, args.repeats)
        together = kernels.linear_amx_many(x, [(w, None) for w in ws])
        errors = [
            max(error(y, x, w) for y, w in zip(together, ws, strict=True)),
            max(error(F.linear(x, w), x, w) for w in ws),
        ]
        shape = f"{d_in} x {sum(d_outs)}"
        print(
            f"| {what} | {shape} | {seconds['amx'] * 1e3:.2f} | {seconds['mkl'] * 1e3:.2f} | "
            f"{seconds['mkl'] / seconds['amx']:.2f} | {errors[0]:.1e} | {errors[1]:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
