"""The generation view and the atlas in headless Chromium (as test_explorer_browser.py drives the
page): a generation streams into the page with its rows and the KV cache, stops on Stop, and every
head of the atlas opens its matrix or arcs; one walk on SmolLM2, whose screenshots the README
shows."""

from __future__ import annotations

import time

import numpy as np
import pytest
import test_explorer_browser as chromium
from explorer_models import TEXT, small_models
from test_explorer_browser import OUT, open_page, settle, show, wait_until
from test_explorer_generate import byte_level_model_that_writes_newlines

import attnlab
from attnlab.explorer.app import create_app
from attnlab.explorer.testing import serving
from attnlab.generate.kernel_decoder import KernelDecoder

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# test_explorer_browser's fixtures: one Chromium per module, a fresh page per test that fails on any
# error the page logs
browser = chromium.browser
page = chromium.page


@pytest.fixture(scope="module")
def served():
    app = create_app(small_models(), max_tokens=2048)
    with serving(app) as url:
        yield url, app.state.explorer


def generate(page, prompt, n, temperature="0", chat=False):
    page.fill("#gen-prompt", prompt)
    page.fill("#gen-max", str(n))
    page.fill("#gen-temp", temperature)
    if chat:
        page.check("#gen-chat")
    page.click("#gen-start")


def test_a_generation_streams_into_the_page_with_the_rows_of_the_full_pattern(served, page):
    url, _ = served
    open_page(page, url, model="gpt")
    show(page, "generate")
    generate(page, "The cat sat", 20)
    page.wait_for_selector("body[data-generated='20']", state="attached")
    got = page.evaluate("window.attnlab.generationState()")
    assert len(got["steps"]) == 20 and got["end"]["reason"] == "max_new_tokens"
    assert page.locator("#gen-tokens .gen-chip.new").count() == 20
    assert page.locator("#gen-tokens .gen-chip.prompt").count() == len("The cat sat")
    # the rows the page holds are the matrix view's pattern of the final text (float16: 3 digits)
    text = "The cat sat" + got["end"]["text"]
    for layer, head in ((0, 1), (1, 3)):
        pattern = page.evaluate(
            "(b) => fetch('/api/pattern', {method: 'POST', headers: {'Content-Type': "
            "'application/json'}, body: JSON.stringify(b)}).then((r) => r.json())",
            {"model": "gpt", "text": text, "layer": layer, "head": head},
        )["pattern"]
        for step in got["steps"]:
            i = step["index"]
            np.testing.assert_allclose(
                step["rows"][layer * 4 + head], pattern[i - 1][:i], atol=2e-3, rtol=2e-3
            )
    # the staircase has a row per new token; the cache panel counts the positions
    assert page.evaluate("document.getElementById('gen-rows').height") >= 20
    assert f"{len('The cat sat') + 19} positions" in page.inner_text("#gen-cache-text")
    # a click on a generated token: every head's row when it was written, and its candidates
    page.click("#gen-tokens .gen-chip.new >> nth=4")
    assert page.is_visible("#gen-detail")
    assert page.get_attribute("#gen-heads", "data-rows") == str(2 * 4)
    assert page.get_attribute("#gen-heads", "data-keys") == str(len("The cat sat") + 4)
    assert page.locator("#gen-candidates .gen-candidate").count() == 10
    assert page.locator("#gen-candidates .gen-candidate.chosen").count() == 1
    assert "every head's weights over the 15 tokens before it" in page.inner_text(
        "#gen-detail-title"
    )
    # a click on a head's row follows it
    box = page.locator("#gen-heads").bounding_box()
    rows = 2 * 4
    page.mouse.click(box["x"] + 60, box["y"] + (6 + 0.5) * box["height"] / rows)
    assert page.evaluate("[window.attnlab.state.layer, window.attnlab.state.head]") == [1, 2]
    assert "layer 1 head 2" in page.inner_text("#gen-rows-title")
    # the generated text becomes the page's text for the other views
    page.click("#gen-use")
    settle(page, "generate")
    assert page.input_value("#text") == text


def test_a_newline_candidate_shows_as_the_return_sign(page):
    """A byte-level BPE model writing newlines ("Ċ" in its vocabulary): the generated chips and the
    candidates show ⏎, never the vocabulary's stand-in."""
    model, _ = byte_level_model_that_writes_newlines(small_models())
    with serving(create_app({"bpe": model})) as url:
        open_page(page, url)
        show(page, "generate")
        generate(page, "The cat", 3)
        page.wait_for_selector("body[data-generated='3']", state="attached")
        assert page.locator("#gen-tokens .gen-chip.new").all_inner_texts() == ["⏎"] * 3
        page.click("#gen-tokens .gen-chip.new >> nth=0")
        candidates = page.inner_text("#gen-candidates")
        assert page.inner_text("#gen-candidates .gen-candidate.chosen").startswith("⏎")
        assert "Ċ" not in candidates + page.inner_text("#gen-tokens")


def test_stop_ends_the_generation_on_the_server(served, page, monkeypatch):
    url, explorer = served
    # each C decode step ~20 ms (the small model's would be done before Stop could be pressed)
    weights = KernelDecoder.weights
    monkeypatch.setattr(KernelDecoder, "weights", lambda self: time.sleep(0.02) or weights(self))
    open_page(page, url, model="llama")
    show(page, "generate")
    generate(page, TEXT, 1000, temperature="0.8")
    wait_until(page, "window.attnlab.generationState().steps.length >= 3")
    page.click("#gen-stop")
    page.wait_for_selector("body[data-generated]", state="attached")
    n = len(page.evaluate("window.attnlab.generationState().steps"))
    assert 3 <= n < 1000
    deadline = time.monotonic() + 10
    while explorer.generations:
        assert time.monotonic() < deadline, "the server went on generating after Stop"
        time.sleep(0.05)
    assert "stopped" in page.inner_text("#gen-note")


def test_an_encoder_does_not_generate_and_says_why(served, page):
    url, _ = served
    open_page(page, url, model="bert")
    show(page, "generate")
    assert "is an encoder" in page.inner_text("#gen-note")
    assert page.is_disabled("#gen-start") and page.is_disabled("#gen-chat")


def test_the_atlas_colours_every_head_and_opens_it(served, page):
    url, explorer = served
    open_page(page, url, model="llama", text="abcab abcab abcab")
    show(page, "atlas")
    cells = page.evaluate("window.attnlab.atlasCells()")
    assert len(cells) == 2 * 4
    atlas = page.evaluate(
        "fetch('/api/atlas', {method: 'POST', headers: {'Content-Type': 'application/json'}, "
        "body: JSON.stringify({model: 'llama', text: 'abcab abcab abcab'})}).then((r) => r.json())"
    )
    for cell in cells:  # each cell's role: its probe score that stands out most
        scores = atlas["probes"]["scores"]
        ratios = {
            role: scores[role][cell["layer"]][cell["head"]] / atlas["thresholds"][role]
            for role in atlas["roles"]
        }
        best = max(ratios, key=ratios.get)
        assert cell["role"] == best and cell["score"] == pytest.approx(
            scores[best][cell["layer"]][cell["head"]]
        )
    page.hover("#atlas-grid .atlas-cell[data-layer='1'][data-head='2']")
    tip = page.inner_text("#atlas-tip")
    assert tip.startswith("L1H2 · probes: prev") and "this text: prev" in tip
    page.click("#atlas-source button[data-source=text]")
    assert "on this text: 17 tokens" in page.inner_text("#atlas-note")
    on_text = page.evaluate("window.attnlab.atlasCells()")
    cell = on_text[6]  # layer 1, head 2
    assert cell["score"] == pytest.approx(
        atlas["text"]["scores"][cell["role"]][cell["layer"]][cell["head"]]
    )
    page.click("#atlas-grid .atlas-cell[data-layer='1'][data-head='2']")
    settle(page, "matrix")
    assert page.input_value("#layer") == "1" and page.input_value("#head") == "2"
    show(page, "atlas")
    page.click("#atlas-click button[data-open=heads]")
    page.click("#atlas-grid .atlas-cell[data-layer='0'][data-head='3']")
    settle(page, "heads")
    assert "layer 0 head 3" in page.inner_text("#arcs-title")


def test_the_exported_page_shows_the_atlas_and_says_generation_needs_a_server(page, tmp_path):
    from attnlab.explorer.export import write_html

    path = write_html(small_models()["gpt"], TEXT, tmp_path / "gpt.html", name="gpt")
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    settle(page, "dict")
    show(page, "atlas")
    assert len(page.evaluate("window.attnlab.atlasCells()")) == 2 * 4
    show(page, "generate")
    assert "exported page" in page.inner_text("#gen-note") and page.is_disabled("#gen-start")
    assert all(url.startswith(("file:", "data:")) for url in requests), requests


# SmolLM2-135M-Instruct (the bundled GGUF): the README's screenshots -------------------------------


@pytest.fixture(scope="module")
def smollm2():
    app = create_app({"smollm2": attnlab.load("smollm2")})
    with serving(app) as url:
        yield url


def test_smollm2_chats_with_its_rows_and_its_atlas_of_270_heads(smollm2, page):
    page.set_default_timeout(300_000)  # a 135M model on a shared 2-core machine
    page.set_viewport_size({"width": 1400, "height": 1000})
    open_page(page, smollm2, text="The capital of France is Paris. The capital of France is")
    show(page, "generate")
    assert not page.is_disabled("#gen-chat")  # the GGUF file carries a chat template
    generate(page, "What is the capital of France?", 24, chat=True)
    page.wait_for_selector("body[data-generated]", state="attached")
    got = page.evaluate("window.attnlab.generationState()")
    assert got["start"]["prompt_tokens"][0] == "<|im_start|>" and got["start"]["chat"]
    assert "Paris" in got["end"]["text"], got["end"]["text"]
    assert got["end"]["reason"] in ("end_of_turn", "max_new_tokens")
    page.select_option("#layer", "3")
    page.select_option("#head", "0")
    settle(page, "generate")
    page.click("#gen-tokens .gen-chip.new >> nth=2")
    assert page.get_attribute("#gen-heads", "data-rows") == "270"
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "explorer-generate-smollm2.png"), full_page=True)

    show(page, "atlas")
    assert len(page.evaluate("window.attnlab.atlasCells()")) == 270
    page.hover("#atlas-grid .atlas-cell[data-layer='3'][data-head='0']")
    page.screenshot(path=str(OUT / "explorer-atlas-smollm2.png"), full_page=True)
