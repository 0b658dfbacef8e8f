"""The whole context under /api/context: a text run once (POST), then any head's pattern as a pooled
overview or as tiles of a finer level, in binary (explorer/context.py says how and why).

The binary answers are `application/octet-stream`: a 32-byte header (context.HEADER) and the cells.
Refusals are JSON, as everywhere in the API: 404 for a context the explorer does not keep (post the
text again) and for a level or tile outside the matrix (the request is well formed: the tile it
names does not exist, its range set by the text's length), 413 for a text over the token limit or
the memory budget, 422 for a layer or head out of the model's range.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from ..context import MAX_OVERVIEW, open_context, overview, tile
from ..schemas import ContextRequest
from ..views import Explorer
from .api import ERRORS, answer, get_explorer

router = APIRouter(prefix="/api", tags=["whole context"])

BINARY = {
    200: {
        "description": "the cells: a 32-byte little-endian header (b'ATL1', level, rows, cols, "
        "first row, first column, tokens, bytes per value), then rows × cols float16 (or float32) "
        "values, row by row",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    404: {
        "description": "no such context kept (it may have been dropped: post the text again), a "
        "layer it does not keep (post the text again with those layers), or a level or tile "
        "outside this text's matrix"
    },
    422: {"description": "a layer or head outside this model's range, or an invalid field"},
}
Layer = Annotated[int, Query(ge=0, description="block index, from 0")]
Head = Annotated[int, Query(ge=0, description="query head index, from 0")]
Dtype = Annotated[
    Literal["f16", "f32"], Query(description="the cells as float16 (2 bytes) or float32 (4 bytes)")
]


def binary(data: bytes) -> Response:
    return Response(data, media_type="application/octet-stream")


@router.post(
    "/context",
    summary="Run a text through the model once and keep its queries and keys for /overview "
    "and /tile",
    responses=ERRORS,
)
def create(body: ContextRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(open_context(explorer, body.model, body.text, body.variant(), body.layers))


@router.get(
    "/context/status",
    summary="The contexts kept, their bytes, the budget and the server's resident memory",
)
def status(explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(explorer.contexts.status())


@router.get(
    "/context/{context}/overview",
    summary="One head's whole pattern, max-pooled to at most `size` cells per side (binary)",
    response_class=Response,
    responses=BINARY,
)
def context_overview(
    context: str,
    layer: Layer,
    head: Head,
    size: Annotated[
        int, Query(ge=16, le=MAX_OVERVIEW, description="the screen's side, in pixels")
    ] = 1024,
    dtype: Dtype = "f16",
    explorer: Explorer = Depends(get_explorer),
) -> Response:
    return binary(overview(explorer.contexts.get(context), layer, head, size, dtype))


@router.get(
    "/context/{context}/tile",
    summary="One tile of one head's pattern at a level: 2^level × 2^level max-pools (binary)",
    response_class=Response,
    responses=BINARY,
)
def context_tile(
    context: str,
    layer: Layer,
    head: Head,
    level: Annotated[int, Query(ge=0, description="0: single cells; each level up pools 2 × 2")],
    row: Annotated[int, Query(ge=0, description="the tile's row, from 0")],
    col: Annotated[int, Query(ge=0, description="the tile's column, from 0")],
    dtype: Dtype = "f16",
    explorer: Explorer = Depends(get_explorer),
) -> Response:
    return binary(tile(explorer.contexts.get(context), layer, head, level, row, col, dtype))
