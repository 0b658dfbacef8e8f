"""The page's JavaScript modules: each one reached, shipped and inlined; each view runs on its own.

static/app.js imports core.js and one module per view (views/*.js). Checked here:
- without a browser: the modules app.js reaches are exactly the .js files in static/, each in
  pyproject.toml's package data (so in the wheel), and the exporter's inliner refuses, in one line
  naming the file, what it cannot inline (a missing module, a cycle, a form it does not read);
- in Chromium (Debian's, driven by Playwright, as in test_explorer_browser.py): the inlined modules
  run as the browser runs them; the served page fetches every module and nothing else; each view
  module, loaded alone into a minimal page (its markup from index.html, core.js and the view, no
  more) against a test server, draws its view and hands the page's actions (refresh, run the text)
  to whoever loaded it; the notebook's sandboxed iframe runs the inlined page.
"""

from __future__ import annotations

import glob
import json
import re
import tomllib
from pathlib import Path

import pytest
from explorer_models import TEXT, small_models, snapshot_run
from test_explorer_browser import browser  # noqa: F401  (the fixture: one Chromium per module)

import attnlab
from attnlab.explorer import STATIC
from attnlab.explorer.page_modules import ModuleError, inline_modules, module_order

ROOT = Path(attnlab.__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "attnlab"


def shipped_files() -> set[str]:
    """The files under src/attnlab that pyproject.toml's package data names (setuptools' globs)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {
        Path(p).as_posix()
        for pattern in setuptools["package-data"]["attnlab"]
        for p in glob.glob(pattern, root_dir=PACKAGE, recursive=True)
        if (PACKAGE / p).is_file()
    }


def test_app_js_reaches_every_module_in_static_and_each_ships_in_the_package():
    reached = module_order()
    assert reached[-1] == "app.js" and reached[0] == "core.js", reached  # dependencies first
    views = {"dict", "matrix", "heads", "block", "next", "knockout", "training"}
    views |= {"generate", "atlas"}
    assert {f"views/{view}.js" for view in views} <= set(reached)
    on_disk = {p.relative_to(STATIC).as_posix() for p in STATIC.rglob("*.js")}
    assert set(reached) == on_disk, f"in static/ but imported by nothing: {on_disk - set(reached)}"
    shipped = shipped_files()
    missing = [name for name in reached if f"explorer/static/{name}" not in shipped]
    assert not missing, f"not in pyproject.toml's package data: {missing}"


def test_each_view_module_imports_only_core_so_it_loads_alone():
    for path in sorted((STATIC / "views").glob("*.js")):
        order = module_order(f"views/{path.name}")
        assert set(order) == alone(path.stem), (path.name, order)


def alone(view: str) -> set[str]:
    """What a view module loads: core.js and itself (training.js also redraws the heads grid, and
    the matrix holds the whole-context map)."""
    also = {"training": {"views/heads.js"}, "matrix": {"views/map.js"}}.get(view, set())
    return {"core.js", f"views/{view}.js"} | also


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


IMPORT_B = 'import { a } from "./b.js";\n'


@pytest.mark.parametrize(
    "files, message",
    [
        ({"app.js": 'import { a } from "./gone.js";\n'}, "app.js imports gone.js, which is not in"),
        (
            {"app.js": IMPORT_B, "b.js": 'import { c } from "./app.js";\nexport const a = 1;\n'},
            "in a cycle: app.js -> b.js -> app.js",
        ),
        ({"app.js": IMPORT_B, "b.js": "export default 1;\n"}, "b.js:1: 'export default 1;'"),
        ({"app.js": IMPORT_B, "b.js": "export let a = 1;\n"}, "b.js:1: 'export let a = 1;'"),
        ({"app.js": 'import "./b.js";\n', "b.js": ""}, "app.js:1: 'import \"./b.js\";'"),
        (
            {"app.js": 'import { a } from "https://cdn.example/a.js";\n'},
            "app.js:1: imports 'https://cdn.example/a.js'",
        ),
    ],
)
def test_the_inliner_names_what_it_cannot_inline(tmp_path, files, message):
    with pytest.raises(ModuleError, match=re.escape(message)):
        inline_modules(root=write(tmp_path, files))


# --------------------------------------------------------------------------------------------------
# In Chromium


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from attnlab.explorer.app import create_app
    from attnlab.explorer.testing import serving

    models = small_models()
    runs = {"gpt": snapshot_run(models["gpt"], tmp_path_factory.mktemp("run"))}
    with serving(create_app({"gpt": models["gpt"], "bert": models["bert"]}, runs=runs)) as url:
        yield url.rstrip("/")


@pytest.fixture
def page(browser):  # noqa: F811 (the fixture imported above)
    """A fresh page that records the scripts it fetches; the test fails on any error it logs."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.errors, page.scripts = [], []
    page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on(
        "request",
        lambda r: r.resource_type == "script" and page.scripts.append(r.url.split("/static/")[-1]),
    )
    yield page
    errors = page.errors
    context.close()
    assert not errors, errors


@pytest.mark.browser
@pytest.mark.slow
def test_the_inliner_runs_each_module_once_in_its_own_scope_after_its_imports(page, tmp_path):
    """Two modules with the same private name, a renamed and a namespace import, run in Chromium."""
    root = write(
        tmp_path,
        {
            "app.js": 'import { twice, log } from "./lib/a.js";\n'
            'import { value as b } from "./b.js";\n'
            'import * as both from "./b.js";\nconst secret = "app";\n'
            "log.push(secret, twice(b), both.value);\nwindow.log = log;\n",
            "lib/a.js": 'export const log = [];\nconst secret = "a";\nlog.push(secret);\n'
            "export function twice(x) { return 2 * x; }\n",
            "b.js": 'import { log } from "./lib/a.js";\nlog.push("b");\nexport const value = 21;\n',
        },
    )
    page.set_content(f'<script type="module">{inline_modules(root=root)}</script>')
    page.wait_for_function("window.log")
    assert page.evaluate("window.log") == ["a", "b", "app", 42, 21]


@pytest.mark.browser
@pytest.mark.slow
def test_the_served_page_fetches_every_module_and_runs(server, page):
    page.goto(server + "/")
    page.wait_for_selector("body[data-ready=dict]:not([data-loading])", state="attached")
    assert sorted(page.scripts) == sorted(module_order())
    assert page.locator("#dict-threads line").count() == len(TEXT)


def markup(element: str) -> str:
    """One element of index.html (a view's <section>, a bar's <div>), as the page has it."""
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    end = "</section>" if element.startswith("view-") else "\n</div>"  # a bar's </div>: a line
    match = re.search(rf'<(section|div) id="{element}".*?{end}', page, re.S)
    assert match, f"index.html has no element with id {element}"
    return match[0]


# Each view module alone: the markup it draws into, and what the test page sets before loading it
ALONE = {
    "dict": ("view-dict", ""),
    "matrix": ("view-matrix", ""),
    "heads": ("view-heads", ""),
    "block": ("view-block", ""),
    "next": ("view-next", ""),
    "knockout": ("knockout", "state.ablate = [[1, 2]];"),
    "training": ("training", ""),
    "map": ("view-matrix", "document.getElementById('matrix-map').hidden = false;"),
    "generate": ("view-generate", ""),
    "atlas": ("view-atlas", ""),
}


def open_alone(page, server, view: str, model: str = "gpt"):
    """A minimal page at the test server's origin: core.js and views/<view>.js only, run on TEXT."""
    element, setup = ALONE[view]
    name = view[0].upper() + view[1:]
    html = f"""<!doctype html><html><head><meta charset="utf-8">
<link rel="stylesheet" href="/static/style.css"></head><body>
<span id="status"></span><textarea id="text"></textarea>
<select id="layer"><option>0</option><option>1</option></select>
<select id="head"><option>0</option><option>1</option><option>2</option><option>3</option></select>
{markup(element)}
<script type="module">
import {{ api, body, page, state }} from "/static/core.js";
import * as view from "/static/views/{view}.js";
window.view = view;
window.calls = [];
const text = document.getElementById("text");
const heads = () => state.ablate.map(String);
page.refresh = () => {{ window.calls.push(["refresh", state.layer, state.head, heads()]); }};
page.runText = () => {{ window.calls.push(["runText", text.value]); }};
state.model = {json.dumps(model)};
state.view = {json.dumps(view)};  // its tab (block follows the arrow keys only when shown)
state.text = text.value = {json.dumps(TEXT)};
const run = await api("/api/run", body());
state.info = run.model;
state.tokens = run.tokens;
document.querySelectorAll(".view").forEach((v) => v.classList.add("active"));
{setup}
view.wire{name}();
await view.load{name}();
document.body.dataset.ready = "1";
</script></body></html>"""
    # a page of the server's origin (its modules and API same-origin), answered by the test itself
    page.route(
        server + "/alone.html", lambda route: route.fulfill(content_type="text/html", body=html)
    )
    page.goto(server + "/alone.html")
    page.wait_for_selector("body[data-ready='1']", state="attached")
    assert set(page.scripts) == alone(view), page.scripts
    return page


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.parametrize("view", list(ALONE))
def test_each_view_module_draws_its_view_alone(server, page, view):
    open_alone(page, server, view)
    T = len(TEXT)  # a character tokenizer: one token per character
    if view == "dict":
        assert page.locator("#dict-threads line").count() == T
        assert abs(sum(page.evaluate("window.view.dictWeights()")) - 1) < 1e-5
        page.click("#dict-tokens .chip[data-index='3']")
        assert "query of token 3" in page.inner_text("#dict-note")
    elif view == "matrix":
        rows = page.evaluate("window.view.matrixValues().rows.map((r) => Array.from(r))")
        assert len(rows) == T and all(abs(sum(r) - 1) < 1e-5 for r in rows)
        assert all(rows[i][j] == 0 for i in range(T) for j in range(i + 1, T))  # causal
        page.click("#matrix-mask button[data-mask=none]")
        assert "mask none" in page.inner_text("#matrix-note")
    elif view == "heads":
        assert page.locator("#arc-paths path").count() > 0
        assert page.locator("#heads-grid canvas.thumb").count() == 2 * 4
        page.click("canvas.thumb[data-layer='1'][data-head='2']")  # opens that head: a refresh
        assert page.evaluate("window.calls") == [["refresh", 1, 2, []]]
        page.click("#click-mode button[data-click=knock]")
        page.click("canvas.thumb[data-layer='0'][data-head='3']")
        assert page.evaluate("window.calls")[-1] == ["refresh", 1, 2, ["0,3"]]
    elif view == "block":
        assert page.locator(".all-stages .stage").count() >= 14
        first = page.inner_text(".stage.current h3")
        page.keyboard.press("ArrowRight")
        assert page.inner_text(".stage.current h3") != first
    elif view == "next":
        assert page.locator(".next-bar").count() == 10
        assert page.locator("#dla rect").count() == 2 * 4 + 2  # every head and each layer's MLP
        page.click(".next-bar >> nth=0")  # appends that token: the page runs the new text
        (call,) = page.evaluate("window.calls")
        assert call[0] == "runText" and call[1].startswith(TEXT) and len(call[1]) > len(TEXT), call
    elif view == "knockout":
        assert page.is_visible("#knockout") and page.inner_text("#knockout-list") == "L1H2"
        assert page.locator("#knockout-strip path.curve-after").count() == 1
        page.click("#knockout-clear")
        assert page.evaluate("window.calls") == [["refresh", 0, 0, []]]
    elif view == "map":
        geometry = page.evaluate("window.view.map.geometry")
        assert (
            geometry["level"] == 0 and geometry["missing"] == 0
        )  # 44 tokens: the cells themselves
        cells = page.evaluate("Array.from(window.view.map.overviews.get('0/0').cells.values)")
        assert len(cells) == T * T and all(
            cells[i * T + j] == 0 for i in range(T) for j in range(i + 1, T)
        )
        assert all(
            abs(sum(cells[i * T : (i + 1) * T]) - 1) < 5e-3 for i in range(T)
        )  # float16 rows
        page.click("#map-zoom-in")
        assert page.evaluate("window.view.map.view.z") > geometry["z"]
    elif view == "generate":
        page.fill("#gen-max", "6")
        page.click("#gen-start")  # streams from the test server into the view
        page.wait_for_selector("body[data-generated='6']", state="attached")
        assert page.locator("#gen-tokens .gen-chip.new").count() == 6
        page.click("#gen-tokens .gen-chip.new >> nth=0")
        assert page.locator("#gen-candidates .gen-candidate").count() == 10
    elif view == "atlas":
        assert page.locator("#atlas-grid .atlas-cell").count() == 2 * 4
        page.click(".atlas-cell[data-layer='1'][data-head='2']")  # opens its matrix: a refresh
        assert page.evaluate("window.calls") == [["refresh", 1, 2, []]]
    elif view == "training":
        assert page.is_visible("#training")
        assert page.inner_text("#step-out").startswith("10 (2 of 3)")
        assert page.locator("#loss-curve #step-marker").count() == 1


@pytest.mark.browser
@pytest.mark.slow
def test_a_view_module_alone_shows_an_encoder(server, page):
    """The next-token module on an encoder says why it shows nothing, and asks nothing of it."""
    open_alone(page, server, "next", model="bert")
    assert "is an encoder" in page.inner_text("#next-note")
    assert page.locator(".next-bar").count() == 0


@pytest.mark.browser
@pytest.mark.slow
def test_the_notebook_frame_runs_the_inlined_modules(page, tmp_path):
    """attnlab.show's iframe (srcdoc, sandbox="allow-scripts": no origin, nothing to fetch) runs."""
    from attnlab.explorer.notebook import show

    frame = show(small_models()["gpt"], TEXT, name="gpt", view="heads")
    path = tmp_path / "notebook.html"
    frame = getattr(frame, "data", frame)  # IPython's HTML object, or the string without IPython
    path.write_text(f"<!doctype html><meta charset='utf-8'><body>{frame}</body>", encoding="utf-8")
    page.goto(path.as_uri())
    inner = page.frame_locator("iframe")
    inner.locator("body[data-ready=heads]:not([data-loading])").wait_for(state="attached")
    assert inner.locator("#heads-grid canvas.thumb").count() == 2 * 4
    assert page.scripts == []  # the modules are inline: nothing fetched
