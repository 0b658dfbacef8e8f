"""Generation you can watch and the atlas, on a real model: tokens per second as the page streams
against `attnlab sample`'s loop on the same prompt, and the time to compute the atlas.

    .venv/bin/python benchmarks/explorer_generate.py [--model smollm2] [--tokens 128] [--repeats 3]
        [--json out.json]

Same prompt, same settings (attnlab sample's: temperature 0.8, top-k 200, seed 1337; a plain
prompt, so every run writes exactly --tokens tokens), in one process, each the median of --repeats:
- sample: `model.generate`, what `attnlab sample` runs (the kernel decode program by default);
- modules: the same loop through the model's modules (use_kernels=False), no hooks;
- watched: attnlab.generate.watch.generate_watched, what the explorer's stream computes: the decode
  step generate takes (the kernel decode program where it applies, each layer's attention weights
  kept; the modules with a hook on every layer's pattern where it does not), printed as the path;
- page: the explorer served in this process (uvicorn, 127.0.0.1), the generation view in Debian's
  chromium driven by Playwright: tokens per second as the page receives them (first token to
  the last) and as the server's stream reports them;
- `attnlab sample` as a process: its wall time, the model's loading included.
The atlas: POST /api/atlas on a fresh server (nothing cached) for a text of --atlas-tokens tokens:
the probes (attnlab heads' scores, copying included) and the text's scores as the server reports
them, and the request's wall time. Prints the machine line and a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from _common import CHROMIUM_ARGS  # noqa: E402

PROMPT = "The history of the printing press begins"
SETTINGS = {"temperature": 0.8, "top_k": 200, "seed": 1337}


def median(values):
    return statistics.median(values)


def in_process(model, ids, tokens: int, repeats: int) -> dict:
    from attnlab.generate.watch import generate_watched

    runs = {
        "sample": lambda: model.generate(ids, tokens, **SETTINGS),
        "modules": lambda: model.generate(ids, tokens, use_kernels=False, **SETTINGS),
        "watched": lambda: generate_watched(model, ids, tokens, lambda step: None, **SETTINGS),
    }
    out = {}
    for name, run in runs.items():
        run()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        out[name] = tokens / median(times)
    return out


def in_the_page(url: str, tokens: int, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    page_rates, server_rates = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(600_000)
        page.goto(url)
        page.wait_for_selector("body[data-ready=dict]:not([data-loading])", state="attached")
        page.click("#tabs button[data-view=generate]")
        page.wait_for_selector("body[data-ready=generate]:not([data-loading])", state="attached")
        page.fill("#gen-prompt", PROMPT)
        page.fill("#gen-max", str(tokens))
        page.fill("#gen-temp", str(SETTINGS["temperature"]))
        page.fill("#gen-topk", str(SETTINGS["top_k"]))
        page.fill("#gen-seed", str(SETTINGS["seed"]))
        for _ in range(repeats + 1):  # the first is a warm-up
            page.click("#gen-start")
            page.wait_for_selector("body[data-generated]", state="attached")
            got = page.evaluate(
                "(() => { const g = window.attnlab.generationState(); "
                "return [g.steps.length, g.pageTokensPerS, g.end && g.end.tokens_per_s]; })()"
            )
            assert got[0] == tokens, got
            page_rates.append(got[1])
            server_rates.append(got[2])
        browser.close()
    return {"page": median(page_rates[1:]), "server": median(server_rates[1:])}


def sample_process(model_name: str, tokens: int) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "attnlab", "sample", model_name, "--prompt", PROMPT,
         "--max-new-tokens", str(tokens), "--temperature", str(SETTINGS["temperature"]),
         "--top-k", str(SETTINGS["top_k"]), "--seed", str(SETTINGS["seed"])],
        check=True, capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - start


def atlas_times(model, name: str, text: str, repeats: int) -> dict:
    import httpx

    from attnlab.explorer.app import create_app
    from attnlab.explorer.testing import serving

    rows = []
    for _ in range(repeats):
        # a fresh app: the probes' scores are computed again (they are kept per served model)
        with serving(create_app({name: model})) as url:
            start = time.perf_counter()
            response = httpx.post(
                url + "api/atlas", json={"model": name, "text": text}, timeout=600
            ).json()
            wall = time.perf_counter() - start
        rows.append((wall, response["cost"]["probes_ms"], response["cost"]["text_ms"]))
    return {
        "tokens": len(response["tokens"]),
        "wall_s": median(r[0] for r in rows),
        "probes_s": median(r[1] for r in rows) / 1000,
        "text_s": median(r[2] for r in rows) / 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="anything attnlab.load takes")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--atlas-tokens", type=int, default=512, help="the atlas text's length")
    parser.add_argument("--json", help="write the results here")
    from _common import add_results_argument, figure, machine_description, write_result

    add_results_argument(parser)
    args = parser.parse_args(argv)

    import torch
    from _common import machine_line

    import attnlab
    from attnlab.explorer.app import create_app
    from attnlab.explorer.testing import serving
    from attnlab.generate.watch import decode_path

    machine = machine_line()
    print(machine)
    description = machine_description()  # the load average before the timed runs
    model = attnlab.load(args.model)
    name = Path(args.model).name
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    results = {"machine": machine, "model": args.model, "tokens": args.tokens}
    results["tokens_per_s"] = in_process(model, ids, args.tokens, args.repeats)
    with serving(create_app({name: model})) as url:
        results["tokens_per_s"].update(in_the_page(url, args.tokens, args.repeats))
    results["sample_process_s"] = sample_process(args.model, args.tokens)
    words = "The history of the printing press begins with movable type. " * 200
    text = model.tokenizer.decode(model.tokenizer.encode(words)[: args.atlas_tokens])
    results["atlas"] = atlas_times(model, name, text, args.repeats)

    path = results["watched_path"] = decode_path(model)[0]
    rates = results["tokens_per_s"]
    print(f"\n{args.model}: {args.tokens} new tokens after {ids.shape[1]} prompt tokens, "
          f"median of {args.repeats}")  # fmt: skip
    print(f"{'path':<46} {'tokens/s':>9} {'vs sample':>9}")
    labels = {
        "sample": "model.generate (attnlab sample's loop)",
        "modules": "the same loop through the modules",
        "watched": f"watched ({path}) + every head's rows",
        "server": "explorer stream, as the server reports",
        "page": "explorer stream, as the page receives it",
    }
    for key, label in labels.items():
        print(f"{label:<46} {rates[key]:9.1f} {rates[key] / rates['sample']:9.2f}")
    print(f"`attnlab sample` as a process (load included): {results['sample_process_s']:.1f} s")
    a = results["atlas"]
    print(
        f"atlas, fresh server, {a['tokens']}-token text: {a['wall_s']:.2f} s for the request "
        f"(probes {a['probes_s']:.2f} s, the text {a['text_s']:.2f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    write_result(
        args.results,
        "explorer_generate",
        measures="Generation you can watch: tokens per second as the explorer streams them (every "
        "head's rows of each step computed and sent), against `attnlab sample`'s loop "
        "(model.generate) on the same prompt and settings; and the atlas's time.",
        anchor="attnlab sample's loop",
        anchor_version=attnlab.__version__,
        figures=[
            *(
                figure(labels[key], "tok/s", rates[key], rates["sample"])
                for key in ("modules", "watched", "server", "page")
            ),
            figure(
                f"atlas of a {a['tokens']}-token text, the request", "s", a["wall_s"], None, "lower"
            ),
        ],
        setup=f"{args.model}, {args.tokens} tokens",
        machine=description,
        details=results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
