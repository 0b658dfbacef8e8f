"""The explorer: each figure of the attention chapters, live on a real model, in the browser.

- `app.create_app(models)` builds the FastAPI app (routers in `routers/`, computations in
  `service`).
- `cli` adds `attnlab explore` and `attnlab export-html`; `notebook.show` displays the views in
  Jupyter.
- `static/` holds the page: plain JavaScript drawing with SVG and Canvas, no build step and no
  network, so it ships inside the package and runs offline.

Only constants live here, so that the command line can name the views, limits and defaults without
importing FastAPI or torch.
"""

from pathlib import Path

STATIC = Path(__file__).resolve().parent / "static"  # index.html, app.js and its modules, style.css
# the page's tabs
VIEWS = ("dict", "matrix", "heads", "block", "next", "generate", "atlas", "experts")
# the default cap on a text's length, in tokens, or the model's context (n_ctx) when that is longer
# (explore --max-tokens changes it)
MAX_TOKENS = 2048
# requests to the API computed or waiting at once (work_queue.WorkQueue); the page sends at most 3
# at once
QUEUE = 16
