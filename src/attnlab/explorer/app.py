"""`create_app(models)`: the explorer's FastAPI application, built on demand (nothing happens at import).

Design choices:
- FastAPI's bigger-applications layout: this file wires things together, `routers/api.py` holds the JSON
  API (documented at /docs and /openapi.json) and `routers/page.py` serves the static page.
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
from fastapi.responses import JSONResponse

from ..errors import UserError
from .service import MAX_TOKENS, Explorer, TextTooLong, UnknownModel


def create_app(models: dict[str, Any], *, max_tokens: int = MAX_TOKENS,
               allowed_hosts: Iterable[str] | None = None) -> FastAPI:
    """The explorer app serving `models` (name -> attnlab Transformer with a tokenizer)."""
    from .routers import api, page

    app = FastAPI(
        title="attnlab explorer",
        summary="Attention on a real model: patterns, the soft dictionary, a block step by step, the next token.",
        version=_version(),
    )
    app.state.explorer = Explorer(models, max_tokens=max_tokens)
    if allowed_hosts is not None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    app.include_router(api.router)
    app.include_router(page.router)
    page.mount_static(app)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        status = 404 if isinstance(exc, UnknownModel) else 413 if isinstance(exc, TextTooLong) else 422
        return JSONResponse({"detail": str(exc)}, status_code=status)

    return app


def _version() -> str:
    from .. import __version__

    return __version__
