"""What the explorer computes: a text through a model with `run_with_cache`, shaped as JSON for the views.

Design choices:
- Every number the page shows comes from one forward pass with `run_with_cache`, restricted by
  `names_filter` to the hooks a view needs, so a 512-token text never materialises a full cache of
  every layer's patterns unless the heads grid asks for them.
- The stages of the attention equation (raw q·kᵀ, ·scale, mask, softmax) reuse attnlab.model.attention's
  functions on the cached q and k as the layer used them (after qk-norm and RoPE), so they agree with
  the cached pattern to float rounding; the API tests check that.
- Hooks are attached to the model's modules, so two forward passes on one model at once would mix their
  caches: each model has a lock, held for the whole pass. Nothing else is shared between requests.
- Models come only from the dict given to `Explorer` (paths named on the command line); a request names
  a model by its key, and no request value ever reaches the file system.
- Limits: a text may have at most `max_tokens` tokens (and no more than a learned-position model's
  n_ctx); longer is `TextTooLong` (HTTP 413). Unknown model names and training steps without a snapshot are
  `NotFound` (404); a next token or an attribution asked of an encoder is `Unsupported` (409); out-of-range
  layers, heads and token indices are UserErrors (422). Each message names the value and the limit.
- Experiments (issue 17): a request may knock out heads (`ablate`, zero or mean ablation) and pick a
  training step (`step`, from `attnlab train --snapshots N`, or a Hub repository's stepN revisions,
  fetched when first asked for). `Variant` says which; `entry(name, variant)`
  gives the model at that step with the interventions' `ablate_head` hooks, and every view runs through it,
  so there is one ablation (attnlab.inspection.interventions) and one forward pass per view, as before.
  The hooks are attached before the cache's, so the cache holds what the ablated model computed.
- Big matrices can travel as base64 float32 (`encoding="f32"`), 4 bytes a number, which the page
  decodes into a Float32Array without parsing 262,144 JSON numbers for a 512-token heatmap.
- Long texts travel lighter (`encoding="f16"`, what the page asks for above 512 tokens): float16, 2 bytes a
  number, times a power of two carried beside it (`scale`; llama.cpp's blocks carry their scale the same
  way), chosen so the largest value fits float16's range; a power of two multiplies exactly, so every value
  keeps float16's relative error of at most 2⁻¹¹, under half a unit in a third significant digit, which is
  what the page then shows. Values below `tiny` (float16's smallest normal, scaled) are less exact, and the
  page shows them as "< tiny". A causal model's pattern is zero above the diagonal, so only its lower
  triangle travels (`lower`). At 2,048 tokens: 12.6 MB of numbers where float32 took 33.6 MB.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..model.attention import apply_mask, attention_pattern, attention_scores, expand_kv
from ..errors import UserError
from ..model.transformer import next_token_loss
from . import MAX_TOKENS

MAX_CHARS = 20_000  # a cap on characters, checked before tokenizing
THUMBNAIL_SIZE = 32  # heads-grid thumbnails are max-pooled down to at most this many rows and columns
STEP_MODELS = 8  # snapshot models kept in memory per served run (least recently used go first)
CURVE_POINTS = 26  # head scores over training at most at this many snapshots (0.4 s each for a small model)


class NotFound(UserError):
    """Something a request names that this explorer does not have: a training step without a snapshot, or the
    training record of a model served without snapshots (HTTP 404)."""


class UnknownModel(NotFound):
    """A model name that the explorer was not started with (HTTP 404)."""


class Unsupported(UserError):
    """A request this model cannot answer, whatever its values: a next token or a direct logit attribution
    from an encoder, which predicts no next token (HTTP 409)."""


class TextTooLong(UserError):
    """A text over the token limit (HTTP 413)."""


@dataclass(frozen=True)
class Variant:
    """Which model a request sees: the served one, or its snapshot at a training step, with heads knocked out."""

    ablate: tuple[tuple[int, int], ...] = ()  # (layer, head) pairs whose output z is ablated
    ablation: str = "zero"  # "zero", or "mean": each head's mean z over this text's positions
    step: int | None = None  # a training step with a snapshot; None: the served weights


PLAIN = Variant()


@dataclass
class Run:
    """A served model's course of training: its weights at each step, from a run's snapshots (`attnlab train
    --snapshots N`) or from a Hub repository's training-step revisions (Pythia's stepN branches), and the
    step the page opens on."""

    path: Path | None  # the run's directory (its metrics.jsonl); None for a Hub repository
    snapshots: dict[int, Path | str]  # step -> snapshot file, or the Hub revision holding that step's weights
    start_step: int | None = None
    example: str | None = None  # a text to open the page on (e.g. the induction experiment's repeated spans)
    models: OrderedDict = field(default_factory=OrderedDict)  # step -> loaded snapshot model (an LRU)
    curves: dict[str, Any] | None = None  # /api/models/{name}/training, computed once (per set of scored steps)
    repo_id: str | None = None  # the Hub repository whose revisions `snapshots` names
    served_step: int | None = None  # the step whose weights the served model already holds (never loaded twice)
    scores: dict[int, Any] = field(default_factory=dict)  # step -> head scores, kept when its model is dropped

    def load(self, model, step: int):
        """`model` at `step`: the snapshot file read into a copy of it, or the Hub revision loaded (fetched into the
        Hugging Face cache on first use; the served model's tokenizer is kept)."""
        if self.repo_id is None:
            from ..training.snapshots import load_snapshot

            return load_snapshot(model, self.snapshots[step])
        from ..formats import load

        revision = self.snapshots[step]
        loaded = load(self.repo_id, revision=revision)
        shape = ("n_layers", "n_heads", "d_model", "d_vocab")
        if any(getattr(loaded.config, k) != getattr(model.config, k) for k in shape):
            raise UserError(f"{self.repo_id} revision {revision!r} has another shape than the served revision "
                            f"({', '.join(f'{k} {getattr(loaded.config, k)}' for k in shape)}); the step slider needs "
                            "one model trained through its steps")
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


F16_MAX = 65504.0  # float16's largest finite value
F16_TINY = 2.0**-14  # float16's smallest normal value: below it, fewer significant bits


def encode_matrix(tensor: torch.Tensor, encoding: str, lower: bool = False) -> Any:
    """A tensor as nested lists ("json"), as {"shape", "f32": base64 of little-endian float32} ("f32"), or as
    {"shape", "f16": base64 of little-endian float16, "scale", "tiny", "lower"} ("f16"): the numbers are
    f16 × scale, exact to float16's precision down to `tiny`. lower (a square matrix, "f16" only): only the
    lower triangle travels, row by row, the diagonal included (a causal pattern is zero above it)."""
    tensor = tensor.detach().float().cpu().contiguous()
    if encoding == "f32":
        data = tensor.numpy().astype("<f4").tobytes()
        return {"shape": list(tensor.shape), "f32": base64.b64encode(data).decode("ascii")}
    if encoding == "f16":
        top = float(tensor.abs().amax()) if tensor.numel() else 0.0
        if not math.isfinite(top):  # −∞ or NaN somewhere: the largest finite value (rare; a boolean gather is slow)
            top = float(torch.nan_to_num(tensor.abs(), nan=0.0, posinf=0.0).amax())
        # the largest power of two that keeps the largest value finite in float16 (bounded: 2^±100 is a float32)
        exponent = max(-100, min(100, math.floor(math.log2(F16_MAX / top)))) if top > 0 else 0
        # the lower triangle row by row: T slices beat a gather by T(T+1)/2 indices (26 against 126 ms at 2,048)
        values = torch.cat([row[:i + 1] for i, row in enumerate(tensor)]) if lower else tensor.flatten()
        data = (values * 2.0**exponent).to(torch.float16).numpy().astype("<f2").tobytes()
        return {"shape": list(tensor.shape), "f16": base64.b64encode(data).decode("ascii"), "lower": lower,
                "scale": 2.0**-exponent, "tiny": F16_TINY * 2.0**-exponent}
    return _finite(tensor.tolist())


def _finite(values: Any) -> Any:
    """JSON has no infinities: masked scores (−∞) travel as None, which the page draws as masked."""
    if isinstance(values, list):
        return [_finite(v) for v in values]
    return None if isinstance(values, float) and not math.isfinite(values) else values


def _top2_basis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """PCA of the rows of x (N, D): (mean (D,), basis (2, D) orthonormal rows, fraction of variance kept)."""
    mean = x.mean(0)
    centred = x - mean
    _, singular, vh = torch.linalg.svd(centred, full_matrices=False)
    basis = torch.zeros(2, x.shape[1], dtype=x.dtype)
    n = min(2, vh.shape[0])
    basis[:n] = vh[:n]
    total = float((singular**2).sum())
    kept = float((singular[:n] ** 2).sum()) / total if total > 0 else 1.0
    return mean, basis, kept


class Explorer:
    """The models the explorer serves, by name, and every computation behind the JSON API."""

    def __init__(self, models: dict[str, Any], max_tokens: int = MAX_TOKENS, runs: dict[str, Run] | None = None) -> None:
        if not models:
            raise UserError("the explorer needs at least one model")
        if max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1, got {max_tokens}")
        runs = runs or {}
        self.entries = {name: ModelEntry(name, model.eval(), run=runs.get(name)) for name, model in models.items()}
        self.max_tokens = max_tokens

    # Looking things up --------------------------------------------------------------------------
    def entry(self, name: str, variant: Variant = PLAIN) -> ModelEntry:
        """The served model `name`, or the variant of it a request asks for (a step, knocked-out heads)."""
        if name not in self.entries:
            raise UnknownModel(f"unknown model {name!r}; this explorer serves {', '.join(map(repr, self.entries))}")
        entry = self.entries[name]
        if variant.step is not None:
            entry = self.at_step(entry, variant.step)
        if variant.ablate:
            from ..inspection.interventions import ablate_head

            self.check_ablate(entry, variant.ablate)
            hooks = tuple(ablate_head(layer, head, variant.ablation) for layer, head in variant.ablate)
            entry = dataclasses.replace(entry, hooks=hooks, scores=None)  # the same lock: the same modules
        return entry

    def check_ablate(self, entry: ModelEntry, ablate: tuple[tuple[int, int], ...]) -> None:
        cfg = entry.model.config
        if len(ablate) > cfg.n_layers * cfg.n_heads:
            raise UserError(f"{len(ablate)} heads to ablate, but model {entry.name!r} has only "
                            f"{cfg.n_layers * cfg.n_heads} ({cfg.n_layers} layers x {cfg.n_heads} heads)")
        seen = set()
        for layer, head in ablate:
            self.check_index(entry, layer, head)
            if (layer, head) in seen:
                raise UserError(f"head (layer {layer}, head {head}) is listed twice in ablate; list each head once")
            seen.add((layer, head))

    def at_step(self, entry: ModelEntry, step: int) -> ModelEntry:
        """The entry for the model at training `step` (loaded on first use, up to STEP_MODELS kept)."""
        run = entry.run
        if run is None or not run.snapshots:
            raise NotFound(f"model {entry.name!r} has no training snapshots, so there is no step {step}; "
                            "train with `attnlab train --snapshots N` and explore the run's directory")
        if step not in run.snapshots:
            steps = list(run.snapshots)
            raise NotFound(f"model {entry.name!r} has no snapshot at step {step}; its steps are "
                            f"{', '.join(map(str, steps[:12]))}{' ...' if len(steps) > 12 else ''}")
        if step == run.served_step:
            return entry
        with entry.lock:
            if step not in run.models:
                run.models[step] = ModelEntry(entry.name, run.load(entry.model, step), lock=entry.lock, run=run)
                while len(run.models) > STEP_MODELS:
                    run.models.popitem(last=False)
            run.models.move_to_end(step)
            return run.models[step]

    def token_limit(self, model) -> int:
        cfg = model.config
        return min(self.max_tokens, cfg.n_ctx) if cfg.positional == "learned" else self.max_tokens

    def describe(self, entry: ModelEntry) -> dict[str, Any]:
        cfg, tok = entry.model.config, entry.model.tokenizer
        return {
            "name": entry.name,
            "causal": cfg.causal,
            "sliding_window": cfg.sliding_window,  # a causal query sees itself and the W − 1 keys before it
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "d_model": cfg.d_model,
            "d_head": cfg.d_head,
            "d_mlp": None if cfg.attn_only else cfg.d_mlp,
            "d_vocab": cfg.d_vocab,
            "n_ctx": cfg.n_ctx,
            "positional": cfg.positional,
            "norm": cfg.norm,
            "norm_placement": cfg.norm_placement,
            "attn_only": cfg.attn_only,
            "scale": cfg.scale,
            "tokenizer": tok.kind if tok is not None else None,
            "max_tokens": self.token_limit(entry.model),
            "steps": list(entry.run.snapshots) if entry.run else [],
            "start_step": entry.run.start_step if entry.run else None,
            "example": entry.run.example if entry.run else None,
        }

    def list_models(self) -> list[dict[str, Any]]:
        return [self.describe(entry) for entry in self.entries.values()]

    def encode(self, entry: ModelEntry, text: str) -> tuple[torch.Tensor, list[str]]:
        """ids (1, T) and the token strings, or a UserError naming the limit that the text breaks."""
        tokenizer = entry.model.tokenizer
        if tokenizer is None:
            raise UserError(f"model {entry.name!r} has no tokenizer.json, so the explorer cannot turn text into ids")
        if len(text) > MAX_CHARS:
            raise TextTooLong(f"the text has {len(text)} characters; the explorer's limit is {MAX_CHARS}; shorten it")
        ids = tokenizer.encode(text)
        if not ids:
            raise UserError("the text has no tokens; type at least one character")
        limit = self.token_limit(entry.model)
        if len(ids) > limit:
            raise TextTooLong(
                f"the text is {len(ids)} tokens; the explorer's limit for model {entry.name!r} is {limit} tokens; shorten it"
            )
        tokens = tokenizer.tokens(text)
        if len(tokens) != len(ids):  # a tokenizer whose token strings don't line up: label by id instead
            tokens = [tokenizer.id_to_token(i) for i in ids]
        return torch.tensor([ids]), tokens

    def check_index(self, entry: ModelEntry, layer: int | None = None, head: int | None = None,
                    token: int | None = None, n_tokens: int | None = None) -> None:
        cfg = entry.model.config
        if layer is not None and not 0 <= layer < cfg.n_layers:
            raise UserError(f"layer {layer} is out of range: model {entry.name!r} has {cfg.n_layers} layers (0 to {cfg.n_layers - 1})")
        if head is not None and not 0 <= head < cfg.n_heads:
            raise UserError(f"head {head} is out of range: model {entry.name!r} has {cfg.n_heads} heads per layer (0 to {cfg.n_heads - 1})")
        if token is not None and n_tokens is not None and not 0 <= token < n_tokens:
            raise UserError(f"token index {token} is out of range: the text has {n_tokens} tokens (0 to {n_tokens - 1})")

    def cached_run(self, entry: ModelEntry, ids: torch.Tensor, names_filter, layer: int | None = None) -> tuple[Any, Any]:
        """(cache, q k v of `layer` or None): one forward pass under the model's lock, without autograd.

        Hooks live on the model's shared modules, so everything that runs a module happens under the lock,
        qk-norm in `qkv` included. With `layer`, the blocks after it are skipped (TransformerLens's
        stop_at_layer).
        """
        with entry.lock, torch.no_grad(), entry.model.hooks(entry.hooks):  # ablations before the cache's hooks
            _, cache = entry.model.run_with_cache(ids, names_filter=names_filter, stop_at_layer=None if layer is None else layer + 1)
            return cache, None if layer is None else self.qkv(entry, cache, layer)

    # The views' data ----------------------------------------------------------------------------
    def run(self, name: str, text: str, variant: Variant = PLAIN) -> dict[str, Any]:
        entry = self.entry(name, variant)
        ids, tokens = self.encode(entry, text)
        return {"model": self.describe(entry), "tokens": tokens, "ids": ids[0].tolist()}

    def qkv(self, entry: ModelEntry, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of one layer as the scores used them, one row per query head: [head, pos, d_head] each.

        Call under the model's lock (qk-norm runs a module whose hook point another request may be watching).
        """
        model, prefix = entry.model, f"blocks.{layer}.attn."
        attn = model.blocks[layer].attn
        if model.config.positional == "rope":
            q, k = cache[prefix + "hook_rot_q"], cache[prefix + "hook_rot_k"]  # after qk-norm and rotation
        else:
            q, k = cache[prefix + "hook_q"], cache[prefix + "hook_k"]
            if attn.q_norm is not None:  # qk-norm comes after hook_q / hook_k
                q, k = attn.q_norm(q), attn.k_norm(k)
        v = cache[prefix + "hook_v"]
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [heads, pos, d_head]
        return q, expand_kv(q, k), expand_kv(q, v)

    @staticmethod
    def qkv_hooks(layer: int) -> list[str]:
        prefix = f"blocks.{layer}.attn."
        return [prefix + n for n in ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_pattern")]

    def head_matrices(self, name: str, text: str, layer: int, head: int,
                      variant: Variant = PLAIN) -> tuple[ModelEntry, list[str], torch.Tensor, torch.Tensor]:
        """(entry, tokens, raw scores q·kᵀ before the scale, the pattern the model computed) of one head: [query_pos, key_pos]."""
        entry = self.entry(name, variant)
        self.check_index(entry, layer, head)
        ids, tokens = self.encode(entry, text)
        wanted = [n for n in self.qkv_hooks(layer) if n in entry.model.hook_dict]
        cache, (q, k, _) = self.cached_run(entry, ids, wanted, layer)
        raw = attention_scores(q[head], k[head], 1.0)
        return entry, tokens, raw, cache[f"blocks.{layer}.attn.hook_pattern"][0, head]

    def pattern(self, name: str, text: str, layer: int, head: int, encoding: str = "json",
                variant: Variant = PLAIN) -> dict[str, Any]:
        """Raw scores q·kᵀ of one head, the scale, and the pattern the model computed: [query_pos, key_pos] each.

        `cost`: what the text costs this head, T×T scores, and the server's time for the request (the page shows both)."""
        start = time.perf_counter()
        entry, tokens, raw, pattern = self.head_matrices(name, text, layer, head, variant)
        out = {
            "layer": layer, "head": head, "tokens": tokens,
            "scale": entry.model.config.scale, "causal": entry.model.config.causal,
            "sliding_window": entry.model.config.sliding_window,
            "raw": encode_matrix(raw, encoding),
            "pattern": encode_matrix(pattern, encoding, lower=encoding == "f16" and entry.model.config.causal),
        }
        T = len(tokens)
        out["cost"] = {"entries_per_head": T * T, "bytes_per_head": 4 * T * T, "server_ms": 1000 * (time.perf_counter() - start)}
        return out

    def stages(self, name: str, text: str, layer: int, head: int, mask: str, variant: Variant = PLAIN) -> dict[str, Any]:
        """The four stages of the equation for one head, with the mask asked for ("causal", which keeps a sliding
        window's band as the model does, or "none")."""
        entry, tokens, raw, pattern = self.head_matrices(name, text, layer, head, variant)
        cfg = entry.model.config
        scaled = raw * cfg.scale
        masked = apply_mask(scaled, causal=mask == "causal", window=cfg.sliding_window if mask == "causal" else None)
        return {"layer": layer, "head": head, "tokens": tokens, "scale": cfg.scale, "causal": cfg.causal,
                "sliding_window": cfg.sliding_window,
                "pattern": encode_matrix(pattern, "json"), "mask": mask, "raw": encode_matrix(raw, "json"),
                "scaled": encode_matrix(scaled, "json"), "masked": encode_matrix(masked, "json"),
                "softmax": encode_matrix(attention_pattern(masked), "json")}

    def projection(self, name: str, text: str, layer: int, head: int, variant: Variant = PLAIN) -> dict[str, Any]:
        """The soft dictionary in 2-D: one head's keys (and values) projected on their top two principal axes.

        The exact scores of each token's query are /api/pattern's `raw`; these points are for drawing and
        for the scores of a query dragged to a new place.

        Queries go through the keys' axes without centring: subtracting the keys' mean changes every score
        of a query by the same amount, which the softmax ignores, so q₂·k₂ approximates the real scores.
        """
        entry = self.entry(name, variant)
        self.check_index(entry, layer, head)
        ids, tokens = self.encode(entry, text)
        wanted = [n for n in self.qkv_hooks(layer) if n in entry.model.hook_dict and not n.endswith("hook_pattern")]
        _, qkv = self.cached_run(entry, ids, wanted, layer)
        q, k, v = (t[head].float() for t in qkv)  # [pos, d_head] each
        k_mean, k_basis, k_kept = _top2_basis(k)
        v_mean, v_basis, v_kept = _top2_basis(v)
        return {
            "layer": layer, "head": head, "tokens": tokens,
            "scale": entry.model.config.scale, "causal": entry.model.config.causal,
            "sliding_window": entry.model.config.sliding_window,
            "keys": ((k - k_mean) @ k_basis.T).tolist(),  # [key_pos, 2]
            "queries": (q @ k_basis.T).tolist(),  # [query_pos, 2]
            "values": ((v - v_mean) @ v_basis.T).tolist(),  # [key_pos, 2]
            "keys_variance_kept": k_kept, "values_variance_kept": v_kept,
        }

    def heads(self, name: str, text: str, size: int = THUMBNAIL_SIZE, variant: Variant = PLAIN) -> dict[str, Any]:
        """Every layer's and head's pattern, max-pooled to at most size×size, for the grid of thumbnails."""
        entry = self.entry(name, variant)
        ids, tokens = self.encode(entry, text)
        T, pooled = len(tokens), {}

        def pool(pattern: torch.Tensor, hook) -> None:  # [batch, head, query_pos, key_pos], pooled as it passes
            # max-pooling keeps a sharp head sharp, where averaging would blur it away; pooling here, layer by
            # layer, keeps one layer's T×T patterns in memory at a time (2,048 tokens: 16 MB a head), not all
            pooled[hook.name] = F.adaptive_max_pool2d(pattern[0], (size, size)) if T > size else pattern[0]

        model = entry.model
        with entry.lock, torch.no_grad(), model.hooks(entry.hooks), model.hooks([(lambda n: n.endswith("attn.hook_pattern"), pool)]):
            model(ids)
        patterns = torch.stack([pooled[f"blocks.{layer}.attn.hook_pattern"] for layer in range(model.config.n_layers)])
        return {
            "tokens": tokens, "pooled": T > size,
            "thumbnails": [[[[round(x, 4) for x in row] for row in head] for head in layer] for layer in patterns.tolist()],
        }

    def head_scores(self, name: str, step: int | None = None) -> dict[str, Any]:
        """attnlab.inspection's scores of every head (they don't depend on the text); `available` False without it."""
        scores = head_scores(self.entry(name, Variant(step=step)))
        return {"available": scores is not None, **(scores or {})}

    def trace(self, name: str, text: str, layer: int, token: int, variant: Variant = PLAIN) -> dict[str, Any]:
        """One token through one block, stage by stage, with each stage's hook, full shape and this token's values."""
        entry = self.entry(name, variant)
        self.check_index(entry, layer)
        ids, tokens = self.encode(entry, text)
        self.check_index(entry, token=token, n_tokens=len(tokens))
        prefix = f"blocks.{layer}."
        cache, qkv = self.cached_run(entry, ids, lambda n: n.startswith(prefix), layer)
        return {"layer": layer, "token": token, "tokens": tokens,
                "stages": block_stages(entry, qkv, cache, layer, token)}

    def next_token(self, name: str, text: str, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, k: int = 10, sample: bool = False, seed: int | None = None,
                   variant: Variant = PLAIN) -> dict[str, Any]:
        """The next-token distribution after temperature / top-k / top-p (what sampling draws from), its top k, and a draw."""
        from ..generate.sampling import filter_logits, sample_next

        entry = self.entry(name, variant)
        model = entry.model
        if not model.config.causal:
            raise Unsupported(f"model {name!r} is an encoder (not causal): it does not predict a next token; "
                              "pick a causal model")
        ids, tokens = self.encode(entry, text)
        with entry.lock, torch.no_grad():
            logits = model.run_with_hooks(ids, fwd_hooks=entry.hooks)[:, -1].float()  # [1, d_vocab]
        if temperature == 0:  # greedy: all the mass on the argmax
            probs = F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        else:
            probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
        top = torch.topk(probs[0], min(k, probs.shape[-1]))
        tokenizer = model.tokenizer
        ids_list = ids[0].tolist()
        candidates = [
            {"id": i, "token": tokenizer.id_to_token(i), "piece": tokenizer.decode([i]), "prob": p,
             "logit": float(logits[0, i]), "text": tokenizer.decode(ids_list + [i])}
            for p, i in zip(top.values.tolist(), top.indices.tolist())
        ]
        chosen = None
        if sample:
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            i = int(sample_next(logits, temperature, top_k, top_p, generator)[0, 0])
            chosen = {"id": i, "token": tokenizer.id_to_token(i), "piece": tokenizer.decode([i]),
                      "prob": float(probs[0, i]), "text": tokenizer.decode(ids_list + [i])}
        return {"tokens": tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "candidates": candidates, "kept": int((probs[0] > 0).sum()), "chosen": chosen}

    def attribution(self, name: str, text: str, token: int, variant: Variant = PLAIN) -> dict[str, Any]:
        """Who wrote this prediction: each head's, each MLP's and the embeddings' direct contribution to the logit
        of token id `token` at the text's last position: attnlab.inspection.attribution's direct logit
        attribution, run with this variant's knocked-out heads."""
        from ..inspection.attribution import direct_logit_attribution

        entry = self.entry(name, variant)
        if not entry.model.config.causal:
            raise Unsupported(f"model {name!r} is an encoder (not causal): it predicts no next token, so no logit "
                              "of one to attribute; pick a causal model")
        self.encode(entry, text)  # the text's limits, checked as every view checks them
        if not 0 <= token < entry.model.config.d_vocab:
            raise UserError(f"token id {token} is out of range: model {name!r} has {entry.model.config.d_vocab} tokens")
        with entry.lock, torch.no_grad(), entry.model.hooks(entry.hooks):
            result = direct_logit_attribution(entry.model, text, token)  # the id itself: no decode-encode round trip
        return {"token": token, **result.to_dict()}

    def knockout(self, name: str, text: str, variant: Variant) -> dict[str, Any]:
        """The model with `variant.ablate` knocked out against the same model without: per token, the
        next-token loss (decoders) and the cosine similarity of the last hidden state, before and after.

        Both passes are `run_with_cache` on the same ids, the second with the interventions' ablate_head
        hooks (as every view runs them); the last hidden state is the final norm's output (pre-norm
        models) or the last block's resid_post (post-norm, e.g. BERT/MiniLM: what HF calls last_hidden_state)."""
        before_entry = self.entry(name, dataclasses.replace(variant, ablate=()))
        after_entry = self.entry(name, variant)
        ids, tokens = self.encode(before_entry, text)
        model = before_entry.model
        cfg = model.config
        hidden = "ln_final.hook_normalized" if "ln_final.hook_normalized" in model.hook_dict else f"blocks.{cfg.n_layers - 1}.hook_resid_post"
        runs = {}
        for when, entry in (("before", before_entry), ("after", after_entry)):
            with entry.lock, torch.no_grad(), entry.model.hooks(entry.hooks):
                output, cache = entry.model.run_with_cache(ids, names_filter=hidden)
            runs[when] = (output, cache[hidden][0].float())  # hidden: [pos, d_model]
        cosine = F.cosine_similarity(runs["after"][1], runs["before"][1], dim=-1)  # [pos]
        out = {"tokens": tokens, "ablate": [list(h) for h in variant.ablate], "ablation": variant.ablation,
               "step": variant.step, "causal": cfg.causal, "hidden_hook": hidden,
               "cosine": cosine.tolist(), "loss_before": None, "loss_after": None}
        if cfg.causal:  # position t's loss on token t+1: [pos - 1]
            for when in ("before", "after"):
                logits = runs[when][0][0].float()
                out[f"loss_{when}"] = next_token_loss(logits[:-1], ids[0, 1:], reduction="none").tolist()
        return out

    def training(self, name: str) -> dict[str, Any]:
        """A run's course: its snapshot steps, its logged losses (metrics.jsonl), and every head's scores
        (attnlab.inspection's, on random repeated tokens) at up to CURVE_POINTS evenly spaced snapshots
        (`score_steps`, the start step included), for the step slider and the heads' curves.

        A Hub repository's revisions are fetched only when a request asks for their step, so their curves
        cover the steps shown so far (`lazy`: the page asks again after each new step)."""
        entry = self.entry(name)
        run = entry.run
        if run is None or not run.snapshots:
            raise NotFound(f"model {name!r} has no training snapshots; train with `attnlab train --snapshots N` "
                            "and explore the run's directory")
        steps = list(run.snapshots)
        if run.repo_id is not None:
            picked = sorted({run.served_step, *run.models, *run.scores} & set(steps))
        else:
            n = min(CURVE_POINTS, len(steps))
            picked = sorted({steps[round(i * (len(steps) - 1) / max(1, n - 1))] for i in range(n)}
                            | ({run.start_step} if run.start_step in run.snapshots else set()))
        if run.curves is None or run.curves["score_steps"] != picked:
            from ..training.report import read_metrics

            for step in picked:
                if step not in run.scores:
                    run.scores[step] = head_scores(self.at_step(entry, step))
            per_step = {step: run.scores[step] for step in picked}
            available = bool(per_step) and all(v is not None for v in per_step.values())
            curves: dict[str, Any] = {"steps": steps, "score_steps": picked, "start_step": run.start_step,
                                      "metrics": [] if run.path is None else
                                      [{k: r.get(k) for k in ("iter", "train_loss", "val_loss")} for r in read_metrics(run.path)],
                                      "lazy": run.repo_id is not None,
                                      "revisions": None if run.repo_id is None else {str(k): v for k, v in run.snapshots.items()},
                                      "available": available, "scores": {}, "thresholds": {}}
            if available:
                first = next(iter(per_step.values()))
                curves["thresholds"] = first["thresholds"]
                curves["scores"] = {score: [per_step[step]["scores"][score] for step in picked] for score in first["scores"]}
            run.curves = curves
        return run.curves


def head_scores(entry: ModelEntry) -> dict[str, Any] | None:
    """attnlab.inspection.scores' head scores of the model (they don't depend on the text), computed once and
    kept on the entry; None when that module is not installed."""
    try:
        from ..inspection.scores import head_scores as compute
    except ImportError:
        return None
    with entry.lock:
        if entry.scores is None:
            with torch.no_grad():
                entry.scores = compute(entry.model).to_dict()
    return entry.scores


def block_stages(entry: ModelEntry, qkv: tuple[torch.Tensor, ...], cache, layer: int, token: int) -> list[dict[str, Any]]:
    """The stages of one block for one token, in the order the block computes them (its ModelConfig.wiring)."""
    model = entry.model
    cfg = model.config
    block = model.blocks[layer]
    pre_norm, parallel = cfg.wiring in ("pre", "parallel"), cfg.wiring == "parallel"
    p, t = f"blocks.{layer}.", token
    q, k, v = qkv  # [head, pos, d_head]

    def stage(key: str, title: str, equation: str, hook: str | None, full: torch.Tensor, row: torch.Tensor,
              dims: list[str]) -> dict[str, Any]:
        return {"key": key, "title": title, "equation": equation, "hook": hook, "shape": list(full.shape),
                "dims": dims, "values": _finite(row.float().tolist())}

    def vec(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        full = cache[p + name][0]  # [pos, ...]
        return full, full[t]

    # hook_normalized is TransformerLens's: the normalized input before the norm's weight (and bias)
    normalized = "(x − mean) / scale" if cfg.norm == "layernorm" else "x / scale"
    stages = []
    resid_pre, resid_pre_t = vec("hook_resid_pre")
    stages.append(stage("resid_pre", "residual stream in", "x = resid_pre", p + "hook_resid_pre", resid_pre, resid_pre_t, ["pos", "d_model"]))
    if pre_norm:
        full, row = vec("ln1.hook_normalized")
        stages.append(stage("ln1", f"{cfg.norm} 1", f"x̂ = {normalized}, before its weight", p + "ln1.hook_normalized", full, row, ["pos", "d_model"]))
    for name, label in (("q", "queries"), ("k", "keys"), ("v", "values")):
        full, row = vec(f"attn.hook_{name}")
        eq = f"{name} = (x̂ ⊙ w + b) W_{name.upper()}" if pre_norm else f"{name} = x W_{name.upper()}"
        stages.append(stage(name, label, eq, p + f"attn.hook_{name}", full, row, ["pos", "head", "d_head"]))
    if cfg.positional == "rope":
        for name in ("q", "k"):
            full, row = vec(f"attn.hook_rot_{name}")
            stages.append(stage(f"rot_{name}", f"RoPE on {name}", f"{name} ← rotate({name}, pos · θ)", p + f"attn.hook_rot_{name}",
                                full, row, ["pos", "head", "d_head"]))
    else:
        stages.append({"key": "rope", "title": "RoPE", "hook": None, "shape": None, "dims": None, "values": None,
                       "equation": f"skipped: positions are {cfg.positional}" + (" (added to the embeddings)" if cfg.positional in ("learned", "sinusoidal") else "")})
    raw = attention_scores(q, k, cfg.scale)  # [head, query_pos, key_pos]
    stages.append(stage("scores", "scores", "s = q kᵀ / √d_head", None, raw, raw[:, t], ["head", "query_pos", "key_pos"]))
    masked = cache[p + "attn.hook_attn_scores"][0]  # the model's own masked scores: apply_mask(raw) in the layer
    band = f" and more than {cfg.sliding_window - 1} keys back (sliding window {cfg.sliding_window})" if cfg.sliding_window else ""
    stages.append(stage("masked", "mask", f"s ← −∞ above the diagonal{band}" if cfg.causal else "no mask (encoder: every key visible)",
                        p + "attn.hook_attn_scores", masked, masked[:, t], ["head", "query_pos", "key_pos"]))
    pattern = cache[p + "attn.hook_pattern"][0]
    stages.append(stage("pattern", "softmax", "a = softmax(s)", p + "attn.hook_pattern", pattern, pattern[:, t], ["head", "query_pos", "key_pos"]))
    full, row = vec("attn.hook_z")
    stages.append(stage("z", "weighted sum", "z = a v", p + "attn.hook_z", full, row, ["pos", "head", "d_head"]))
    attn_out, attn_out_t = vec("hook_attn_out")
    stages.append(stage("attn_out", "W_O", "attn_out = concat(z) W_O", p + "hook_attn_out", attn_out, attn_out_t, ["pos", "d_model"]))
    if parallel:
        pass  # the MLP reads x too: no resid_mid between the two (as in TransformerLens)
    elif pre_norm:
        full, row = vec("hook_resid_mid")
        stages.append(stage("resid_mid", "residual", "resid_mid = x + attn_out", p + "hook_resid_mid", full, row, ["pos", "d_model"]))
    else:
        added = resid_pre + attn_out
        stages.append(stage("add1", "residual", "x + attn_out", None, added, added[t], ["pos", "d_model"]))
        full, row = vec("hook_resid_mid")
        stages.append(stage("resid_mid", f"{cfg.norm} 1", "resid_mid = norm(x + attn_out)", p + "hook_resid_mid", full, row, ["pos", "d_model"]))
    if block.mlp is None:
        stages.append({"key": "mlp", "title": "MLP", "hook": None, "shape": None, "dims": None, "values": None,
                       "equation": "skipped: attention-only model"})
        return stages
    if pre_norm:
        full, row = vec("ln2.hook_normalized")
        source = "x" if parallel else "resid_mid"
        equation = f"m̂ = {normalized.replace('x', source)}, before its weight"
        if parallel:
            equation += "  (parallel block: the MLP reads resid_pre)"
        stages.append(stage("ln2", f"{cfg.norm} 2", equation, p + "ln2.hook_normalized", full, row, ["pos", "d_model"]))
    full, row = vec("mlp.hook_pre")
    stages.append(stage("mlp_pre", "MLP in", "h = (m̂ ⊙ w + b) W_in" if cfg.mlp != "swiglu" else "h = (m̂ ⊙ w) W_gate", p + "mlp.hook_pre", full, row, ["pos", "d_mlp"]))
    full, row = vec("mlp.hook_post")
    stages.append(stage("mlp_post", "MLP activation", f"{cfg.mlp}(h)", p + "mlp.hook_post", full, row, ["pos", "d_mlp"]))
    mlp_out, mlp_out_t = vec("hook_mlp_out")
    stages.append(stage("mlp_out", "MLP out", "mlp_out = act(h) W_out", p + "hook_mlp_out", mlp_out, mlp_out_t, ["pos", "d_model"]))
    resid_post, resid_post_t = vec("hook_resid_post")
    if parallel:
        stages.append(stage("resid_post", "residual", "resid_post = x + attn_out + mlp_out", p + "hook_resid_post",
                            resid_post, resid_post_t, ["pos", "d_model"]))
    elif pre_norm:
        stages.append(stage("resid_post", "residual", "resid_post = resid_mid + mlp_out", p + "hook_resid_post", resid_post, resid_post_t, ["pos", "d_model"]))
    else:
        resid_mid = cache[p + "hook_resid_mid"][0]
        added = resid_mid + mlp_out
        stages.append(stage("add2", "residual", "resid_mid + mlp_out", None, added, added[t], ["pos", "d_model"]))
        stages.append(stage("resid_post", f"{cfg.norm} 2", "resid_post = norm(resid_mid + mlp_out)", p + "hook_resid_post", resid_post, resid_post_t, ["pos", "d_model"]))
    return stages
