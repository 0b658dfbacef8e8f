"""`create_app(models)`: the explorer's FastAPI application, built on demand (nothing happens at import).

Design choices:
- FastAPI's bigger-applications layout: this file wires things together, `routers/api.py` holds the JSON
  API (documented at /openapi.json, and as a plain offline page at /docs) and `routers/page.py` serves
  the static page. FastAPI's Swagger and ReDoc pages load their scripts from a CDN, so they are off.
- The `Explorer` (models and computations) lives on `app.state`, reached by a dependency, so each app
  has its own models and tests can build as many apps as they like.
- Errors: an unknown model is 404, a text over the limit 413, any other mistake in a request
  (a layer, head or token index out of range, a bad mask name) 422; the body is {"detail": message}.
- No CORS middleware: the page is served from the same origin, and no other site should be able to read
  the API. With `allowed_hosts`, requests for any other Host are refused (DNS-rebinding protection).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from ..errors import UserError
from .service import MAX_TOKENS, Explorer, Run, TextTooLong, UnknownModel


def create_app(models: dict[str, Any], *, max_tokens: int = MAX_TOKENS,
               allowed_hosts: Iterable[str] | None = None, runs: dict[str, Run] | None = None) -> FastAPI:
    """The explorer app serving `models` (name -> attnlab Transformer with a tokenizer); `runs`: the training
    runs (snapshots) some of them come from, by the same names."""
    from .routers import api, page

    app = FastAPI(
        title="attnlab explorer",
        summary="Attention on a real model: patterns, the soft dictionary, a block step by step, the next token.",
        version=_version(),
        docs_url=None,
        redoc_url=None,
    )
    app.state.explorer = Explorer(models, max_tokens=max_tokens, runs=runs)
    if allowed_hosts is not None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    app.include_router(api.router)
    app.include_router(page.router)
    page.mount_static(app)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(render_api_docs(app.openapi()))

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        status = 404 if isinstance(exc, UnknownModel) else 413 if isinstance(exc, TextTooLong) else 422
        return JSONResponse({"detail": str(exc)}, status_code=status)

    return app


def _version() -> str:
    from .. import __version__

    return __version__


def render_api_docs(spec: dict[str, Any]) -> str:
    """The OpenAPI description as one plain HTML page that needs no network (unlike Swagger UI)."""
    from html import escape

    rows = []
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            params = ", ".join(p["name"] for p in op.get("parameters", []))
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            body_name = body.get("$ref", "").rsplit("/", 1)[-1]
            rows.append(
                f"<tr><td><code>{method.upper()} {escape(path)}</code></td><td>{escape(op.get('summary', ''))}"
                f"<br><small>{escape(op.get('description', '') or '')}</small></td>"
                f"<td>{escape(params)}{' body: ' + escape(body_name) if body_name else ''}</td></tr>"
            )
    title = escape(spec.get("info", {}).get("title", "API"))
    return (
        f"<!doctype html><meta charset=utf-8><title>{title} API</title>"
        "<style>body{font:14px system-ui;margin:2em}td{border-top:1px solid #ddd;padding:.4em;vertical-align:top}</style>"
        f"<h1>{title} API</h1><p>Machine-readable: <a href=/openapi.json>/openapi.json</a></p>"
        f"<table><tr><th>route</th><th>what</th><th>inputs</th></tr>{''.join(rows)}</table>"
    )
