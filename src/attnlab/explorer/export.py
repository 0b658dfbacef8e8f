"""One self-contained HTML file with the explorer's views on precomputed data (export-html,
notebooks).

Design choices:
- The page is the served page itself: index.html with style.css and its modules inlined (one
  module script, page_modules.inline_modules: the same files, dependencies first), plus
  `window.ATTNLAB_EXPORT = {models, text, responses}`. The page answers its API calls from
  `responses`, keyed exactly as it keys its own requests (`request_key` mirrors core.js's
  `requestKey`), so the exported views are the same code on the same numbers, with no server and no
  network.
- What is precomputed: the run, every layer's and head's pattern and 2-D projection, the heads grid
  and head scores,
  the next-token distribution at the page's default controls (causal models), and the block trace of
  every token in every layer, or of the last token only when that would be more than MAX_TRACES.
  The atlas (every head's scores on the probes and on the text) travels as data too, and so does
  a mixture of experts' router, every layer's. Interactions
  that need new numbers (another text, sampling, generation, which streams from a server) say that
  they need `attnlab explore`.
- With `ablate` (heads to knock out), every view's data is the ablated model's, as the page asks for
  it with those heads off, plus the knockout bar's comparison and the intact next-token
  distribution.
- Texts are capped at EXPORT_MAX_TOKENS tokens to keep the file small enough to share; floats in the
  JSON are rounded to 5 significant digits (the views print at most 4–6).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..errors import UserError
from . import STATIC, VIEWS
from .atlas import atlas
from .experts import experts
from .models import Variant
from .page_modules import inline_modules
from .service import ServedModels
from .views import Explorer

EXPORT_MAX_TOKENS = 128
# traces of every (layer, token) up to this many, else the last token of each layer
MAX_TRACES = 128


# what JavaScript's encodeURIComponent leaves as is, besides letters and digits
SAFE_IN_URI = "-_.!~*'()"


def request_key(path: str, body: dict[str, Any]) -> str:
    """The key core.js's `requestKey` gives a request: path, a space, then JSON of [key, value]
    pairs sorted by key."""
    return (
        path
        + " "
        + json.dumps(
            [[k, body[k]] for k in sorted(body)], separators=(",", ":"), ensure_ascii=False
        )
    )


def _round(value: Any, digits: int = 5) -> Any:
    if isinstance(value, float):
        return (
            value
            if value == 0 or not math.isfinite(value)
            else round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))
        )
    if isinstance(value, list):
        return [_round(v, digits) for v in value]
    if isinstance(value, dict):
        # the scale stays exact
        return {k: v if k == "scale" else _round(v, digits) for k, v in value.items()}
    return value


class _LayerSharingModels(ServedModels):
    """The server's models, except that everything asked of one layer (every head's pattern and
    projection, every token's trace) shares one forward pass: the server runs one pass per request,
    which for an export would be n_layers x (2 n_heads + n_tokens) passes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # ((model, ids, layer), the run's result): one layer at a time
        self._last: tuple[Any, Any] | None = None

    def cached_run(self, entry, ids, names_filter, layer=None):
        if layer is None:
            return super().cached_run(entry, ids, names_filter, layer)
        prefix = f"blocks.{layer}."
        wanted = (
            [n for n in entry.model.hook_dict if names_filter(n)]
            if callable(names_filter)
            else list(names_filter)
        )
        if not all(n.startswith(prefix) for n in wanted):
            return super().cached_run(entry, ids, names_filter, layer)
        key = (entry.name, tuple(ids.flatten().tolist()), layer)
        if self._last is None or self._last[0] != key:
            self._last = (
                key,
                super().cached_run(entry, ids, lambda n: n.startswith(prefix), layer),
            )
        return self._last[1]


def export_data(
    model, text: str, name: str = "model", ablate=(), ablation: str = "zero"
) -> dict[str, Any]:
    """The responses the page asks for on `text`, computed once: {models, text, responses}; with
    `ablate` ((layer, head) pairs), those of the model with those heads knocked out, as the page
    asks for them."""
    explorer = Explorer({name: model}, max_tokens=EXPORT_MAX_TOKENS, serving=_LayerSharingModels)
    cfg = model.config
    responses: dict[str, Any] = {}
    variant = Variant(tuple((int(layer), int(head)) for layer, head in ablate), ablation)
    plain = {"model": name, "text": text}
    base = (
        {**plain, "ablate": [list(h) for h in variant.ablate], "ablation": ablation}
        if variant.ablate
        else plain
    )

    def put(path: str, extra: dict[str, Any], value: dict[str, Any]) -> None:
        responses[request_key(path, {**base, **extra})] = _round(value)

    run = explorer.run(name, text, variant)
    put("/api/run", {}, run)
    T = len(run["tokens"])
    for layer in range(cfg.n_layers):
        for head in range(cfg.n_heads):
            where = {"layer": layer, "head": head}
            put(
                "/api/pattern",
                {**where, "encoding": "f32"},
                explorer.pattern(name, text, layer, head, "f32", variant),
            )
            put("/api/projection", where, explorer.projection(name, text, layer, head, variant))
        if cfg.n_experts:  # a mixture of experts' router, layer by layer
            put("/api/experts", {"layer": layer}, experts(explorer, name, text, layer, variant))
        tokens = range(T) if cfg.n_layers * T <= MAX_TRACES else [T - 1]
        for token in tokens:
            put(
                "/api/trace",
                {"layer": layer, "token": token},
                explorer.trace(name, text, layer, token, variant),
            )
    put("/api/heads", {}, explorer.heads(name, text, variant=variant))
    put("/api/atlas", {}, atlas(explorer, name, text, variant))
    # app.js asks for this with GET and no body, by a path built with encodeURIComponent (quote's
    # safe set)
    responses[f"/api/models/{quote(name, safe=SAFE_IN_URI)}/head-scores"] = _round(
        explorer.head_scores(name)
    )
    # app.js's next-token controls as the page opens
    defaults = {"temperature": 1, "top_k": None, "top_p": None}
    if cfg.causal:
        # The page asks for the top 10; with ablate, the before / after columns ask for the top 50
        # too: one forward pass gives both (the top 10 are the first 10 of the top 50, which topk
        # returns sorted).
        nxt = explorer.next_token(name, text, k=50 if variant.ablate else 10, variant=variant)
        put("/api/next", {**defaults, "k": 10}, {**nxt, "candidates": nxt["candidates"][:10]})
        # the next-token view's "who wrote this prediction", of its top candidate
        top = nxt["candidates"][0]["id"]
        put("/api/attribution", {"token": top}, explorer.attribution(name, text, top, variant))
    if variant.ablate:  # the knockout bar, and the next-token view's before / after columns
        put("/api/knockout", {}, explorer.knockout(name, text, variant))
        if cfg.causal:
            put("/api/next", {**defaults, "k": 50}, nxt)
            responses[request_key("/api/next", {**plain, **defaults, "k": 50})] = _round(
                explorer.next_token(name, text, k=50)
            )
    return {
        "models": explorer.list_models(),
        "text": text,
        "responses": responses,
        "ablate": [list(h) for h in variant.ablate],
        "ablation": ablation,
    }


def _inline_script(source: str) -> str:
    """JS or JSON safe inside <script>: no '</' that could close the element early."""
    return source.replace("</", "<\\/")


def export_html(
    model, text: str, name: str = "model", view: str = "dict", ablate=(), ablation: str = "zero"
) -> str:
    """The explorer page for `text` as one HTML string: style, script and data inlined; `ablate`:
    heads to show knocked out ((layer, head) pairs, `ablation` "zero" or "mean")."""
    if view not in VIEWS:
        raise UserError(f"unknown view {view!r}; choose one of {', '.join(VIEWS)}")
    data = export_data(model, text, name, ablate, ablation)
    data["view"] = view
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    style = (STATIC / "style.css").read_text(encoding="utf-8")
    script = inline_modules()
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    link = '<link rel="stylesheet" href="/static/style.css">'
    tag = '<script type="module" src="/static/app.js"></script>'
    assert link in page and tag in page, (
        "index.html must link /static/style.css and /static/app.js (a module)"
    )
    page = page.replace(link, f"<style>\n{style}</style>")
    page = page.replace(
        tag,
        f"<script>window.ATTNLAB_EXPORT = {_inline_script(payload)};</script>\n"
        f'<script type="module">\n{_inline_script(script)}</script>',
    )
    return page


def write_html(
    model,
    text: str,
    path: str | Path,
    name: str = "model",
    view: str = "dict",
    ablate=(),
    ablation: str = "zero",
) -> Path:
    """export_html's page written to `path` (atomically: a failed export leaves no partial
    file)."""
    from ..files import atomic_write_text

    path = Path(path)
    atomic_write_text(path, export_html(model, text, name, view, ablate, ablation))
    return path
