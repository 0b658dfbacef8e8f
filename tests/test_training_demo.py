"""`attnlab demo` (`make demo`) as a user runs it: a process of its own, from the pattern
walk-through through a short training run on the built-in corpus and its sample to the explorer,
opened in chromium, then Ctrl-C.

Nothing is stubbed: a test that replaced the explorer by a stand-in passed while the real demo died
on its last step. Only the demo's own flags shorten it (--max-iters, --sample-tokens), --port 0 lets
the explorer pick a free port (its printed URL says which), and --out keeps the run in tmp_path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from test_explorer_browser import browser, page, settle  # noqa: F401 (chromium, a page: fixtures)

from attnlab.explorer.server import URL_LINE

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture
def demo(tmp_path):
    """`attnlab demo` started in tmp_path: yields (the process, all it printed up to the explorer's
    URL, the URL, the run's folder, its stderr file); a process still running at the end is
    killed."""
    out = tmp_path / "demo-run"
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "attnlab",
                "demo",
                "--max-iters",
                "2",
                "--sample-tokens",
                "20",
                "--port",
                "0",
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    printed, url = [], None
    try:
        for line in process.stdout:
            printed.append(line)
            found = URL_LINE.match(line.rstrip("\n"))
            if found:
                url = found.group(1)
                break
        if url is None:
            process.wait(timeout=60)
            pytest.fail(
                f"attnlab demo ended (exit {process.returncode}) before the explorer "
                f"answered:\n{''.join(printed)}\n{stderr.read_text()}"
            )
        yield process, "".join(printed), url, out, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


def test_demo_trains_samples_and_serves_its_model_until_ctrl_c(demo, page):  # noqa: F811
    process, printed, url, out, stderr = demo
    assert "causal attention pattern of 'A B C'" in printed
    assert "Python's bundled documentation" in printed and "val loss" in printed
    sample = printed.split("--prompt 'The '):\n\n", 1)[1]
    assert sample.startswith("The ") and len(sample.split("\n\n")[0].strip()) >= 4
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["iter"] == 2
    model = json.loads((out / "config.json").read_text())["model"]
    assert model["positional"] == "rope"

    # the page, in chromium, shows the model the demo has just trained (named by its folder)
    page.goto(url)
    settle(page, "dict")
    options = page.locator("#model option").all_inner_texts()
    shape = f"{model['n_layers']}×{model['n_heads']} heads"
    # beside it, the real LLM the set-up installs
    assert options == [f"demo-run (decoder, {shape})", "smollm2 (decoder, 30×9 heads)"], options
    info = page.evaluate("window.attnlab.state.info")
    assert (info["n_layers"], info["n_heads"]) == (model["n_layers"], model["n_heads"])
    assert len(page.evaluate("window.attnlab.state.tokens")) > 1
    assert page.locator("#dict-tokens .chip").count() > 1

    # SmolLM2: its whole 8,192-token context is on offer, and its matrix opens as a map
    page.select_option("#model", "smollm2")
    settle(page, "dict")
    info = page.evaluate("window.attnlab.state.info")
    assert (info["n_layers"], info["n_heads"], info["n_kv_heads"]) == (30, 9, 3)
    assert info["max_tokens"] == 8192
    page.click("#tabs button[data-view=matrix]")
    settle(page, "matrix")
    page.click("#matrix-mode [data-mode=map]")
    settle(page, "matrix")
    assert "layer 0 head 0" in page.inner_text("#map-note")
    assert page.evaluate("window.attnlab.state.matrix.map.frames") > 0

    process.send_signal(signal.SIGINT)  # Ctrl-C, as the demo's last line says
    remaining, _ = process.communicate(timeout=60)
    errors = stderr.read_text()
    assert process.returncode in (0, 130), (process.returncode, errors)
    assert "Traceback" not in errors + remaining, errors
