"""The JSON API under /api: one route per view, each a thin call into `Explorer` (see service.py).

Routes are plain `def`s: FastAPI runs them in its thread pool, so a long forward pass never blocks
the event loop, and the per-model lock in the service keeps concurrent passes on one model apart.
Each route also encodes its answer there (`answer`): returned as a dict, FastAPI would encode it
after the route, in the event loop, and a 150 kB answer (every head's pattern, a block's trace)
takes milliseconds to encode, during which the queue could not refuse anyone (work_queue.py answers
its 503s from the event loop).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import TypeAdapter

from ..atlas import atlas as compute_atlas
from ..experts import experts as compute_experts
from ..generation import open_generation
from ..schemas import (
    AttributionRequest,
    ExpertsRequest,
    GenerateRequest,
    HeadRequest,
    NextTokenRequest,
    PatternRequest,
    StagesRequest,
    TextRequest,
    TraceRequest,
)
from ..views import Explorer

router = APIRouter(prefix="/api", tags=["explorer"])

NOT_FOUND = {
    "description": "unknown model, a training step without a snapshot, or a token position past "
    "the text's end",
    "content": {"application/json": {"example": {"detail": "unknown model 'x'; ..."}}},
}
ERRORS = {
    404: NOT_FOUND,
    413: {
        "description": "text over the token limit",
        "content": {
            "application/json": {
                "example": {
                    "detail": "the text is 600 tokens; the explorer's limit ... is 512 tokens; "
                    "shorten it"
                }
            }
        },
    },
    422: {
        "description": "layer or head out of range, a head listed twice or too many "
        "heads in "
        "ablate, or an invalid field"
    },
}
# what a causal model's views add: an encoder predicts no next token
CAUSAL_ERRORS = {
    **ERRORS,
    409: {
        "description": "the model is an encoder: it predicts no next token",
        "content": {
            "application/json": {
                "example": {"detail": "model 'minilm' is an encoder (not causal): ..."}
            }
        },
    },
}


def get_explorer(request: Request) -> Explorer:
    return request.app.state.explorer


# what FastAPI encodes a returned value with: a NaN or infinity becomes null
ENCODER = TypeAdapter(Any)


def answer(content: Any) -> Any:
    """The JSON response, encoded here in the route's thread (module docstring), byte for byte as
    FastAPI would have. The routes keep their declared return type, which is what the OpenAPI
    document describes."""
    return Response(ENCODER.dump_json(content), media_type="application/json")


@router.get("/models", summary="List the models this explorer serves")
def list_models(explorer: Explorer = Depends(get_explorer)) -> list[dict[str, Any]]:
    return answer(explorer.list_models())


@router.post("/run", summary="Tokenize a text for a model", responses=ERRORS)
def run(body: TextRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(explorer.run(body.model, body.text, body.variant()))


@router.post(
    "/pattern",
    summary="One head's raw scores q·kᵀ, the scale, and its attention pattern",
    responses=ERRORS,
)
def pattern(body: PatternRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(
        explorer.pattern(
            body.model, body.text, body.layer, body.head, body.encoding, body.variant()
        )
    )


@router.post(
    "/stages",
    summary="One head's raw scores -> scaled -> masked -> softmax, with a chosen mask",
    responses=ERRORS,
)
def stages(body: StagesRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(
        explorer.stages(body.model, body.text, body.layer, body.head, body.mask, body.variant())
    )


@router.post(
    "/projection",
    summary="One head's keys, queries and values projected to 2-D (the soft dictionary)",
    responses=ERRORS,
)
def projection(body: HeadRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(explorer.projection(body.model, body.text, body.layer, body.head, body.variant()))


@router.post(
    "/heads",
    summary="Thumbnails of every layer's and head's pattern, with head scores when available",
    responses=ERRORS,
)
def heads(body: TextRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(explorer.heads(body.model, body.text, variant=body.variant()))


@router.get(
    "/models/{name}/head-scores",
    summary="Head scores (previous-token, induction, ...) of every head, when attnlab.inspection "
    "is installed",
    responses={404: NOT_FOUND},
)
def head_scores(
    name: str, step: int | None = None, explorer: Explorer = Depends(get_explorer)
) -> dict[str, Any]:
    return answer(explorer.head_scores(name, step))


@router.get(
    "/models/{name}/training",
    summary="A run's snapshot steps, logged losses and every head's scores at each snapshot",
    responses={404: {"description": "unknown model, or a model served without training snapshots"}},
)
def training(name: str, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(explorer.training(name))


@router.post(
    "/attribution",
    summary="Who wrote this prediction: each head's and MLP's direct contribution to a next "
    "token's logit",
    responses=CAUSAL_ERRORS,
)
def attribution(
    body: AttributionRequest, explorer: Explorer = Depends(get_explorer)
) -> dict[str, Any]:
    return answer(explorer.attribution(body.model, body.text, body.token, body.variant()))


@router.post(
    "/knockout",
    summary="Knock out heads: per-token loss and last-hidden-state cosine, with and without them",
    responses=ERRORS,
)
def knockout(body: TextRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(explorer.knockout(body.model, body.text, body.variant()))


@router.post(
    "/trace",
    summary="One token through one block, stage by stage (from run_with_cache)",
    responses=ERRORS,
)
def trace(body: TraceRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(explorer.trace(body.model, body.text, body.layer, body.token, body.variant()))


@router.post(
    "/next",
    summary="Next-token probabilities after temperature, top-k and top-p; optionally a draw",
    responses=CAUSAL_ERRORS,
)
def next_token(
    body: NextTokenRequest, explorer: Explorer = Depends(get_explorer)
) -> dict[str, Any]:
    return answer(
        explorer.next_token(
            body.model,
            body.text,
            body.temperature,
            body.top_k,
            body.top_p,
            body.k,
            body.sample,
            body.seed,
            body.variant(),
        )
    )


@router.post(
    "/atlas",
    summary="Every head scored for what it does (previous token, induction, duplicate token, "
    "first-token sink, local window), on the standard probes (as `attnlab heads`) and on this text",
    responses=ERRORS,
)
def atlas(body: TextRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(compute_atlas(explorer, body.model, body.text, body.variant()))


# what a view of the router adds: a dense model has none
MOE_ERRORS = {
    **ERRORS,
    409: {
        "description": "the model has no experts (a dense MLP in every block): no router to show",
        "content": {
            "application/json": {
                "example": {"detail": "model 'gpt' has no experts (a dense MLP in every block) ..."}
            }
        },
    },
}


@router.post(
    "/experts",
    summary="A mixture of experts' router on a text: one layer's scores over every expert for "
    "each token (hook_expert_weights), the experts each chose (hook_expert_indices) with their "
    "weights, and every layer's load",
    responses=MOE_ERRORS,
)
def experts(body: ExpertsRequest, explorer: Explorer = Depends(get_explorer)) -> dict[str, Any]:
    return answer(compute_experts(explorer, body.model, body.text, body.layer, body.variant()))


# one line of the generation stream (explorer/generation.py): what a client can rely on
GENERATE_LINE = {
    "type": "object",
    "required": ["event"],
    "properties": {
        "event": {"enum": ["start", "token", "end", "error"]},
        "index": {"type": "integer", "description": "token: its position in the sequence"},
        "id": {"type": "integer"},
        "piece": {"type": "string", "description": "token: the text it adds"},
        "rows": {
            "type": "object",
            "description": "token: every head's attention row of the step that wrote it, "
            "[n_layers · n_heads, key_pos], encoded as /api/pattern's matrices",
        },
        "candidates": {"type": "array", "items": {"type": "object"}},
        "kv_positions": {"type": "integer"},
        "detail": {"type": "string", "description": "error: what went wrong"},
    },
}


@router.post(
    "/generate",
    summary="Generate from a prompt (or a chat message), streamed: one JSON line per new token "
    "with every head's attention row and the top candidates",
    description="NDJSON (application/x-ndjson): a `start` line, one `token` line per token as it "
    "is computed, then `end` (or `error`). Closing the connection stops the generation.",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "the stream, one JSON object per line",
            "content": {"application/x-ndjson": {"schema": GENERATE_LINE}},
        },
        **CAUSAL_ERRORS,
        409: {
            "description": "the model is an encoder, or chat was asked of a model without a chat "
            "template"
        },
        413: {"description": "the prompt is over the token limit or leaves no room to generate"},
    },
)
def generate(
    body: GenerateRequest, explorer: Explorer = Depends(get_explorer)
) -> StreamingResponse:
    generation = open_generation(explorer, body)  # every refusal before the first byte
    return StreamingResponse(
        generation.lines(),
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-store"},
    )
