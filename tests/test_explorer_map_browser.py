"""The whole-context map in headless Chromium: a long text opens the attention matrix as a map (the
overview first, tiles as you zoom, token labels once a cell is tall enough), a head switch asks only
for that head's overview, and the cell the page shows is the model's own weight.

The server is the browser tests' own (test_explorer_browser's fixtures: uvicorn in a thread, the
small random models, Debian's chromium).
"""

from __future__ import annotations

import re

import pytest
import torch
from explorer_models import small_models
from test_explorer_browser import (  # noqa: F401 (fixtures: the server, chromium, a page)
    browser,
    open_page,
    page,
    server,
    settle,
    shot,
    show,
    wait_until,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TEXT = ("the cat sat on the mat because it was tired. " * 40)[:1500]


def truth(layer: int, head: int) -> torch.Tensor:
    model = small_models()["llama"]
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    name = f"blocks.{layer}.attn.hook_pattern"
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=name)
    return cache[name][0, head]


def test_a_long_text_opens_as_a_map_that_zooms_to_labelled_cells(server, page):  # noqa: F811
    requests = []
    page.on("request", lambda r: requests.append((r.method, r.url)))
    open_page(page, server, model="llama", text=TEXT)
    show(page, "matrix")
    assert page.is_visible("#map-canvas") and not page.is_visible("#matrix-canvas")
    assert "active" in page.get_attribute("#matrix-mode [data-mode=map]", "class")
    geometry = page.evaluate("window.attnlab.state.matrix.map.geometry")
    assert geometry["missing"] == 0 and geometry["level"] >= 1  # the overview alone fills it
    assert "1,500×1,500" in page.inner_text("#map-note")
    assert "queries and keys kept" in page.inner_text("#map-memory")
    posts = [u for m, u in requests if m == "POST" and u.endswith("/api/context")]
    assert len(posts) == 1

    # the wheel zooms in at the pointer: the token under it stays under it, finer tiles arrive
    box = page.locator("#map-canvas").bounding_box()
    x, y = box["x"] + 500, box["y"] + 600
    page.mouse.move(x, y)
    under = page.evaluate("window.attnlab.state.matrix.map.view")
    for _ in range(15):  # 1.25 a notch: cells over 9 pixels, tall enough for labels
        page.mouse.wheel(0, -100)
    wait_until(page, "window.attnlab.state.matrix.map.complete")
    view = page.evaluate("window.attnlab.state.matrix.map.view")
    assert view["z"] > 9 * under["z"]
    geometry = page.evaluate("window.attnlab.state.matrix.map.geometry")
    margin = geometry["margin"]
    before = under["x0"] + (x - box["x"] - margin) / under["z"]
    after = view["x0"] + (x - box["x"] - margin) / view["z"]
    assert after == pytest.approx(before, abs=0.5)
    assert geometry["level"] == 0 and geometry["missing"] == 0  # single cells, every tile in
    assert any("/tile?" in u and "level=0" in u for _, u in requests)

    # hover: the token labels and the weight, the model's own to float16's 3 digits
    page.mouse.move(x + 3, y + 3)
    tip = page.inner_text("#map-tip")
    cell = re.search(r"query (\d+) “(.*)” → key (\d+) “(.*)”: weight ([^ ]+)", tip)
    assert cell, tip
    i, j, weight = int(cell[1]), int(cell[3]), float(cell[5])
    assert cell[2] == TEXT[i].replace(" ", "␣") and cell[4] == TEXT[j].replace(" ", "␣")
    assert weight == pytest.approx(float(truth(0, 0)[i, j]), rel=2e-3, abs=1e-6)
    shot(page, "map-zoomed")

    # dragging pans; the whole-matrix button comes back
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x - 150, y - 100, steps=5)
    page.mouse.up()
    panned = page.evaluate("window.attnlab.state.matrix.map.view")
    assert panned["x0"] > view["x0"] and panned["y0"] > view["y0"]
    page.click("#map-zoom-reset")
    assert page.evaluate("window.attnlab.state.matrix.map.view.x0") == 0

    # another head: its overview only, no new context, no stages
    requests.clear()
    page.select_option("#head", "2")
    settle(page, "matrix")
    assert "head 2" in page.inner_text("#map-note")
    assert [m for m, u in requests if "/api/" in u] == ["GET"]
    assert "/overview?layer=0&head=2" in requests[0][1]


def test_the_stages_stay_one_click_away_and_the_map_opens_on_a_short_text(
    server,  # noqa: F811
    page,  # noqa: F811
):
    open_page(page, server, model="llama", text=TEXT[:300])
    show(page, "matrix")
    assert page.is_visible("#matrix-canvas")  # 300 tokens: the stages first
    page.click("#matrix-mode [data-mode=map]")
    settle(page, "matrix")
    assert page.is_visible("#map-canvas") and "300×300" in page.inner_text("#map-note")
    page.click("#matrix-mode [data-mode=stages]")
    settle(page, "matrix")
    assert page.is_visible("#matrix-canvas")
    assert page.evaluate("window.attnlab.matrixValues().length") == 300
