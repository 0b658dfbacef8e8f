"""The computations behind the explorer's views (`Explorer`, the object behind the JSON API):
patterns, the attention equation's stages, q and k projected, the heads grid, a token's trace, the
next token, attribution, knockout, and a run's course over training.

Design choices:
- `Explorer` holds what the views need, built from the models it is given: `served`
  (service.ServedModels: lookups, limits, the one cached forward pass), `contexts` (a long text's
  kept queries and keys, context.py) and `generations` (the streams running, generation.py).
- The stages of the attention equation (raw q·kᵀ, ·scale, mask, softmax) reuse
  attnlab.model.attention's functions on the cached q and k as the layer used them (after qk-norm
  and RoPE), so they agree with the cached pattern to float rounding; the API tests check that.
- Experiments (issue 17): every view takes a `Variant` (a training step, knocked-out heads) and
  runs on `served.entry(name, variant)`.
- Big matrices can travel as base64 float32 (`encoding="f32"`), 4 bytes a number, which the page
  decodes into a Float32Array without parsing 262,144 JSON numbers for a 512-token heatmap.
- Long texts travel lighter (`encoding="f16"`, what the page asks for above 512 tokens): float16, 2
  bytes a number, times a power of two carried beside it (`scale`; llama.cpp's blocks carry their
  scale the same way), chosen so the largest value fits float16's range; a power of two multiplies
  exactly, so every value keeps float16's relative error of at most 2⁻¹¹, under half a unit in a
  third significant digit, which is what the page then shows. Values below `tiny` (float16's
  smallest normal, scaled) are less exact, and the page shows them as "< tiny". A causal model's
  pattern is zero above the diagonal, so only its lower
  triangle travels (`lower`), a fraction of float32's bytes (benchmarks/README.md, issue 17).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..generate.fast_layers import inference_layers
from ..generate.sampling import filter_logits, sample_next
from ..inspection.attribution import direct_logit_attribution
from ..model.attention import apply_mask, attention_pattern, attention_scores, soft_cap
from ..model.transformer import next_token_loss
from ..training.report import read_metrics
from .context import BUDGET, ContextStore, context_id, thumbnail
from .encoding import encode_matrix
from .models import PLAIN, ModelEntry, NotFound, Run, Unsupported, Variant
from .service import ServedModels
from .stages import block_stages

# heads-grid thumbnails are max-pooled down to at most this many rows and columns
THUMBNAIL_SIZE = 32
# a longer text's thumbnails come from its kept queries and keys (context.thumbnail), a shorter
# one's from one forward pass with the patterns pooled as they pass (a layer's T × T at a time)
LONG_TEXT = 1024


# head scores over training at most at this many snapshots (each costs a scoring run)
CURVE_POINTS = 26


def _rounded(thumbnails: list) -> list:
    """[layer][head][row][col] to 4 decimals: the page draws them, JSON carries them."""
    return [
        [[[round(x, 4) for x in row] for row in head] for head in layer] for layer in thumbnails
    ]


def _top2_basis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """PCA of the rows of x (N, D): (mean (D,), basis (2, D) orthonormal rows, fraction of variance
    kept)."""
    mean = x.mean(0)
    centred = x - mean
    _, singular, vh = torch.linalg.svd(centred, full_matrices=False)
    basis = torch.zeros(2, x.shape[1], dtype=x.dtype)
    n = min(2, vh.shape[0])
    basis[:n] = vh[:n]
    total = float((singular**2).sum())
    kept = float((singular[:n] ** 2).sum()) / total if total > 0 else 1.0
    return mean, basis, kept


def head_scores(entry: ModelEntry) -> dict[str, Any] | None:
    """attnlab.inspection.scores' head scores of the model (they don't depend on the text), computed
    once and kept on the entry; None when that module is not installed."""
    try:
        from ..inspection.scores import head_scores as compute
    except ImportError:
        return None
    with entry.lock:
        if entry.scores is None:
            with torch.no_grad():
                entry.scores = compute(entry.model).to_dict()
    return entry.scores


class Explorer:
    """The computations behind the JSON API's views, on the models `served` holds (service.py:
    their lookups, limits and one cached forward pass); `contexts`, a long text's kept queries and
    keys; `generations`, the generation streams running (generation.py). `serving`: the class
    that holds the models (export.py's shares one forward pass per layer)."""

    def __init__(
        self,
        models: dict[str, Any],
        max_tokens: int | None = None,
        runs: dict[str, Run] | None = None,
        context_budget: int = BUDGET,
        serving: type[ServedModels] = ServedModels,
    ) -> None:
        self.served = serving(models, max_tokens, runs)
        self.contexts = ContextStore(context_budget)
        self.generations: set = set()

    def list_models(self) -> list[dict[str, Any]]:
        return [self.served.describe(entry) for entry in self.served.entries.values()]

    # The views' data ----------------------------------------------------------------------------
    def run(self, name: str, text: str, variant: Variant = PLAIN) -> dict[str, Any]:
        entry = self.served.entry(name, variant)
        ids, tokens = self.served.encode(entry, text)
        return {"model": self.served.describe(entry), "tokens": tokens, "ids": ids[0].tolist()}

    def head_matrices(
        self, name: str, text: str, layer: int, head: int, variant: Variant = PLAIN
    ) -> tuple[ModelEntry, list[str], torch.Tensor, torch.Tensor]:
        """(entry, tokens, raw scores q·kᵀ before the scale, the pattern the model computed) of one
        head: [query_pos, key_pos]."""
        entry = self.served.entry(name, variant)
        self.served.check_index(entry, layer, head)
        ids, tokens = self.served.encode(entry, text)
        wanted = [n for n in self.served.qkv_hooks(layer) if n in entry.model.hook_dict]
        cache, (q, k, _) = self.served.cached_run(entry, ids, wanted, layer)
        raw = attention_scores(q[head], k[head], 1.0)
        return entry, tokens, raw, cache[f"blocks.{layer}.attn.hook_pattern"][0, head]

    def pattern(
        self,
        name: str,
        text: str,
        layer: int,
        head: int,
        encoding: str = "json",
        variant: Variant = PLAIN,
    ) -> dict[str, Any]:
        """Raw scores q·kᵀ of one head, the scale, and the pattern the model computed: [query_pos,
        key_pos] each.

        `cost`: what the text costs this head, T×T scores, and the server's time for the request
        (the page shows both)."""
        start = time.perf_counter()
        entry, tokens, raw, pattern = self.head_matrices(name, text, layer, head, variant)
        out = {
            "layer": layer,
            "head": head,
            "tokens": tokens,
            "scale": entry.model.config.scale,
            "causal": entry.model.config.causal,
            "sliding_window": entry.model.blocks[layer].attn.window,
            "raw": encode_matrix(raw, encoding),
            "pattern": encode_matrix(
                pattern, encoding, lower=encoding == "f16" and entry.model.config.causal
            ),
        }
        T = len(tokens)
        out["cost"] = {
            "entries_per_head": T * T,
            "bytes_per_head": 4 * T * T,
            "server_ms": 1000 * (time.perf_counter() - start),
        }
        return out

    def stages(
        self, name: str, text: str, layer: int, head: int, mask: str, variant: Variant = PLAIN
    ) -> dict[str, Any]:
        """The four stages of the equation for one head, with the mask asked for ("causal", which
        keeps a sliding window's band as the model does, or "none")."""
        entry, tokens, raw, pattern = self.head_matrices(name, text, layer, head, variant)
        cfg = entry.model.config
        window = entry.model.blocks[layer].attn.window  # this block's (Gemma 3: 5 blocks in 6)
        scaled = soft_cap(raw * cfg.scale, cfg.attn_softcap)  # the model's cap (Gemma 2)
        masked = apply_mask(
            scaled, causal=mask == "causal", window=window if mask == "causal" else None
        )
        return {
            "layer": layer,
            "head": head,
            "tokens": tokens,
            "scale": cfg.scale,
            "causal": cfg.causal,
            "sliding_window": window,
            "pattern": encode_matrix(pattern, "json"),
            "mask": mask,
            "raw": encode_matrix(raw, "json"),
            "scaled": encode_matrix(scaled, "json"),
            "masked": encode_matrix(masked, "json"),
            "softmax": encode_matrix(attention_pattern(masked), "json"),
        }

    def projection(
        self, name: str, text: str, layer: int, head: int, variant: Variant = PLAIN
    ) -> dict[str, Any]:
        """The soft dictionary in 2-D: one head's keys (and values) projected on their top two
        principal axes.

        The exact scores of each token's query are /api/pattern's `raw`; these points are for
        drawing and for the scores of a query dragged to a new place.

        Queries go through the keys' axes without centring: subtracting the keys' mean changes every
        score of a query by the same amount, which the softmax ignores, so q₂·k₂ approximates the
        real scores.
        """
        entry = self.served.entry(name, variant)
        self.served.check_index(entry, layer, head)
        ids, tokens = self.served.encode(entry, text)
        wanted = [
            n
            for n in self.served.qkv_hooks(layer)
            if n in entry.model.hook_dict and not n.endswith("hook_pattern")
        ]
        _, qkv = self.served.cached_run(entry, ids, wanted, layer)
        q, k, v = (t[head].float() for t in qkv)  # [pos, d_head] each
        k_mean, k_basis, k_kept = _top2_basis(k)
        v_mean, v_basis, v_kept = _top2_basis(v)
        return {
            "layer": layer,
            "head": head,
            "tokens": tokens,
            "scale": entry.model.config.scale,
            "causal": entry.model.config.causal,
            "sliding_window": entry.model.config.sliding_window,
            "keys": ((k - k_mean) @ k_basis.T).tolist(),  # [key_pos, 2]
            "queries": (q @ k_basis.T).tolist(),  # [query_pos, 2]
            "values": ((v - v_mean) @ v_basis.T).tolist(),  # [key_pos, 2]
            "keys_variance_kept": k_kept,
            "values_variance_kept": v_kept,
        }

    def heads(
        self, name: str, text: str, size: int = THUMBNAIL_SIZE, variant: Variant = PLAIN
    ) -> dict[str, Any]:
        """Every layer's and head's pattern, max-pooled to at most size×size, for the grid of
        thumbnails."""
        entry = self.served.entry(name, variant)
        ids, tokens = self.served.encode(entry, text)
        T, pooled = len(tokens), {}
        if T > LONG_TEXT:  # the whole context's kept queries and keys: no T × T matrix at all
            cfg = entry.model.config
            every = list(range(cfg.n_layers))
            window = len(self.contexts.layers_in_view(entry, T))  # the layers the budget holds
            thumbnails = []
            for first in range(0, cfg.n_layers, window):  # one context per window of layers
                layers = every[first : first + window]
                cid = context_id(name, variant, text, None if layers == every else layers)
                context = self.contexts.create(cid, entry, ids, tokens, layers)
                thumbnails += [
                    [thumbnail(context, layer, head, size).tolist() for head in range(cfg.n_heads)]
                    for layer in layers
                ]
            return {"tokens": tokens, "pooled": True, "thumbnails": _rounded(thumbnails)}

        # [batch, head, query_pos, key_pos], pooled as it passes
        def pool(pattern: torch.Tensor, hook) -> None:
            # max-pooling keeps a sharp head sharp, where averaging would blur it away; pooling
            # here, layer by layer, keeps one layer's T×T patterns in memory at a time, not all
            pooled[hook.name] = (
                F.adaptive_max_pool2d(pattern[0], (size, size)) if T > size else pattern[0]
            )

        model = entry.model
        with (
            entry.lock,
            torch.no_grad(),
            model.hooks(entry.hooks),
            model.hooks([(lambda n: n.endswith("attn.hook_pattern"), pool)]),
            inference_layers(model, ids),
        ):
            model(ids)
        patterns = torch.stack(
            [pooled[f"blocks.{layer}.attn.hook_pattern"] for layer in range(model.config.n_layers)]
        )
        return {"tokens": tokens, "pooled": T > size, "thumbnails": _rounded(patterns.tolist())}

    def head_scores(self, name: str, step: int | None = None) -> dict[str, Any]:
        """attnlab.inspection's scores of every head (they don't depend on the text); `available`
        False without it."""
        scores = head_scores(self.served.entry(name, Variant(step=step)))
        return {"available": scores is not None, **(scores or {})}

    def trace(
        self, name: str, text: str, layer: int, token: int, variant: Variant = PLAIN
    ) -> dict[str, Any]:
        """One token through one block, stage by stage, with each stage's hook, full shape and this
        token's values."""
        entry = self.served.entry(name, variant)
        self.served.check_index(entry, layer)
        ids, tokens = self.served.encode(entry, text)
        self.served.check_index(entry, token=token, n_tokens=len(tokens))
        prefix = f"blocks.{layer}."
        cache, qkv = self.served.cached_run(entry, ids, lambda n: n.startswith(prefix), layer)
        return {
            "layer": layer,
            "token": token,
            "tokens": tokens,
            "stages": block_stages(entry, qkv, cache, layer, token),
        }

    def next_token(
        self,
        name: str,
        text: str,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        k: int = 10,
        sample: bool = False,
        seed: int | None = None,
        variant: Variant = PLAIN,
    ) -> dict[str, Any]:
        """The next-token distribution after temperature / top-k / top-p (what sampling draws from),
        its top k, and a draw."""
        entry = self.served.entry(name, variant)
        model = entry.model
        if not model.config.causal:
            raise Unsupported(
                f"model {name!r} is an encoder (not causal): it does not predict a next token; "
                "pick a causal model"
            )
        ids, tokens = self.served.encode(entry, text)
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
            {
                "id": i,
                "token": tokenizer.label(i),
                "piece": tokenizer.decode([i]),
                "prob": p,
                "logit": float(logits[0, i]),
                "text": tokenizer.decode(ids_list + [i]),
            }
            for p, i in zip(top.values.tolist(), top.indices.tolist())
        ]
        chosen = None
        if sample:
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            i = int(sample_next(logits, temperature, top_k, top_p, generator)[0, 0])
            chosen = {
                "id": i,
                "token": tokenizer.label(i),
                "piece": tokenizer.decode([i]),
                "prob": float(probs[0, i]),
                "text": tokenizer.decode(ids_list + [i]),
            }
        return {
            "tokens": tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "candidates": candidates,
            "kept": int((probs[0] > 0).sum()),
            "chosen": chosen,
        }

    def attribution(
        self, name: str, text: str, token: int, variant: Variant = PLAIN
    ) -> dict[str, Any]:
        """Who wrote this prediction: each head's, each MLP's and the embeddings' direct
        contribution to the logit of token id `token` at the text's last position:
        attnlab.inspection.attribution's direct logit attribution, run with this variant's
        knocked-out heads."""
        entry = self.served.entry(name, variant)
        if not entry.model.config.causal:
            raise Unsupported(
                f"model {name!r} is an encoder (not causal): it predicts no next token, so no "
                "logit "
                "of one to attribute; pick a causal model"
            )
        self.served.encode(entry, text)  # the text's limits, checked as every view checks them
        if not 0 <= token < entry.model.config.d_vocab:
            raise UserError(
                f"token id {token} is out of range: model {name!r} has "
                f"{entry.model.config.d_vocab} tokens"
            )
        with entry.lock, torch.no_grad(), entry.model.hooks(entry.hooks):
            # the id itself: no decode-encode round trip
            result = direct_logit_attribution(entry.model, text, token)
        return {"token": token, **result.to_dict()}

    def knockout(self, name: str, text: str, variant: Variant) -> dict[str, Any]:
        """The model with `variant.ablate` knocked out against the same model without: per token,
        the
        next-token loss (decoders) and the cosine similarity of the last hidden state, before and
        after.

        Both passes are `run_with_cache` on the same ids, the second with the interventions'
        ablate_head
        hooks (as every view runs them); the last hidden state is the final norm's output (pre-norm
        models) or the last block's resid_post (post-norm, e.g. BERT/MiniLM: what HF calls
        last_hidden_state)."""
        before_entry = self.served.entry(name, dataclasses.replace(variant, ablate=()))
        after_entry = self.served.entry(name, variant)
        ids, tokens = self.served.encode(before_entry, text)
        model = before_entry.model
        cfg = model.config
        hidden = (
            "ln_final.hook_normalized"
            if "ln_final.hook_normalized" in model.hook_dict
            else f"blocks.{cfg.n_layers - 1}.hook_resid_post"
        )
        runs = {}
        for when, entry in (("before", before_entry), ("after", after_entry)):
            with entry.lock, torch.no_grad(), entry.model.hooks(entry.hooks):
                output, cache = entry.model.run_with_cache(ids, names_filter=hidden)
            runs[when] = (output, cache[hidden][0].float())  # hidden: [pos, d_model]
        cosine = F.cosine_similarity(runs["after"][1], runs["before"][1], dim=-1)  # [pos]
        out = {
            "tokens": tokens,
            "ablate": [list(h) for h in variant.ablate],
            "ablation": variant.ablation,
            "step": variant.step,
            "causal": cfg.causal,
            "hidden_hook": hidden,
            "cosine": cosine.tolist(),
            "loss_before": None,
            "loss_after": None,
        }
        if cfg.causal:  # position t's loss on token t+1: [pos - 1]
            for when in ("before", "after"):
                logits = runs[when][0][0].float()
                out[f"loss_{when}"] = next_token_loss(
                    logits[:-1], ids[0, 1:], reduction="none"
                ).tolist()
        return out

    def training(self, name: str) -> dict[str, Any]:
        """A run's course: its snapshot steps, its logged losses (metrics.jsonl), and every head's
        scores (attnlab.inspection's, on random repeated tokens) at up to CURVE_POINTS evenly spaced
        snapshots (`score_steps`, the start step included), for the step slider and the heads'
        curves.

        A Hub repository's revisions are fetched only when a request asks for their step, so their
        curves cover the steps shown so far (`lazy`: the page asks again after each new step)."""
        entry = self.served.entry(name)
        run = entry.run
        if run is None or not run.snapshots:
            raise NotFound(
                f"model {name!r} has no training snapshots; train with `attnlab train --snapshots "
                "N` "
                "and explore the run's directory"
            )
        steps = list(run.snapshots)
        if run.repo_id is not None:
            picked = sorted({run.served_step, *run.models, *run.scores} & set(steps))
        else:
            n = min(CURVE_POINTS, len(steps))
            picked = sorted(
                {steps[round(i * (len(steps) - 1) / max(1, n - 1))] for i in range(n)}
                | ({run.start_step} if run.start_step in run.snapshots else set())
            )
        if run.curves is None or run.curves["score_steps"] != picked:
            for step in picked:
                if step not in run.scores:
                    run.scores[step] = head_scores(self.served.at_step(entry, step))
            per_step = {step: run.scores[step] for step in picked}
            available = bool(per_step) and all(v is not None for v in per_step.values())
            curves: dict[str, Any] = {
                "steps": steps,
                "score_steps": picked,
                "start_step": run.start_step,
                "metrics": []
                if run.path is None
                else [
                    {k: r.get(k) for k in ("iter", "train_loss", "val_loss")}
                    for r in read_metrics(run.path)
                ],
                "lazy": run.repo_id is not None,
                "revisions": None
                if run.repo_id is None
                else {str(k): v for k, v in run.snapshots.items()},
                "available": available,
                "scores": {},
                "thresholds": {},
            }
            if available:
                first = next(iter(per_step.values()))
                curves["thresholds"] = first["thresholds"]
                curves["scores"] = {
                    score: [per_step[step]["scores"][score] for step in picked]
                    for score in first["scores"]
                }
            run.curves = curves
        return run.curves
