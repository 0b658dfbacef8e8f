"""Request bodies of the explorer's JSON API; FastAPI validates them (422 naming the field) and
documents them.

Validation is strict (pydantic's strict mode): a field takes exactly the JSON type the document
declares, so `"head": false` or `"layer": "1"` is refused rather than read as 0 or 1 (schemathesis
found the first).
An integer is JSON Schema's: any number without a fractional part, so `1.0` is the integer 1
(`Integer`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictInt

from .generation import MAX_NEW_TOKENS
from .models import Variant
from .service import MAX_CHARS

# a bound on the list's length before the model's own (n_layers x n_heads) is checked
MAX_ABLATED = 4096

TEXT_EXAMPLE = "The cat sat on the mat because it was tired."


def _integral(value):
    """A float without a fractional part (JSON's 1.0) as the int it is; anything else as it came,
    for strict validation to accept or refuse (a bool is not a float: still refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[StrictInt, BeforeValidator(_integral)]


def integer_or_none(*bounds):
    """Integer or null, its bounds (annotated_types' Ge, Le) inside the integer's own schema: given
    to the Field of an optional Integer, pydantic's document would write them as "ge"/"le", which
    JSON Schema lacks."""
    return Annotated[int, Strict(), *bounds, BeforeValidator(_integral)] | None


# a [layer, head] pair: a JSON array may be the tuple (not strict), its two numbers must be integers
# (strict)
Pair = Annotated[tuple[Integer, Integer], Strict(False)]


class TextRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str = Field(description="a model name from GET /api/models", examples=["minilm"])
    text: str = Field(
        min_length=1,
        max_length=MAX_CHARS,
        description=f"the input text (at most {MAX_CHARS} characters, and the model's token limit)",
        examples=[TEXT_EXAMPLE],
    )
    ablate: list[Pair] = Field(
        default_factory=list,
        max_length=MAX_ABLATED,
        description="heads to knock out, as [layer, head] pairs (each once, in range); "
        "every number then comes from the ablated model",
        examples=[[[5, 4], [5, 11]]],
    )
    ablation: Literal["zero", "mean"] = Field(
        "zero",
        description="knock a head out by zeroing its output z, or by "
        "replacing it with its mean over this text's positions",
    )
    step: integer_or_none(Ge(0)) = Field(
        None,
        description="a training step with a snapshot (GET /api/models lists them); "
        "none: the served weights",
    )

    def variant(self) -> Variant:
        return Variant(
            tuple((int(layer), int(head)) for layer, head in self.ablate), self.ablation, self.step
        )


class ContextRequest(TextRequest):
    layers: list[Integer] | None = Field(
        None,
        max_length=1024,
        description="the layers whose queries and keys to keep (at most as many as "
        "the explorer's budget holds at this text's length); none: every layer where they fit, "
        "else as many from layer 0 as fit. The answer's `layers` says which were kept",
        examples=[[0, 1, 2, 3]],
    )


class HeadRequest(TextRequest):
    layer: Integer = Field(ge=0, description="block index, from 0")
    head: Integer = Field(ge=0, description="query head index, from 0")


class PatternRequest(HeadRequest):
    encoding: Literal["json", "f32", "f16"] = Field(
        "json",
        description="matrices as nested lists, base64 little-endian "
        "float32 with a shape, or base64 float16 times `scale` (a causal "
        "pattern: its lower triangle only), for long texts",
    )


class StagesRequest(HeadRequest):
    mask: Literal["causal", "none"] = Field(
        "causal", description="the mask applied at the masked stage"
    )


class TraceRequest(TextRequest):
    layer: Integer = Field(ge=0, description="block index, from 0")
    token: Integer = Field(ge=0, description="position of the token to follow, from 0")


class ExpertsRequest(TextRequest):
    layer: Integer = Field(ge=0, description="block index, from 0: the layer whose router to show")


class AttributionRequest(TextRequest):
    token: Integer = Field(
        ge=0, description="the id of the predicted token whose logit is attributed"
    )


class NextTokenRequest(TextRequest):
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="divides the logits; 0 is greedy")
    top_k: integer_or_none(Ge(1)) = Field(None, description="keep only the k most likely tokens")
    top_p: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="keep the smallest set of tokens whose probability reaches p",
    )
    k: Integer = Field(10, ge=1, le=100, description="how many candidates to return")
    sample: bool = Field(False, description="also draw one token from the distribution")
    # exact as a double
    seed: integer_or_none(Ge(-(2**53)), Le(2**53)) = Field(None, description="seed of that draw")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str = Field(description="a model name from GET /api/models", examples=["minilm"])
    text: str = Field(
        min_length=1,
        max_length=MAX_CHARS,
        description="the prompt to continue, or with `chat` the user's message",
        examples=[TEXT_EXAMPLE],
    )
    chat: bool = Field(
        False,
        description="put the text through the model's chat template as one user message, and end "
        "the reply at its end-of-turn token",
    )
    max_new_tokens: Integer = Field(
        64,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="the most new tokens (fewer where the model's context or the explorer's "
        "token limit ends first)",
    )
    temperature: float = Field(0.8, ge=0.0, le=100.0, description="divides the logits; 0 is greedy")
    top_k: integer_or_none(Ge(1)) = Field(200, description="keep only the k most likely tokens")
    top_p: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="keep the smallest set of tokens whose probability reaches p",
    )
    # exact as a double
    seed: integer_or_none(Ge(-(2**53)), Le(2**53)) = Field(
        1337, description="seed of the draws (none: a fresh one)"
    )
    k: Integer = Field(10, ge=1, le=100, description="how many candidates each token shows")
    encoding: Literal["f16", "f32"] = Field(
        "f16",
        description="each step's attention rows as base64 float16 times `scale`, or float32",
    )
    step: integer_or_none(Ge(0)) = Field(
        None,
        description="a training step with a snapshot (GET /api/models lists them); "
        "none: the served weights",
    )
