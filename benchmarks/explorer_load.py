"""Load test of the explorer's bounded queue: fixed concurrency and request count, a hard deadline,
loopback only.

    .venv/bin/python benchmarks/explorer_load.py [--model minilm] [--queue 4] [--requests 200]
    [--rounds 3]

Starts `attnlab explore MODEL --port 0 --queue C` (127.0.0.1, a process of its own, so its memory is
its own) and runs, round after round, three phases in turn:
- anchor: 2C clients fetching /static/style.css, an HTTP round trip with no model work (the baseline
  the refusals are compared with);
- at capacity: C clients, each sending its next request when the last is answered: every request
  must
  succeed (200);
- at twice capacity: 2C clients: the excess is refused at once (503 with Retry-After) and every
  other request succeeds; nothing else may happen. A refused client asks again 10 ms later
  (pressure, not politeness), and the phase runs until as many requests are served as at capacity.
Each client keeps one connection (HTTP keep-alive, as a browser does); the requests rotate through
the pattern, heads, projection and trace views (and next token for a causal model) on a different
text each time, so nothing can be answered from a cache. The server's resident memory (VmRSS) is
read after a
warm-up and at the end: the two must be within 10 %. A deadline (--deadline, default 600 s) bounds
the whole run; past it the script stops with exit 1.

Prints the machine and the load average, a table of latencies (every round pooled; the refusals'
apart
from the successes': p50, p90, p99, the slowest), how many 503s came within 50 ms, the server's RSS
before and after, and the promises kept or broken; --json writes every number. Exit 1 when a promise
is broken. The figures in benchmarks/README.md come from the plain command above; a run on an idle
machine is the one that can speak for the 50 ms (on a crowded one a refusal waits for a core like
everything else).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = "The cat sat on the mat because it was tired"
# A refused client asks again after 10 ms (not the 1 s its Retry-After says, to keep the queue under
# pressure); at twice the capacity the phase runs until `requests` are served, refusals up to 20 x
# that.
RETRY_PAUSE_S = 0.010
REFUSALS_CAP = 20


def percentile(xs: list[float], q: int) -> float | None:
    """The q-th percentile of xs (inclusive method), rounded; None when empty."""
    if len(xs) < 2:
        return round(xs[0], 2) if xs else None
    return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 2)


@dataclass
class Phase:
    name: str
    clients: int
    requests: int
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    ok_ms: list[float] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)
    busy_without_retry_after: int = 0
    served_only: bool = False  # the phase ends after `requests` 200s (refusals not counted)

    def summary(self) -> dict:
        return {
            "phase": self.name,
            "clients": self.clients,
            "requests": self.requests,
            "seconds": round(self.seconds, 3),
            "statuses": self.statuses,
            "errors": len(self.errors),
            "ok_p50_ms": percentile(self.ok_ms, 50),
            "ok_p99_ms": percentile(self.ok_ms, 99),
            "busy_p50_ms": percentile(self.busy_ms, 50),
            "busy_p99_ms": percentile(self.busy_ms, 99),
            "busy_max_ms": round(max(self.busy_ms), 2) if self.busy_ms else None,
            "busy_without_retry_after": self.busy_without_retry_after,
        }


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def request_bodies(url: str) -> tuple[str, list[tuple[str, dict]]]:
    """The served model's name and the views' request bodies (all but the model and the text)."""
    connection = http.client.HTTPConnection(*address(url), timeout=60)
    connection.request("GET", "/api/models")
    models = json.loads(connection.getresponse().read())
    connection.close()
    info = models[0]
    layer, head = info["n_layers"] - 1, 0
    views = [
        ("/api/pattern", {"layer": layer, "head": head, "encoding": "f32"}),
        ("/api/heads", {}),
        ("/api/projection", {"layer": layer, "head": head}),
        ("/api/trace", {"layer": layer, "token": 0}),
    ]
    if info["causal"]:
        views.append(("/api/next", {"k": 10}))
    return info["name"], views


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname != "127.0.0.1":
        raise SystemExit(f"loopback only: {url}")
    return parts.hostname, parts.port


def run_phase(url: str, phase: Phase, work, deadline: float, counter: list[int]) -> Phase:
    """`phase.clients` threads, each with one keep-alive connection, share `phase.requests`
    requests."""
    host, port = address(url)
    lock = threading.Lock()
    taken = [0]
    barrier = threading.Barrier(phase.clients)

    def done() -> bool:
        # `requests` answered 200, whatever the number of refusals (up to a cap)
        if phase.served_only:
            return len(phase.ok_ms) >= phase.requests or taken[0] >= REFUSALS_CAP * phase.requests
        return taken[0] >= phase.requests

    def client() -> None:
        connection = http.client.HTTPConnection(
            host, port, timeout=max(1.0, deadline - time.monotonic())
        )
        barrier.wait()
        while True:
            with lock:
                if done() or time.monotonic() > deadline:
                    break
                taken[0] += 1
                counter[0] += 1
                n = counter[0]
            method, path, body = work(n)
            start = time.perf_counter()
            try:
                if body is None:
                    connection.request(method, path)
                else:
                    connection.request(
                        method, path, json.dumps(body), {"Content-Type": "application/json"}
                    )
                response = connection.getresponse()
                response.read()
                ms = (time.perf_counter() - start) * 1e3
            except (OSError, http.client.HTTPException) as exc:
                with lock:
                    phase.errors.append(f"{type(exc).__name__}: {exc}")
                connection.close()
                connection = http.client.HTTPConnection(
                    host, port, timeout=max(1.0, deadline - time.monotonic())
                )
                continue
            with lock:
                key = str(response.status)
                phase.statuses[key] = phase.statuses.get(key, 0) + 1
                if response.status == 200:
                    phase.ok_ms.append(ms)
                elif response.status == 503:
                    phase.busy_ms.append(ms)
                    phase.busy_without_retry_after += response.getheader("Retry-After") is None
            if response.status == 503:
                time.sleep(RETRY_PAUSE_S)
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(phase.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    phase.seconds = time.perf_counter() - start
    if time.monotonic() > deadline:
        raise SystemExit(f"the hard deadline passed during {phase.name}: stopping")
    return phase


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="minilm", help="a model directory or bundled name (default minilm)"
    )
    parser.add_argument("--queue", type=int, default=4, help="the queue's capacity C (default 4)")
    parser.add_argument(
        "--requests", type=int, default=200, help="requests per phase and round (default 200)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the three phases (default 3)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=600,
        help="hard limit on the whole run, seconds (default 600)",
    )
    parser.add_argument("--json", help="write every number here")
    parser.add_argument(
        "--no-machine", action="store_true", help="skip the matmul and copy measurements (tests)"
    )
    from _common import add_results_argument, figure, machine_description, write_result

    import attnlab

    add_results_argument(parser)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.deadline
    load_before = round(os.getloadavg()[0], 2)
    description = machine_description()

    machine = {}
    if not args.no_machine:
        from _common import copy_bandwidth, machine_line
        from train_speed import measure_matmul_peak

        machine = {
            "machine": machine_line(),
            "matmul_gflops": round(measure_matmul_peak() / 1e9, 1),
            "copy_gbs": round(copy_bandwidth() / 1e9, 1),
        }
        print(
            f"# Explorer load\n{machine['machine']}\nmatmul {machine['matmul_gflops']} GFLOP/s, "
            f"copy {machine['copy_gbs']} GB/s"
        )

    from attnlab.explorer.testing import explorer_process

    with ExitStack() as stack:
        try:
            process, url = stack.enter_context(
                explorer_process(args.model, "--queue", str(args.queue))
            )
        # its one line (an unknown model, ...), as the command itself prints it
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        if time.monotonic() > deadline:
            raise SystemExit("the explorer did not start before the deadline")
        name, views = request_bodies(url)

        def model_work(n: int):
            path, extra = views[n % len(views)]
            return "POST", path, {"model": name, "text": f"{TEXT} ({n}).", **extra}

        def anchor_work(n: int):
            return "GET", "/static/style.css", None

        counter = [0]
        C = args.queue
        run_phase(url, Phase("warm-up", C, 4 * len(views) * C), model_work, deadline, counter)
        rss_before = rss_bytes(process.pid)
        rounds, phases_run = [], []
        for r in range(args.rounds):
            phases = [
                run_phase(
                    url, Phase("anchor", 2 * C, args.requests), anchor_work, deadline, counter
                ),
                run_phase(url, Phase("capacity", C, args.requests), model_work, deadline, counter),
                run_phase(
                    url,
                    Phase("twice", 2 * C, args.requests, served_only=True),
                    model_work,
                    deadline,
                    counter,
                ),
            ]
            rounds.append([p.summary() for p in phases])
            phases_run.append(phases)
            print(
                f"round {r + 1}: "
                + "; ".join(f"{p.name} {p.statuses} {len(p.errors)} errors" for p in phases),
                flush=True,
            )
        rss_after = rss_bytes(process.pid)

    # Every round's latencies pooled (a 503's distribution apart from the successes'): the promise
    # is about each refusal, so its percentiles and its slowest are over all of them, not medians of
    # rounds.
    pooled = {
        phase: [p for rnd in phases_run for p in rnd if p.name == phase]
        for phase in ("anchor", "capacity", "twice")
    }
    statuses: dict[str, dict[str, int]] = {phase: {} for phase in pooled}
    for phase, runs in pooled.items():
        for p in runs:
            for k, v in p.statuses.items():
                statuses[phase][k] = statuses[phase].get(k, 0) + v
    errors = {phase: sum(len(p.errors) for p in runs) for phase, runs in pooled.items()}
    latencies = {
        (phase, kind): [ms for p in runs for ms in (p.ok_ms if kind == "ok" else p.busy_ms)]
        for phase, runs in pooled.items()
        for kind in ("ok", "busy")
    }
    refusals = latencies["twice", "busy"]
    busy_max = round(max(refusals), 2) if refusals else None
    within = sum(ms < 50 for ms in refusals)
    promises = {
        "capacity: every request 200": set(statuses["capacity"]) == {"200"}
        and errors["capacity"] == 0,
        "twice: only 200 and 503, some of each": set(statuses["twice"]) == {"200", "503"}
        and errors["twice"] == 0,
        "twice: every 503 has Retry-After": all(
            p.busy_without_retry_after == 0 for p in pooled["twice"]
        ),
        "twice: every 503 within 50 ms": busy_max is not None and busy_max < 50,
        "memory: RSS after within 10% of before": abs(rss_after - rss_before) <= 0.1 * rss_before,
    }
    table = [
        ("anchor: GET /static/style.css", "anchor", "ok"),
        ("at capacity", "capacity", "ok"),
        ("at twice capacity: served (200)", "twice", "ok"),
        ("at twice capacity: refused (503)", "twice", "busy"),
    ]
    print(
        f"\nmodel {name}, queue capacity C={C}, {args.requests} requests per phase, {args.rounds} "
        "rounds "
        f"(latencies of every round pooled; load average {load_before} before, "
        f"{os.getloadavg()[0]:.1f} at the end)\n"
    )
    print("| phase | clients | responses | p50 ms | p90 ms | p99 ms | max ms |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for label, phase, kind in table:
        clients = C if phase == "capacity" else 2 * C
        xs = latencies[phase, kind]
        counts = ", ".join(f"{v} × {k}" for k, v in sorted(statuses[phase].items()))
        if phase == "twice":
            counts = (
                f"{statuses[phase].get('503' if kind == 'busy' else '200', 0)} × "
                f"{'503' if kind == 'busy' else '200'}"
            )
        print(
            f"| {label} | {clients} | {counts} | {percentile(xs, 50)} | {percentile(xs, 90)} | "
            f"{percentile(xs, 99)} | "
            f"{round(max(xs), 1) if xs else None} |"
        )
    print(
        f"\n503s within 50 ms: {within} of {len(refusals)}"
        f"{f' ({100 * within / len(refusals):.1f} %)' if refusals else ''}; slowest 503 "
        f"{busy_max} ms"
    )
    print(
        f"server RSS {rss_before / 2**20:.1f} MiB after the warm-up, {rss_after / 2**20:.1f} MiB "
        "at the end "
        f"({(rss_after / rss_before - 1) * 100:+.1f} %)"
    )
    for promise, kept in promises.items():
        print(f"{'kept  ' if kept else 'BROKEN'} {promise}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    **machine,
                    "model": name,
                    "queue": C,
                    "requests": args.requests,
                    "rounds": rounds,
                    "statuses": statuses,
                    "errors": errors,
                    "rss_before": rss_before,
                    "rss_after": rss_after,
                    "busy_max_ms": busy_max,
                    "busy_within_50_ms": within,
                    "load_average": [load_before, round(os.getloadavg()[0], 2)],
                    "pooled_ms": {
                        f"{phase} {kind}": {q: percentile(xs, q) for q in (50, 90, 99)}
                        for (phase, kind), xs in latencies.items()
                        if xs
                    },
                    "promises": promises,
                },
                indent=1,
            )
        )
    if machine:
        description.update(
            copy_bandwidth=machine["copy_gbs"] * 1e9, matmul_flops=machine["matmul_gflops"] * 1e9
        )
    anchor_ok = latencies["anchor", "ok"]
    write_result(
        args.results,
        "explorer_load",
        measures="The explorer's bounded queue under load: latencies at capacity and refusals "
        "(503) at twice capacity, beside an HTTP round trip with no model work (GET "
        "/static/style.css) as the anchor.",
        anchor="a static file's round trip",
        anchor_version=attnlab.__version__,
        figures=[
            figure(
                f"{label}, p50",
                "ms",
                percentile(latencies[phase, kind], 50),
                percentile(anchor_ok, 50),
                "lower",
            )
            for label, phase, kind in table[1:]
            if latencies[phase, kind]
        ]
        + [
            figure("503s within 50 ms", "%", 100 * within / len(refusals) if refusals else 0.0),
        ],
        setup=f"{name}, queue {C}, {args.requests} requests x {args.rounds} rounds",
        machine=description,
        details={"promises": promises, "statuses": statuses, "busy_max_ms": busy_max},
    )
    return 0 if all(promises.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
