"""How OpenMP's waiting threads behave on a busy machine: libgomp's spin count, measured.

libgomp (the OpenMP runtime torch's wheel ships, and attnlab's C kernels share) lets a thread that
waits at a barrier or for the next parallel region spin GOMP_SPINCOUNT times before it sleeps:
300,000 by default (a few milliseconds), but only 100 when the process has more OpenMP threads than
the machine has CPUs (libgomp/config/linux/wait.h, `do_spin`; the defaults in libgomp/env.c). On a
machine whose cores other processes also want, a thread that spins while the thread it waits for
has been descheduled burns its time slice, and every barrier can cost a scheduler tick. A fresh
Python thread happens to get the short spin (its pool's threads make the count exceed the CPUs),
the main thread the long one: the same decode loop ran 5-20x faster in a thread than in the main
thread of the same process under load.

Each setting runs in its own process (libgomp reads the variable once, when it loads), idle and
beside a busy core (one process spinning in a Python loop, as a compile or a browser tab would),
settings alternated, the median of --repeats:
- decode: SmolLM2's shipped Q4_1 file kept as blocks, 128 greedy tokens after a short prompt
  (the C decode program, two threads), in the main thread as `attnlab sample` runs it;
- decode-thread: the same in a thread started for it, as the explorer's generation stream runs it;
- linear: a 576 x 1536 float32 product through the C kernels, 2,000 calls (one parallel region
  each: the per-call cost of starting and joining a team);
- train: 20 steps of attnlab's nano model on random tokens (torch's own OpenMP regions).

    .venv/bin/python benchmarks/spin_wait.py --settings default 10000 1000 0 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORK = r"""
import json, sys, time, torch
what = sys.argv[1]
if what.startswith("decode"):
    import threading
    import attnlab
    model = attnlab.load("smollm2", keep_blocks=True)
    ids = torch.tensor([model.tokenizer.encode("The cat sat on the mat because it was")])
    def decode():
        model.generate(ids, 8)
        t = time.perf_counter(); model.generate(ids, 128); return 128 / (time.perf_counter() - t)
    if what == "decode":
        rate = decode()
    else:  # as the explorer generates: in a thread of its own
        out = []
        thread = threading.Thread(target=lambda: out.append(decode()))
        thread.start()
        thread.join()
        rate = out[0]
elif what == "linear":
    from attnlab.generate import kernels
    x, w = torch.randn(1, 576), torch.randn(1536, 576)
    for _ in range(200): kernels.linear(x, w)
    t = time.perf_counter()
    for _ in range(2000): kernels.linear(x, w)
    rate = 2000 / (time.perf_counter() - t)
else:
    import attnlab
    from attnlab.model.config import ModelConfig
    torch.manual_seed(0)
    config = ModelConfig(n_layers=4, n_heads=4, d_model=128, d_mlp=512, n_ctx=64, d_vocab=65)
    model = attnlab.Transformer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (12, 64))
    def step():
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(); loss.backward(); opt.step()
    for _ in range(3): step()
    t = time.perf_counter()
    for _ in range(20): step()
    rate = 20 / (time.perf_counter() - t)
print(json.dumps({"rate": rate}))
"""

UNITS = {"decode": "tokens/s", "decode-thread": "tokens/s", "linear": "calls/s", "train": "steps/s"}


def run(what: str, setting: str) -> float:
    env = dict(os.environ)
    env.pop("GOMP_SPINCOUNT", None)
    if setting != "default":
        env["GOMP_SPINCOUNT"] = setting
    out = subprocess.run(
        [sys.executable, "-c", WORK, what], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["rate"]


def main() -> int:
    from _common import machine_line

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["default", "10000", "1000", "0"])
    parser.add_argument("--work", nargs="+", choices=tuple(UNITS), default=list(UNITS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--conditions", nargs="+", choices=("idle", "busy"), default=["idle", "busy"]
    )
    args = parser.parse_args()
    print(machine_line())
    rows = []
    for condition in args.conditions:
        busy = None
        if condition == "busy":
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1)
        try:
            for what in args.work:
                rates = {s: [] for s in args.settings}
                for _ in range(args.repeats):
                    for setting in args.settings:
                        rates[setting].append(run(what, setting))
                base = statistics.median(rates[args.settings[0]])
                for setting in args.settings:
                    m = statistics.median(rates[setting])
                    rows.append((condition, what, setting, m, m / base))
                    print(
                        f"{condition:5} {what:13} GOMP_SPINCOUNT={setting:8} "
                        f"{m:9.1f} {UNITS[what]}  x{m / base:.2f}",
                        flush=True,
                    )
        finally:
            if busy is not None:
                busy.kill()
    print(f"\n| condition | work | GOMP_SPINCOUNT | rate | vs {args.settings[0]} |")
    print("|---|---|---|---:|---:|")
    for condition, what, setting, m, ratio in rows:
        print(f"| {condition} | {what} ({UNITS[what]}) | {setting} | {m:.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
