"""The README's screenshots of the explorer's experiments, on the chapters' own examples.

    attnlab experiment induction --out experiments        # about 1.5 minutes: the trained 2-layer
    model and its run
    python docs/screenshots/experiments.py experiments    # writes
    docs/screenshots/explorer-{knockout,training}-*.png

- Knockout on the induction model: its four layer-1 heads (all induction heads) off, on a held-out
  text of a
  random span repeated: the loss strip shows the drop on the repeated part gone.
- The training slider on the same run, at the phase change (the step where the induction score rises
  most).
- Knockout on MiniLM: layer 5's heads 4 and 11 ("it" lands on "cat"), and a control head (layer 5,
  head 2). The browser is Debian's chromium driven by Playwright, as in
  tests/test_explorer_browser.py; the server binds 127.0.0.1 on a free port
  (attnlab.explorer.testing.serving, as the tests start it). Each screenshot is then looked at by a
  person before it is committed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def settle(page, view):
    page.wait_for_selector(f"body[data-ready={view}]:not([data-loading])", state="attached")


def main(experiments: Path) -> None:
    from playwright.sync_api import sync_playwright

    import attnlab
    from attnlab.explorer.app import create_app
    from attnlab.explorer.models import Run
    from attnlab.explorer.testing import serving
    from attnlab.training.snapshots import list_snapshots

    result = json.loads((experiments / "induction.json").read_text())
    run = experiments / "induction-2L"
    start = result["phase_change_2L"]["steps"]["induction_rise"]
    models = {"induction-2L": attnlab.load(run)}
    runs = {
        "induction-2L": Run(
            run, list_snapshots(run), start_step=start, example=result["example_text"]
        )
    }
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"), args=["--headless", "--no-sandbox"]
        )
        with serving(create_app(models, runs=runs)) as url:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(300_000)
            page.on("pageerror", lambda e: print("page error:", e))
            page.goto(url)
            settle(page, "dict")
            # the training slider at the phase change, heads grid with each head's score over
            # training
            page.click("#tabs button[data-view=heads]")
            settle(page, "heads")
            page.screenshot(path=str(HERE / "explorer-training-slider.png"))
            # the end of training, the four layer-1 heads knocked out
            page.fill("#step", str(len(runs["induction-2L"].snapshots) - 1))
            page.dispatch_event("#step", "change")
            settle(page, "heads")
            page.click("#click-mode button[data-click=knock]")
            for head in range(4):
                page.click(f"canvas.thumb[data-layer='1'][data-head='{head}']")
                settle(page, "heads")
            page.screenshot(path=str(HERE / "explorer-knockout-induction.png"))
        # MiniLM (its own server and page): "it" -> "cat" heads off, then the control head
        with serving(create_app({"minilm": attnlab.load("minilm")})) as url:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url)
            settle(page, "dict")
            page.click("#tabs button[data-view=heads]")
            settle(page, "heads")
            page.select_option("#layer", "5")
            settle(page, "heads")
            page.select_option("#head", "11")
            settle(page, "heads")
            tokens = page.evaluate("window.attnlab.state.tokens")
            page.click(f"#arcs text[data-index='{tokens.index('it')}']")
            page.click("#click-mode button[data-click=knock]")
            for head in (4, 11):
                page.click(f"canvas.thumb[data-layer='5'][data-head='{head}']")
                settle(page, "heads")
            page.screenshot(path=str(HERE / "explorer-knockout-minilm.png"))
            page.click("#knockout-clear")
            settle(page, "heads")
            page.click("canvas.thumb[data-layer='5'][data-head='2']")
            settle(page, "heads")
            page.screenshot(path=str(HERE / "explorer-knockout-minilm-control.png"))
        browser.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "experiments"))
