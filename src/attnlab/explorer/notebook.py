"""`attnlab.show(model, text)`: the explorer's views inline in a Jupyter notebook.

The views are the exported page (attnlab.explorer.export) inside an iframe's `srcdoc`, so the page's
script and style cannot clash with the notebook's, and nothing needs a server or the network.
"""

from __future__ import annotations

import html

from .export import export_html


def show(
    model,
    text: str,
    *,
    name: str = "model",
    view: str = "dict",
    height: int = 760,
    ablate=(),
    ablation: str = "zero",
):
    """An IPython HTML object showing the views of `model` on `text` (the HTML string when IPython
    is absent).

    view: the tab to open first: "dict", "matrix", "heads", "block" or "next".
    ablate: heads to show knocked out, as (layer, head) pairs; ablation: "zero" or "mean" (over the
    text).
    """
    page = export_html(model, text, name=name, view=view, ablate=ablate, ablation=ablation)
    frame = (
        f'<iframe srcdoc="{html.escape(page, quote=True)}" '
        f'style="width:100%;height:{int(height)}px;border:0" '
        f'sandbox="allow-scripts" title="attnlab explorer"></iframe>'
    )
    try:
        from IPython.display import HTML
    except ImportError:
        return frame
    return HTML(frame)
