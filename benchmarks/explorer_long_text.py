"""A 2,048-token text in the explorer, in headless Chromium: what the page receives and how soon it
draws.

    .venv/bin/python benchmarks/explorer_long_text.py [--rounds 3] [--tokens 2048] [--json out.json]

Serves the browser tests' random LLaMA-style model (2 layers, 4 heads, a character tokenizer:
imported from tests/explorer_models.py) with `attnlab explore DIR --port 0` (a process of its own,
as a user runs it:
attnlab.explorer.testing.explorer_process) and opens the page in Debian's
chromium through Playwright, round after round, alternating the two encodings of /api/pattern:
- f32: every matrix as float32 (what the page asked for at any length before issue 17's last step);
  the page is the same, its request rewritten on the way out (Playwright's routing), so only the
  payload differs;
- f16: float16 with a power-of-two scale, a causal pattern's lower triangle only (what the page asks
  for now above 512 tokens).
Measured per round: the bytes of the /api/pattern answers (raw scores and pattern of one head), the
time from pressing "run" until the opening view (the soft dictionary, which fetches the same
matrices) has drawn, the time from clicking the matrix tab until it has drawn, and the time of a
head switch in the matrix view (a new forward pass, the transfer, the decoding and the painting).
Prints the machine, a table of medians and the f16/f32 ratios. Nothing is asserted: on a shared
machine the times move with its load, the bytes do not.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# _common, train_speed; explorer_models (the tests' models)
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from _common import CHROMIUM_ARGS  # noqa: E402


def one_round(browser, url: str, text: str, encoding: str) -> dict:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(600_000)
    sizes: list[int] = []

    def route(request_route):
        body = request_route.request.post_data or ""
        if encoding == "f32":
            body = body.replace('"encoding":"f16"', '"encoding":"f32"')
        request_route.continue_(post_data=body)

    page.route("**/api/pattern", route)
    # the header, not the body: Chromium's inspector drops bodies this large
    page.on(
        "response",
        lambda r: r.url.endswith("/api/pattern") and sizes.append(int(r.headers["content-length"])),
    )

    def settle(view: str) -> None:
        page.wait_for_selector(f"body[data-ready={view}]:not([data-loading])", state="attached")

    page.goto(url)
    settle("dict")
    page.fill("#text", text)
    start = time.perf_counter()
    page.click("#run")
    settle("dict")
    opened = time.perf_counter() - start
    # the stages, which fetch /api/pattern (above 512 tokens the matrix would open as the
    # whole-context map: benchmarks/explorer_full_context.py measures that)
    page.evaluate("window.attnlab.state.matrix.mode = 'stages'")
    start = time.perf_counter()
    page.click("#tabs button[data-view=matrix]")
    settle("matrix")
    matrix = time.perf_counter() - start
    start = time.perf_counter()
    page.select_option("#head", "1")
    settle("matrix")
    switch = time.perf_counter() - start
    tokens = page.evaluate("window.attnlab.state.tokens.length")
    cost = page.inner_text("#matrix-cost")
    context.close()
    return {
        "encoding": encoding,
        "tokens": tokens,
        "bytes": statistics.median(sizes),
        "open_s": opened,
        "matrix_first_draw_s": matrix,
        "head_switch_s": switch,
        "cost": cost,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of each encoding, alternating (default 3)"
    )
    parser.add_argument(
        "--tokens", type=int, default=2048, help="the text's length in tokens (default 2048)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")
    parser.add_argument(
        "--no-machine", action="store_true", help="skip the matmul and copy measurements"
    )
    from _common import add_results_argument, figure, machine_description, write_result

    add_results_argument(parser)
    args = parser.parse_args(argv)
    description = machine_description()  # the load average before the timed runs

    from explorer_models import small_models
    from playwright.sync_api import sync_playwright

    import attnlab
    from attnlab.explorer.testing import explorer_process

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
            f"# Explorer, a long text\n{machine['machine']}\nmatmul {machine['matmul_gflops']} "
            "GFLOP/s, "
            f"copy {machine['copy_gbs']} GB/s"
        )
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is not installed: make browser (Debian's chromium) first")
    text = ("the cat sat on the mat. " * (args.tokens // 24 + 1))[: args.tokens]
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        attnlab.save(small_models()["llama"], Path(folder) / "llama")
        with explorer_process(str(Path(folder) / "llama")) as (_, url):
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                for k in range(args.rounds):
                    for encoding in ("f32", "f16") if k % 2 == 0 else ("f16", "f32"):
                        rounds.append(one_round(browser, url, text, encoding))
                        print(
                            json.dumps(
                                {
                                    key: round(v, 3) if isinstance(v, float) else v
                                    for key, v in rounds[-1].items()
                                }
                            )
                        )
                browser.close()

    def median(encoding: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds if r["encoding"] == encoding)

    keys = ("bytes", "open_s", "matrix_first_draw_s", "head_switch_s")
    table = {enc: {key: median(enc, key) for key in keys} for enc in ("f32", "f16")}
    print(f"\n{rounds[0]['tokens']} tokens, medians of {args.rounds} rounds each (alternating)")
    print(
        "| /api/pattern | bytes (one head) | run -> first view drawn | matrix tab -> drawn | head "
        "switch |"
    )
    print("|---|---|---|---|---|")
    for enc in ("f32", "f16"):
        t = table[enc]
        print(
            f"| {enc} | {t['bytes'] / 1e6:.1f} MB | {t['open_s']:.2f} s | "
            f"{t['matrix_first_draw_s']:.2f} s | {t['head_switch_s']:.2f} s |"
        )
    print(
        "| f16 / f32 | "
        + " | ".join(f"{table['f16'][k] / table['f32'][k]:.2f}x" for k in keys)
        + " |"
    )
    if args.json:
        args.json.write_text(
            json.dumps({**machine, "rounds": rounds, "medians": table}, indent=2) + "\n"
        )
    if machine:
        description.update(
            copy_bandwidth=machine["copy_gbs"] * 1e9, matmul_flops=machine["matmul_gflops"] * 1e9
        )
    f16, f32 = table["f16"], table["f32"]
    write_result(
        args.results,
        "explorer_long_text",
        measures="A long text in the explorer, in headless Chromium: the bytes of one head's "
        "pattern and how soon the page draws, with float16 matrices (a causal pattern's "
        "triangle) against float32 ones, alternating rounds.",
        anchor="float32 matrices",
        anchor_version=attnlab.__version__,
        figures=[
            figure(
                "bytes of one head's pattern", "MB", f16["bytes"] / 1e6, f32["bytes"] / 1e6, "lower"
            ),
            *(
                figure(label, "s", f16[key], f32[key], "lower")
                for key, label in (
                    ("open_s", "run to first view drawn"),
                    ("matrix_first_draw_s", "matrix tab to drawn"),
                    ("head_switch_s", "head switch"),
                )
            ),
        ],
        setup=f"{rounds[0]['tokens']} tokens",
        machine=description,
        details={"medians": table},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
