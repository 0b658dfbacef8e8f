"""Request bodies of the explorer's JSON API; FastAPI validates them (422 naming the field) and documents them.

Validation is strict (pydantic's strict mode): a field takes exactly the JSON type the document declares,
so `"head": false` or `"layer": "1"` is refused rather than read as 0 or 1 (schemathesis found the first).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt

from .service import MAX_CHARS, Variant

MAX_ABLATED = 4096  # a bound on the list's length before the model's own (n_layers x n_heads) is checked

TEXT_EXAMPLE = "The cat sat on the mat because it was tired."
# a [layer, head] pair: a JSON array may be the tuple (not strict), its two numbers must be integers (strict)
Pair = Annotated[tuple[StrictInt, StrictInt], Strict(False)]


class TextRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str = Field(description="a model name from GET /api/models", examples=["minilm"])
    text: str = Field(max_length=MAX_CHARS, description=f"the input text (at most {MAX_CHARS} characters, and the model's token limit)",
                      examples=[TEXT_EXAMPLE])
    ablate: list[Pair] = Field(default_factory=list, max_length=MAX_ABLATED,
                                          description="heads to knock out, as [layer, head] pairs (each once, in range); "
                                          "every number then comes from the ablated model", examples=[[[5, 4], [5, 11]]])
    ablation: Literal["zero", "mean"] = Field("zero", description="knock a head out by zeroing its output z, or by "
                                              "replacing it with its mean over this text's positions")
    step: int | None = Field(None, ge=0, description="a training step with a snapshot (GET /api/models lists them); "
                             "none: the served weights")

    def variant(self) -> Variant:
        return Variant(tuple((int(layer), int(head)) for layer, head in self.ablate), self.ablation, self.step)


class HeadRequest(TextRequest):
    layer: int = Field(ge=0, description="block index, from 0")
    head: int = Field(ge=0, description="query head index, from 0")


class PatternRequest(HeadRequest):
    encoding: Literal["json", "f32", "f16"] = Field("json", description="matrices as nested lists, base64 little-endian "
                                                    "float32 with a shape, or base64 float16 times `scale` (a causal "
                                                    "pattern: its lower triangle only), for long texts")


class StagesRequest(HeadRequest):
    mask: Literal["causal", "none"] = Field("causal", description="the mask applied at the masked stage")


class TraceRequest(TextRequest):
    layer: int = Field(ge=0, description="block index, from 0")
    token: int = Field(ge=0, description="position of the token to follow, from 0")


class AttributionRequest(TextRequest):
    token: int = Field(ge=0, description="the id of the predicted token whose logit is attributed")


class NextTokenRequest(TextRequest):
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="divides the logits; 0 is greedy")
    top_k: int | None = Field(None, ge=1, description="keep only the k most likely tokens")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="keep the smallest set of tokens whose probability reaches p")
    k: int = Field(10, ge=1, le=100, description="how many candidates to return")
    sample: bool = Field(False, description="also draw one token from the distribution")
    seed: int | None = Field(None, description="seed of that draw")
