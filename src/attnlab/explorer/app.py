"""`create_app(models)`: the explorer's FastAPI application, built on demand (nothing happens at
import).

Design choices:
- FastAPI's bigger-applications layout: this file wires things together, `routers/api.py` holds the
  JSON
  API (documented at /openapi.json, and as a plain offline page at /docs) and `routers/page.py`
  serves the static page. FastAPI's Swagger and ReDoc pages load their scripts from a CDN, so they
  are off.
- The `Explorer` (models and computations) lives on `app.state`, reached by a dependency, so each
  app has its own models and tests can build as many apps as they like.
- Errors: an unknown model, a training step without a snapshot or a token position past the text's
  end is 404, a next token or an attribution asked of an encoder 409 (and the router asked of a
  dense model, which has no experts), a text over the limit 413,
  any other mistake in a request (a layer or head out of range, a bad mask name) 422; the body is
  {"detail": message}. Each route declares the statuses it can answer (routers/api.py), so a
  client generating requests from the document knows them.
- Guarded and queued as a whole, so a route added later is too: `security.Guard` (Host, Origin,
  Content-Type, token, the security headers, never a CORS header) and `work_queue.WorkQueue` (one
  computation at a time, a bounded number waiting, 503 with Retry-After beyond) wrap the app as
  middleware, and a request body over MAX_BODY_BYTES is refused with 413 before it is read whole.
- The OpenAPI document is this server's: `describe_statuses` declares on every operation each status
  the middleware can answer (400, 403, 413, 415, 503), and `describe_models` narrows model names,
  layer, head and token ranges to the models served, so a client generating requests from the
  document (such as schemathesis, tests/test_explorer_fuzz.py) reaches real models.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from ..errors import UserError
from . import QUEUE
from .models import NotFound, Run, TextTooLong, Unsupported
from .security import LOOPBACK_HOSTS, Guard
from .service import MAX_CHARS
from .views import Explorer
from .work_queue import QUEUE_PREFIX, WorkQueue

# A request body's limit: the longest text JSON-escaped (12 bytes, \uXXXX\uXXXX, for a character
# outside the BMP) and room for the other fields.
MAX_BODY_BYTES = 12 * MAX_CHARS + 64 * 1024
# a service UserError's HTTP status (other: 422)
STATUSES = {NotFound: 404, Unsupported: 409, TextTooLong: 413}


def create_app(
    models: dict[str, Any],
    *,
    max_tokens: int | None = None,
    runs: dict[str, Run] | None = None,
    hosts: Iterable[str] = LOOPBACK_HOSTS,
    token: str | None = None,
    queue: int = QUEUE,
) -> FastAPI:
    """The explorer app serving `models` (name -> attnlab Transformer with a tokenizer); `runs`: the
    training
    runs (snapshots) some of them come from, by the same names.

    hosts: the names a request's Host may carry besides the loopback names ("0.0.0.0": any, for a
    server listening on every interface that relies on its token). token: required on every request
    but the page's own files, when given. queue: requests under /api/ admitted at once (running and
    waiting).
    """
    from .routers import api, context, page

    app = FastAPI(
        title="attnlab explorer",
        summary="Attention on a real model: patterns, the soft dictionary, a block step by step, "
        "the next token.",
        version=_version(),
        docs_url=None,
        redoc_url=None,
    )
    app.state.explorer = Explorer(models, max_tokens=max_tokens, runs=runs)
    app.add_middleware(WorkQueue, capacity=queue)
    # added last, so it runs first
    app.add_middleware(Guard, hosts=hosts, token=token, max_body=MAX_BODY_BYTES)
    app.include_router(api.router)
    app.include_router(context.router)
    app.include_router(page.router)
    page.mount_static(app)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(render_api_docs(app.openapi()))

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        status = next((code for kind, code in STATUSES.items() if isinstance(exc, kind)), 422)
        return JSONResponse({"detail": str(exc)}, status_code=status)

    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe_statuses(describe_models(generate(), app.state.explorer))
        return app.openapi_schema

    app.openapi = openapi
    return app


MESSAGE = {
    "title": "Message",
    "type": "object",
    "required": ["detail"],
    "properties": {"detail": {"type": "string"}},
}
# What the middleware (security.Guard, work_queue.WorkQueue, the body limit) may answer, on any
# operation.
GUARD_STATUSES = {
    "400": "the Host header is not this server's name (DNS rebinding)",
    "403": "a cross-origin request, or no token where the server requires one",
    "413": "the request body is over the size limit (or, where there is a text, the text over the "
    "token limit)",
    "415": "a request body that is not sent as application/json",
    "503": "the queue of model work is full: retry after Retry-After seconds",
}


def describe_statuses(spec: dict[str, Any]) -> dict[str, Any]:
    """Declare on every operation each status the server can answer, with the body it carries.

    The middleware's refusals and the service's 404/413/422 carry {"detail": message}, a string; a
    422 from FastAPI's request validation carries its list of errors instead, so a declared 422 is
    either.
    """
    from fastapi.openapi.utils import (
        validation_error_definition,
        validation_error_response_definition,
    )

    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas["Message"] = MESSAGE
    # FastAPI adds these only where a route declares no 422 of its own; every body can fail
    # validation
    schemas.setdefault("ValidationError", validation_error_definition)
    schemas.setdefault("HTTPValidationError", validation_error_response_definition)
    message = {"$ref": "#/components/schemas/Message"}
    validation = {"anyOf": [{"$ref": "#/components/schemas/HTTPValidationError"}, message]}
    for path, methods in spec.get("paths", {}).items():
        for op in methods.values():
            responses = op.setdefault("responses", {})
            for status, description in GUARD_STATUSES.items():
                if (status == "415" and "requestBody" not in op) or (
                    status == "503" and not path.startswith(QUEUE_PREFIX)
                ):
                    continue
                responses.setdefault(status, {"description": description})
            for status, response in responses.items():
                if status.startswith("2"):
                    continue
                content = response.setdefault("content", {}).setdefault("application/json", {})
                content["schema"] = validation if status == "422" else message
            if "503" in responses:
                responses["503"]["headers"] = {
                    "Retry-After": {
                        "description": "seconds to wait before retrying",
                        "schema": {"type": "integer"},
                    }
                }
    return spec


def describe_models(spec: dict[str, Any], explorer: Explorer) -> dict[str, Any]:
    """The document's request fields narrowed to the models served, so that a request it allows is
    one the server can answer: `model` (and a path's model `name`) is one of their names; `layer`,
    `head` and `token` (a position; an attributed token is an id, below the vocabulary size) are at
    most the largest index any of them has; `ablate` holds distinct in-range [layer, head] pairs, at
    most every head once, and `layers` in-range layers, at least one; and where every model
    reads text one character at a time, `text` is made of the characters they all know. With
    several models of different sizes, an index in range for the largest can still be out of range
    for a smaller one (422): JSON Schema cannot make one field's range depend on another's value."""
    models = [e.model for e in explorer.served.entries.values()]
    largest = {
        "layer": max(m.config.n_layers for m in models) - 1,
        "head": max(m.config.n_heads for m in models) - 1,
        "token": max(explorer.served.token_limit(m) for m in models) - 1,
    }
    names = list(explorer.served.entries)
    schemas = spec.get("components", {}).get("schemas", {})
    for schema in schemas.values():
        properties = schema.get("properties", {})
        if "model" in properties:
            properties["model"]["enum"] = names
        for field, top in largest.items():
            if properties.get(field, {}).get("type") == "integer":
                properties[field]["maximum"] = top
        if "ablate" in properties:
            pair = properties["ablate"]["items"]
            pair["prefixItems"] = [
                {"type": "integer", "minimum": 0, "maximum": largest["layer"]},
                {"type": "integer", "minimum": 0, "maximum": largest["head"]},
            ]
            properties["ablate"].update(
                uniqueItems=True,
                examples=[[[largest["layer"], 0]]],
                maxItems=max(m.config.n_layers * m.config.n_heads for m in models),
            )
        if "layers" in properties:  # a context's kept layers: in range, at least one (a layer
            # named twice is kept once, so neither uniqueness nor a length is required)
            layers = properties["layers"]
            for option in layers.get("anyOf", [layers]):
                if option.get("type") == "array":
                    option["items"] = {"type": "integer", "minimum": 0, "maximum": largest["layer"]}
                    option["minItems"] = 1
        if "text" in properties and (characters := known_characters(models)):
            properties["text"]["pattern"] = (
                "^[" + "".join(f"\\u{ord(c):04x}" for c in characters) + "]*$"
            )
    if "AttributionRequest" in schemas:
        schemas["AttributionRequest"]["properties"]["token"]["maximum"] = (
            max(m.config.d_vocab for m in models) - 1
        )
    for methods in spec.get("paths", {}).values():
        for op in methods.values():
            for param in op.get("parameters", []):
                if param.get("in") == "path" and param["name"] == "name":
                    param["schema"]["enum"] = names
                if param.get("in") == "query" and param["name"] in ("layer", "head"):
                    param["schema"]["maximum"] = largest[param["name"]]
    return spec


def known_characters(models) -> list[str] | None:
    """The characters every model's character-level tokenizer knows, sorted; None when a model reads
    text
    another way (a BPE or WordPiece tokenizer takes any text) or one of them lies outside the BMP (a
    regex \\uXXXX escape cannot name it)."""
    vocabularies = []
    for model in models:
        tokenizer = model.tokenizer
        if tokenizer is None or tokenizer.kind != "char":
            return None
        vocabularies.append({c for c in tokenizer.backend.get_vocab() if len(c) == 1})
    known = sorted(set.intersection(*vocabularies))
    return known if known and all(ord(c) <= 0xFFFF for c in known) else None


def _version() -> str:
    from ..version import __version__

    return __version__


def render_api_docs(spec: dict[str, Any]) -> str:
    """The OpenAPI description as one plain HTML page that needs no network (unlike Swagger UI)."""
    from html import escape

    rows = []
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            params = ", ".join(p["name"] for p in op.get("parameters", []))
            body = (
                op.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema", {})
            )
            body_name = body.get("$ref", "").rsplit("/", 1)[-1]
            rows.append(
                f"<tr><td><code>{method.upper()} "
                f"{escape(path)}</code></td><td>{escape(op.get('summary', ''))}"
                f"<br><small>{escape(op.get('description', '') or '')}</small></td>"
                f"<td>{escape(params)}"
                f"{' body: ' + escape(body_name) if body_name else ''}</td></tr>"
            )
    title = escape(spec.get("info", {}).get("title", "API"))
    return (
        f"<!doctype html><meta charset=utf-8><title>{title} API</title>"
        # a file, not inline: the CSP allows only this origin's styles
        '<link rel="stylesheet" href="/static/docs.css">'
        f"<h1>{title} API</h1><p>Machine-readable: <a href=/openapi.json>/openapi.json</a></p>"
        f"<table><tr><th>route</th><th>what</th><th>inputs</th></tr>{''.join(rows)}</table>"
    )
