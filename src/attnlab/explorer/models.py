"""The models the explorer serves and the variants a request may ask for: a training step (`Run`,
its snapshots or Hub revisions), knocked-out heads (`Variant`); each served model an entry with its
own lock; and the errors a request can meet (404 NotFound, 409 Unsupported, 413 TextTooLong)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError

STEP_MODELS = 8  # snapshot models kept in memory per served run (least recently used go first)


class NotFound(UserError):
    """Something a request names that this explorer does not have: a training step without a
    snapshot, or the training record of a model served without snapshots (HTTP 404)."""


class UnknownModel(NotFound):
    """A model name that the explorer was not started with (HTTP 404)."""


class Unsupported(UserError):
    """A request this model cannot answer, whatever its values: a next token or a direct logit
    attribution from an encoder, which predicts no next token, or the router of a dense model,
    which has no experts (HTTP 409)."""


class TextTooLong(UserError):
    """A text over the token limit (HTTP 413)."""


@dataclass(frozen=True)
class Variant:
    """Which model a request sees: the served one, or its snapshot at a training step, with heads
    knocked out."""

    ablate: tuple[tuple[int, int], ...] = ()  # (layer, head) pairs whose output z is ablated
    ablation: str = "zero"  # "zero", or "mean": each head's mean z over this text's positions
    step: int | None = None  # a training step with a snapshot; None: the served weights


PLAIN = Variant()


@dataclass
class Run:
    """A served model's course of training: its weights at each step, from a run's snapshots
    (`attnlab train --snapshots N`) or from a Hub repository's training-step revisions (Pythia's
    stepN branches), and the step the page opens on."""

    path: Path | None  # the run's directory (its metrics.jsonl); None for a Hub repository
    # step -> snapshot file, or the Hub revision holding that step's weights
    snapshots: dict[int, Path | str]
    start_step: int | None = None
    # a text to open the page on (e.g. the induction experiment's repeated spans)
    example: str | None = None
    # step -> loaded snapshot model (an LRU)
    models: OrderedDict = field(default_factory=OrderedDict)
    # /api/models/{name}/training, computed once (per set of scored steps)
    curves: dict[str, Any] | None = None
    repo_id: str | None = None  # the Hub repository whose revisions `snapshots` names
    # the step whose weights the served model already holds (never loaded twice)
    served_step: int | None = None
    # step -> head scores, kept when its model is dropped
    scores: dict[int, Any] = field(default_factory=dict)

    def load(self, model, step: int):
        """`model` at `step`: the snapshot file read into a copy of it, or the Hub revision loaded
        (fetched into the Hugging Face cache on first use; the served model's tokenizer is kept)."""
        if self.repo_id is None:
            from ..training.snapshots import load_snapshot

            return load_snapshot(model, self.snapshots[step])
        from ..workbench import load

        revision = self.snapshots[step]
        loaded = load(self.repo_id, revision=revision)
        shape = ("n_layers", "n_heads", "d_model", "d_vocab")
        if any(getattr(loaded.config, k) != getattr(model.config, k) for k in shape):
            raise UserError(
                f"{self.repo_id} revision {revision!r} has another shape than the served revision "
                f"({', '.join(f'{k} {getattr(loaded.config, k)}' for k in shape)}); the step "
                "slider needs "
                "one model trained through its steps"
            )
        loaded.tokenizer = model.tokenizer
        return loaded.eval()


@dataclass
class ModelEntry:
    name: str
    model: Any  # attnlab.Transformer, in eval mode
    lock: threading.Lock = field(default_factory=threading.Lock)
    scores: dict[str, Any] | None = None  # head scores, computed on first use (see head_scores)
    hooks: tuple = ()  # fwd_hooks every forward pass of this entry runs with (ablations)
    run: Run | None = None  # the training run it came from, when it has snapshots
