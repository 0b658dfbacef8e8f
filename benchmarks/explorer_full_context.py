"""The whole context in the explorer (issue 26): a real LLM's full 8,192-token text as a map, in
headless Chromium, from the click to the painted frame.

    .venv/bin/python benchmarks/explorer_full_context.py --text input.txt \
        [--model smollm2] [--tokens 8192] [--switches 12] [--zoom-steps 22] [--json out.json] \
        [--screenshot docs/screenshots/explorer-full-context.png --shot-head 2.3]

Serves MODEL with `attnlab explore MODEL --port 0` (a process of its own, as a user runs it), opens
the page in Debian's chromium through Playwright, and measures in the page (performance.now(), up to
the second animation frame after the canvas is drawn, so the frame is on screen):
- processing: POST /api/context, the model run once over the text (its queries and keys kept);
- first picture: from that answer to the first head's overview painted;
- head switches: a <select> change to another head or layer (never shown before) until its overview
  is painted; the median and the slowest;
- zoom steps: one wheel notch (x1.25) at a point on the diagonal until every tile the new view needs
  is painted, from the whole matrix down to single labelled cells;
- the server's memory: its resident set (VmRSS) and peak (VmHWM) from /proc, and the bytes of
  queries and keys it reports (GET /api/context/status).
The text is the longest prefix of --text with at most --tokens tokens (tokenized by the server).
Prints the machine and a table; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from _common import CHROMIUM_ARGS  # noqa: E402

# In the page: change a <select>, then wait for the map to paint that head, and two frames.
SWITCH = """async ([id, value]) => {
  const map = window.attnlab.state.matrix.map, frames = map.frames;
  const t0 = performance.now();
  const el = document.getElementById(id);
  el.value = String(value);
  el.dispatchEvent(new Event("change"));
  const state = window.attnlab.state;
  const want = id === "head" ? `${state.layer}/${value}` : `${value}/${state.head}`;
  while (!(map.head === want && map.frames > frames && !document.body.dataset.loading)) {
    await new Promise((r) => setTimeout(r, 1));
  }
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return performance.now() - t0;
}"""
# One wheel notch at (x, y) of the canvas, then wait for every tile the view needs, and two frames.
ZOOM = """async ([x, y]) => {
  const map = window.attnlab.state.matrix.map, canvas = document.getElementById("map-canvas");
  const box = canvas.getBoundingClientRect();
  const t0 = performance.now();
  canvas.dispatchEvent(new WheelEvent("wheel", {
    clientX: box.left + x, clientY: box.top + y, deltaY: -100, bubbles: true, cancelable: true }));
  while (!map.complete) await new Promise((r) => setTimeout(r, 1));
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return { ms: performance.now() - t0, level: map.geometry.level, z: map.view.z };
}"""
# Wait for the map's first paint after "run", and two frames: the frame's time.
FIRST = """async () => {
  const map = window.attnlab.state.matrix.map;
  while (!(map.frames > 0 && map.times.painted && !document.body.dataset.loading)) {
    await new Promise((r) => setTimeout(r, 5));
  }
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return { frame: performance.now(), ...map.times };
}"""


def memory_of(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + path.lstrip("/"), json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def longest_prefix(url: str, model: str, source: str, tokens: int) -> tuple[str, int]:
    """The longest prefix of `source` with at most `tokens` tokens, cut at a line's end (the
    server's tokenizer, through /api/run)."""
    lines = source.splitlines(keepends=True)
    low, high = 1, len(lines)  # lines in the prefix
    best = ("", 0)
    while low <= high:
        mid = (low + high) // 2
        text = "".join(lines[:mid])
        status, answer = post(url, "/api/run", {"model": model, "text": text})
        if status == 200 and len(answer["tokens"]) <= tokens:
            best = (text, len(answer["tokens"]))
            low = mid + 1
        else:
            high = mid - 1
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, required=True, help="a text file (its prefix is used)")
    parser.add_argument("--model", default="smollm2", help="what `attnlab explore` serves")
    parser.add_argument("--tokens", type=int, default=8192, help="the text's length (default 8192)")
    parser.add_argument("--switches", type=int, default=12, help="head and layer switches timed")
    parser.add_argument("--zoom-steps", type=int, default=22, help="wheel notches timed")
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")
    parser.add_argument("--screenshot", type=Path, default=None, help="a PNG of the whole matrix")
    parser.add_argument("--shot-head", default="0.0", help="LAYER.HEAD of the screenshot's head")
    parser.add_argument("--no-machine", action="store_true", help="skip the matmul measurement")
    from _common import add_results_argument, figure, machine_description, write_result

    add_results_argument(parser)
    args = parser.parse_args(argv)
    description = machine_description()  # the load average before the timed runs
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is not installed: make browser (Debian's chromium) first")
    if not args.text.is_file():
        raise SystemExit(f"--text {args.text}: no such file")

    from playwright.sync_api import sync_playwright

    from attnlab.explorer.testing import explorer_process

    machine = {}
    if not args.no_machine:
        from _common import machine_line
        from train_speed import measure_matmul_peak

        machine = {
            "machine": machine_line(),
            "matmul_gflops": round(measure_matmul_peak() / 1e9, 1),
        }
        print(
            f"# The whole context\n{machine['machine']}\nmatmul {machine['matmul_gflops']} GFLOP/s"
        )
    source = args.text.read_text(encoding="utf-8")
    started = time.perf_counter()
    with explorer_process(args.model, "--max-tokens", str(args.tokens)) as (process, url):
        load_s = time.perf_counter() - started
        name = json.loads(urllib.request.urlopen(url + "api/models").read())[0]["name"]
        text, n_tokens = longest_prefix(url, name, source, args.tokens)
        memory_idle = memory_of(process.pid)
        result: dict = {
            "model": args.model,
            "tokens": n_tokens,
            "characters": len(text),
            "server_start_s": round(load_s, 2),
            **machine,
        }
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
            page.set_default_timeout(900_000)
            page.goto(url)
            page.wait_for_selector("body[data-ready=dict]:not([data-loading])", state="attached")
            page.click("#tabs button[data-view=matrix]")  # the text runs straight into the map
            page.wait_for_selector("body[data-ready=matrix]:not([data-loading])", state="attached")
            page.fill("#text", text)
            clicked = page.evaluate("performance.now()")
            page.click("#run")
            first = page.evaluate(FIRST)
            context = page.evaluate("window.attnlab.state.matrix.map.context")
            result.update(
                run_click_to_frame_ms=first["frame"] - clicked,
                processing_ms=first["contextDone"] - first["contextSent"],
                processing_server_s=context["seconds"],
                first_picture_ms=first["frame"] - first["contextDone"],
            )
            memory_context = memory_of(process.pid)
            n_layers, n_heads = context["info"]["n_layers"], context["info"]["n_heads"]
            switches = []
            for k in range(args.switches):
                if k % 3 == 2:  # every third: another layer
                    layer = (page.evaluate("window.attnlab.state.layer") + 7) % n_layers
                    switches.append(("layer", layer, page.evaluate(SWITCH, ["layer", layer])))
                else:
                    head = (page.evaluate("window.attnlab.state.head") + 1) % n_heads
                    switches.append(("head", head, page.evaluate(SWITCH, ["head", head])))
            times = [ms for *_, ms in switches]
            result.update(
                switch_ms_median=statistics.median(times),
                switch_ms_max=max(times),
                switches=switches,
            )
            geometry = page.evaluate("window.attnlab.state.matrix.map.geometry")
            plot = page.evaluate("window.attnlab.state.matrix.map.plot")
            # a point on the diagonal, 60 % of the way down
            x = y = geometry["margin"] + 0.6 * plot
            zooms = [page.evaluate(ZOOM, [x, y]) for _ in range(args.zoom_steps)]
            result.update(
                zoom_ms_median=statistics.median(z["ms"] for z in zooms),
                zoom_ms_max=max(z["ms"] for z in zooms),
                zooms=zooms,
            )
            if args.screenshot:
                layer, head = (int(v) for v in args.shot_head.split("."))
                page.evaluate(SWITCH, ["layer", layer])
                page.evaluate(SWITCH, ["head", head])
                page.click("#map-zoom-reset")
                args.screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.locator("#view-matrix").screenshot(path=str(args.screenshot))
                for _ in range(args.zoom_steps):
                    page.evaluate(ZOOM, [x, y])
                zoomed = args.screenshot.with_name(args.screenshot.stem + "-zoomed.png")
                page.locator("#view-matrix").screenshot(path=str(zoomed))
            status = json.loads(urllib.request.urlopen(url + "api/context/status").read())
            browser.close()
        result.update(
            memory_idle=memory_idle,
            memory_after_context=memory_context,
            memory_end=memory_of(process.pid),
            kept_bytes=status["bytes"],
            budget_bytes=status["budget_bytes"],
            load_average=open("/proc/loadavg").read().split()[:3],
            measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
    mb = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    print(f"\n{args.model}, {n_tokens} tokens ({len(text)} characters)")
    print("| step | time |")
    print("|---|---|")
    memory_end = result["memory_end"]
    rows = [
        (
            "processing the text (POST /api/context: the model once, q and k kept)",
            f"{result['processing_ms'] / 1e3:.2f} s (server {result['processing_server_s']:.2f} s)",
        ),
        (
            "first picture of a head (after the text is processed)",
            f"{result['first_picture_ms']:.0f} ms",
        ),
        (
            "another head or layer, click to painted frame",
            f"median {result['switch_ms_median']:.0f} ms, slowest {result['switch_ms_max']:.0f} ms "
            f"({args.switches} switches)",
        ),
        (
            "a zoom step (x1.25), wheel to every tile painted",
            f"median {result['zoom_ms_median']:.0f} ms, slowest {result['zoom_ms_max']:.0f} ms "
            f"({args.zoom_steps} steps)",
        ),
        (
            "server memory: resident idle / after the text / end (peak)",
            f"{mb(memory_idle['VmRSS'])} / {mb(memory_context['VmRSS'])} / "
            f"{mb(memory_end['VmRSS'])} ({mb(memory_end['VmHWM'])})",
        ),
        (
            "queries and keys kept",
            f"{mb(result['kept_bytes'])} (budget {mb(result['budget_bytes'])})",
        ),
    ]
    for step, value in rows:
        print(f"| {step} | {value} |")
    print(f"load average {' '.join(result['load_average'])}, {result['measured']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    write_result(
        args.results,
        "explorer_full_context",
        measures="A real LLM's whole context as a map in the explorer, in headless Chromium, from "
        "the click to the painted frame: processing the text, the first head's picture, a head "
        "switch, a zoom step (no anchor: the times a user waits).",
        anchor=None,
        anchor_version=None,
        figures=[
            figure("processing the text", "s", result["processing_ms"] / 1e3, None, "lower"),
            figure("first picture", "ms", result["first_picture_ms"], None, "lower"),
            figure("a head switch, median", "ms", result["switch_ms_median"], None, "lower"),
            figure("a zoom step, median", "ms", result["zoom_ms_median"], None, "lower"),
        ],
        setup=f"{Path(args.model).name}, {result['tokens']} tokens",
        machine=description,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
