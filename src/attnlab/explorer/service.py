"""The models the explorer serves (`ServedModels`): a request's lookups, the limits it is checked
against, and the one forward pass with `run_with_cache` behind every view (views.py computes the
views from it).

Design choices:
- Every number the page shows comes from one forward pass with `run_with_cache`, restricted by
  `names_filter` to the hooks a view needs, so a 512-token text never materialises a full cache of
  every layer's patterns unless the heads grid asks for them.
- Hooks are attached to the model's modules, so two forward passes on one model at once would mix
  their
  caches: each model has a lock, held for the whole pass. Nothing else is shared between requests.
- Models come only from the dict given (name -> loaded model, the sources named on the command
  line); a request names a model by its key, and no request value ever reaches the file system.
- Limits: a text may have at most `max_tokens` tokens (by default MAX_TOKENS or the model's
  context n_ctx, whichever is longer: SmolLM2's 8,192; never more than a learned-position model's
  n_ctx); longer is `TextTooLong` (HTTP 413). Unknown model names and training steps without a
  snapshot are
  `NotFound` (404), and so is a token position past the text's end (the text has no such token);
  a next token or an attribution asked of an encoder is `Unsupported` (409); out-of-range layers
  and heads are UserErrors (422). Each message names the value and the limit.
- A request's `Variant` says which model it sees: `entry(name, variant)` gives the model at that
  training step (`step`, from `attnlab train --snapshots N`, or a Hub repository's stepN
  revisions, fetched when first asked for) with the interventions' `ablate_head` hooks for the
  heads it knocks out (`ablate`, zero or mean ablation), and every view runs through it, so there
  is one ablation (attnlab.inspection.interventions) and one forward pass per view. The hooks are
  attached before the cache's, so the cache holds what the ablated model computed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import UserError
from ..inspection.interventions import ablate_head
from ..model.attention import expand_kv
from . import MAX_TOKENS
from .models import (
    PLAIN,
    STEP_MODELS,
    ModelEntry,
    NotFound,
    Run,
    TextTooLong,
    UnknownModel,
    Variant,
)

# a cap on characters, checked before tokenizing: room for 8,192 tokens of 8 characters each
MAX_CHARS = 65_536


class ServedModels:
    """The models the explorer serves, by name: a request's lookups (a model, its variant), the
    limits it is checked against, and the one cached forward pass every view runs."""

    def __init__(
        self,
        models: dict[str, Any],
        max_tokens: int | None = None,
        runs: dict[str, Run] | None = None,
    ) -> None:
        if not models:
            raise UserError("the explorer needs at least one model")
        if max_tokens is not None and max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1, got {max_tokens}")
        runs = runs or {}
        self.entries = {
            name: ModelEntry(name, model.eval(), run=runs.get(name))
            for name, model in models.items()
        }
        self.max_tokens = max_tokens

    # Looking things up --------------------------------------------------------------------------
    def entry(self, name: str, variant: Variant = PLAIN) -> ModelEntry:
        """The served model `name`, or the variant of it a request asks for (a step, knocked-out
        heads)."""
        if name not in self.entries:
            raise UnknownModel(
                f"unknown model {name!r}; this explorer serves {', '.join(map(repr, self.entries))}"
            )
        entry = self.entries[name]
        if variant.step is not None:
            entry = self.at_step(entry, variant.step)
        if variant.ablate:
            self.check_ablate(entry, variant.ablate)
            hooks = tuple(
                ablate_head(layer, head, variant.ablation) for layer, head in variant.ablate
            )
            # the same lock: the same modules
            entry = dataclasses.replace(entry, hooks=hooks, scores=None)
        return entry

    def check_ablate(self, entry: ModelEntry, ablate: tuple[tuple[int, int], ...]) -> None:
        cfg = entry.model.config
        if len(ablate) > cfg.n_layers * cfg.n_heads:
            raise UserError(
                f"{len(ablate)} heads to ablate, but model {entry.name!r} has only "
                f"{cfg.n_layers * cfg.n_heads} ({cfg.n_layers} layers x {cfg.n_heads} heads)"
            )
        seen = set()
        for layer, head in ablate:
            self.check_index(entry, layer, head)
            if (layer, head) in seen:
                raise UserError(
                    f"head (layer {layer}, head {head}) is listed twice in ablate; list each head "
                    "once"
                )
            seen.add((layer, head))

    def at_step(self, entry: ModelEntry, step: int) -> ModelEntry:
        """The entry for the model at training `step` (loaded on first use, up to STEP_MODELS
        kept)."""
        run = entry.run
        if run is None or not run.snapshots:
            raise NotFound(
                f"model {entry.name!r} has no training snapshots, so there is no step {step}; "
                "train with `attnlab train --snapshots N` and explore the run's directory"
            )
        if step not in run.snapshots:
            steps = list(run.snapshots)
            raise NotFound(
                f"model {entry.name!r} has no snapshot at step {step}; its steps are "
                f"{', '.join(map(str, steps[:12]))}{' ...' if len(steps) > 12 else ''}"
            )
        if step == run.served_step:
            return entry
        with entry.lock:
            if step not in run.models:
                run.models[step] = ModelEntry(
                    entry.name, run.load(entry.model, step), lock=entry.lock, run=run
                )
                while len(run.models) > STEP_MODELS:
                    run.models.popitem(last=False)
            run.models.move_to_end(step)
            return run.models[step]

    def token_limit(self, model) -> int:
        cfg = model.config
        limit = max(MAX_TOKENS, cfg.n_ctx) if self.max_tokens is None else self.max_tokens
        return min(limit, cfg.n_ctx) if cfg.positional == "learned" else limit

    def describe(self, entry: ModelEntry) -> dict[str, Any]:
        cfg, tok = entry.model.config, entry.model.tokenizer
        return {
            "name": entry.name,
            "causal": cfg.causal,
            # a causal query sees itself and the W − 1 keys before it
            "sliding_window": cfg.sliding_window,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "d_model": cfg.d_model,
            "d_head": cfg.d_head,
            "d_mlp": None if cfg.attn_only else cfg.d_mlp,
            # a mixture of experts' router (the experts view); 0: a dense MLP
            "n_experts": cfg.n_experts,
            "experts_per_token": cfg.experts_per_token,
            "d_vocab": cfg.d_vocab,
            "n_ctx": cfg.n_ctx,
            "positional": cfg.positional,
            "norm": cfg.norm,
            "norm_placement": cfg.norm_placement,
            "attn_only": cfg.attn_only,
            "scale": cfg.scale,
            "tokenizer": tok.kind if tok is not None else None,
            # a chat template to put a message through (the generation view's chat)
            "chat": isinstance(cfg.extra.get("chat_template"), str),
            "max_tokens": self.token_limit(entry.model),
            "steps": list(entry.run.snapshots) if entry.run else [],
            "start_step": entry.run.start_step if entry.run else None,
            "example": entry.run.example if entry.run else None,
        }

    def encode(self, entry: ModelEntry, text: str) -> tuple[torch.Tensor, list[str]]:
        """ids (1, T) and the token strings, or a UserError naming the limit that the text
        breaks."""
        tokenizer = entry.model.tokenizer
        if tokenizer is None:
            raise UserError(
                f"model {entry.name!r} has no tokenizer.json, so the explorer cannot turn text "
                "into ids"
            )
        if len(text) > MAX_CHARS:
            raise TextTooLong(
                f"the text has {len(text)} characters; the explorer's limit is {MAX_CHARS}; "
                "shorten it"
            )
        ids = tokenizer.encode(text)
        if not ids:
            raise UserError("the text has no tokens; type at least one character")
        limit = self.token_limit(entry.model)
        if len(ids) > limit:
            raise TextTooLong(
                f"the text is {len(ids)} tokens; the explorer's limit for model {entry.name!r} is "
                f"{limit} tokens; shorten it"
            )
        tokens = tokenizer.tokens(text)
        # a tokenizer whose token strings don't line up: label by id instead
        if len(tokens) != len(ids):
            tokens = [tokenizer.label(i) for i in ids]
        return torch.tensor([ids]), tokens

    def check_index(
        self,
        entry: ModelEntry,
        layer: int | None = None,
        head: int | None = None,
        token: int | None = None,
        n_tokens: int | None = None,
    ) -> None:
        cfg = entry.model.config
        if layer is not None and not 0 <= layer < cfg.n_layers:
            raise UserError(
                f"layer {layer} is out of range: model {entry.name!r} has {cfg.n_layers} layers "
                f"(0 to {cfg.n_layers - 1})"
            )
        if head is not None and not 0 <= head < cfg.n_heads:
            raise UserError(
                f"head {head} is out of range: model {entry.name!r} has {cfg.n_heads} heads per "
                f"layer (0 to {cfg.n_heads - 1})"
            )
        if token is not None and n_tokens is not None and not 0 <= token < n_tokens:
            # 404, not 422: the request is well formed (the schema cannot tie a position to the
            # text's length), and the thing it names, the token at that position, does not exist
            raise NotFound(
                f"token index {token} is out of range: the text has {n_tokens} tokens (0 to "
                f"{n_tokens - 1})"
            )

    def cached_run(
        self, entry: ModelEntry, ids: torch.Tensor, names_filter, layer: int | None = None
    ) -> tuple[Any, Any]:
        """(cache, q k v of `layer` or None): one forward pass under the model's lock, without
        autograd.

        Hooks live on the model's shared modules, so everything that runs a module happens under the
        lock, qk-norm in `qkv` included. With `layer`, the blocks after it are skipped
        (TransformerLens's stop_at_layer).
        """
        # ablations before the cache's hooks
        with entry.lock, torch.no_grad(), entry.model.hooks(entry.hooks):
            _, cache = entry.model.run_with_cache(
                ids, names_filter=names_filter, stop_at_layer=None if layer is None else layer + 1
            )
            return cache, None if layer is None else self.qkv(entry, cache, layer)

    def qkv(
        self, entry: ModelEntry, cache, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of one layer as the scores used them, one row per query head: [head, pos, d_head]
        each.

        Call under the model's lock (qk-norm runs a module whose hook point another request may be
        watching).
        """
        model, prefix = entry.model, f"blocks.{layer}.attn."
        attn = model.blocks[layer].attn
        if model.config.positional == "rope":
            # after qk-norm and rotation
            q, k = cache[prefix + "hook_rot_q"], cache[prefix + "hook_rot_k"]
        else:
            q, k = cache[prefix + "hook_q"], cache[prefix + "hook_k"]
            if attn.q_norm is not None:  # qk-norm comes after hook_q / hook_k
                q, k = attn.q_norm(q), attn.k_norm(k)
        v = cache[prefix + "hook_v"]
        # [heads, pos, d_head]
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
        return q, expand_kv(q, k), expand_kv(q, v)

    @staticmethod
    def qkv_hooks(layer: int) -> list[str]:
        prefix = f"blocks.{layer}.attn."
        return [
            prefix + n
            for n in ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_pattern")
        ]
