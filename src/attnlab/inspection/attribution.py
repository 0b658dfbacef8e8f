"""Direct logit attribution of every head and MLP, and the `attnlab attribute` / `attnlab patch`
commands' work.

Design choices:
- `direct_logit_attribution` is the cache's `logit_attrs` (TransformerLens's definition) applied to
  the decomposition the IOI paper reads: every head's result, every MLP's output, the embeddings and
  the summed attention biases, at the last position, with the final norm frozen at its cached scale.
  What no term
  carries (the final norm's bias and the unembedding bias, read along the answer direction) is
  reported as `constant`, so the terms plus the constant are exactly the model's logit (difference).
- Contributors are ranked by absolute attribution; the PNG is a layer × head heat map beside a bar
  per MLP.
- `patch_sweeps` runs the chosen sweeps of attnlab.inspection.patching on a clean/corrupted pair
  with the logit difference as the metric and writes one PNG per sweep and one JSON with every
  number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..generate.fast_layers import inference_layers
from ..lens.names import check_one_token
from . import patching
from .experiments.common import make_out_dir, new_figure, save_figure, write_json


@dataclass
class Attribution:
    prompt_tokens: list[str]
    answer: str
    wrong: str | None
    heads: torch.Tensor  # [layer, head]
    mlps: torch.Tensor | None  # [layer], None for attention-only models
    others: dict[str, float]  # embed, pos_embed, bias
    constant: float  # the final norm's bias and b_U along the direction: in the logit, in no term
    logit: float  # the model's logit (difference) at the last position

    def ranked(self) -> list[tuple[str, float]]:
        """Every term by name ("L1H3", "L0 MLP", "embed", ...), largest absolute attribution
        first."""
        terms = [
            (f"L{l}H{h}", float(self.heads[l, h]))
            for l in range(self.heads.shape[0])
            for h in range(self.heads.shape[1])
        ]
        if self.mlps is not None:
            terms += [(f"L{l} MLP", float(v)) for l, v in enumerate(self.mlps)]
        terms += list(self.others.items())
        return sorted(terms, key=lambda t: -abs(t[1]))

    def total(self) -> float:
        return (
            float(self.heads.sum())
            + (float(self.mlps.sum()) if self.mlps is not None else 0.0)
            + sum(self.others.values())
            + self.constant
        )

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "answer": self.answer,
            "wrong": self.wrong,
            "heads": self.heads.tolist(),
            "mlps": None if self.mlps is None else self.mlps.tolist(),
            "others": self.others,
            "constant": self.constant,
            "logit": self.logit,
            "sum_of_terms": self.total(),
        }

    def plot(self, path: Path, title: str = "") -> None:
        has_mlp = self.mlps is not None
        L, H = self.heads.shape
        fig, axes = new_figure(
            1, 2 if has_mlp else 1, (3.0 + 0.45 * H + (2.5 if has_mlp else 0), 1.8 + 0.4 * L)
        )
        limit = float(self.heads.abs().max()) or 1.0
        if has_mlp:
            limit = max(limit, float(self.mlps.abs().max()))
        image = axes[0][0].imshow(
            self.heads.numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto"
        )
        axes[0][0].set_xticks(range(H))
        axes[0][0].set_yticks(range(L))
        axes[0][0].set_xlabel("head")
        axes[0][0].set_ylabel("layer")
        axes[0][0].set_title("heads", fontsize=9)
        fig.colorbar(image, ax=axes[0][0], shrink=0.8)
        if has_mlp:
            axes[0][1].barh(
                range(L),
                self.mlps.numpy(),
                color=["#b2182b" if v < 0 else "#2166ac" for v in self.mlps.tolist()],
            )
            axes[0][1].set_yticks(range(L))
            axes[0][1].invert_yaxis()
            axes[0][1].set_xlabel("attribution")
            axes[0][1].set_title("MLPs", fontsize=9)
        target = repr(self.answer) + (f" − {self.wrong!r}" if self.wrong is not None else "")
        fig.suptitle(
            title
            or f"direct logit attribution to {target} (logit {'difference ' if self.wrong else ''}"
            f"{self.logit:.3f})",
            fontsize=10,
        )
        save_figure(fig, path)


def direct_logit_attribution(
    model, prompt: str, answer: str | int, wrong: str | int | None = None
) -> Attribution:
    """Each head's, each MLP's and the embeddings' direct contribution to the answer's logit (minus
    wrong's) at the prompt's last position. An answer is a one-token text or a token id (which need
    not decode to text
    that encodes back to it: part of a UTF-8 character, a special token)."""
    if not model.config.causal:
        raise UserError(
            "direct logit attribution needs a causal language model (this one is an encoder)"
        )
    answer_id = answer if isinstance(answer, int) else check_one_token(model, answer)
    wrong_id = (
        wrong
        if isinstance(wrong, int) or wrong is None
        else check_one_token(model, wrong, what="the wrong answer")
    )
    answer, wrong = (
        model.tokenizer.decode([t]) if isinstance(t, int) else t for t in (answer, wrong)
    )
    ids = model.to_tokens(prompt)
    with torch.no_grad(), inference_layers(model, ids):
        logits, cache = model.run_with_cache(ids)
        cache._check_residual_sum()
        heads = cache.stack_head_results(pos_slice=-1)  # [layer · head, batch, d_model]
        attrs = cache.logit_attrs(heads, answer_id, wrong_id, pos_slice=-1)[:, 0]
        L, H = model.config.n_layers, model.config.n_heads
        mlps = None
        if not model.config.attn_only:
            mlp_stack = cache.decompose_resid(mode="mlp", incl_embeds=False, pos_slice=-1)
            mlps = cache.logit_attrs(mlp_stack, answer_id, wrong_id, pos_slice=-1)[:, 0].float()
        embeds, labels = cache._embeddings(-1)
        bias = model.accumulated_bias(L, include_mlp_biases=False).expand_as(embeds[0])
        rest = cache.logit_attrs(torch.stack([*embeds, bias]), answer_id, wrong_id, pos_slice=-1)[
            :, 0
        ]
        last = logits[0, -1].double()
        logit = float(last[answer_id] - (last[wrong_id] if wrong_id is not None else 0.0))
        direction = model.W_U[:, answer_id] - (
            model.W_U[:, wrong_id] if wrong_id is not None else 0.0
        )
        constant = float(
            model.b_U[answer_id] - (model.b_U[wrong_id] if wrong_id is not None else 0.0)
        )
        if model.ln_final is not None and getattr(model.ln_final, "bias", None) is not None:
            constant += float(model.ln_final.bias @ direction)
    return Attribution(
        model.to_str_tokens(ids),
        answer,
        wrong,
        attrs.view(L, H).float(),
        mlps,
        {name: float(v) for name, v in zip([*labels, "bias"], rest)},
        constant,
        logit,
    )


SWEEPS = {
    "block": "get_act_patch_block_every",  # resid_pre, attn_out, mlp_out by layer x position
    # each head's output, q, k, v, pattern (all positions)
    "heads": "get_act_patch_attn_head_all_pos_every",
    "heads-by-pos": "get_act_patch_attn_head_out_by_pos",  # each head's output at each position
    # each head's output alone (all positions): a fifth of "heads", for models of many heads
    "head-outputs": "get_act_patch_attn_head_out_all_pos",
}


def parse_sweeps(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SWEEPS]
    if unknown or not names:
        raise UserError(
            f"unknown sweep {', '.join(map(repr, unknown)) or repr(text)}; choose from "
            f"{', '.join(SWEEPS)} "
            "(comma-separated)"
        )
    return names


def patch_sweeps(
    model,
    clean: str,
    corrupted: str,
    answer: str,
    wrong: str,
    sweeps: list[str],
    out: Path,
    progress: bool = True,
) -> dict:
    """Run `sweeps` with the logit difference answer − wrong as the metric; write OUT/patch-NAME.png
    and OUT/patching.json; return {name: PatchingResult}."""
    answer_id, wrong_id = (
        check_one_token(model, answer),
        check_one_token(model, wrong, what="the wrong answer"),
    )
    clean_ids, corrupted_ids = model.to_tokens(clean), model.to_tokens(corrupted)
    if clean_ids.shape != corrupted_ids.shape:
        raise UserError(
            f"the clean text is {clean_ids.shape[-1]} tokens and the corrupted text "
            f"{corrupted_ids.shape[-1]}; patching needs texts of the same number of tokens"
        )
    make_out_dir(out)
    metric = patching.logit_diff_metric(answer_id, wrong_id)
    with torch.no_grad(), inference_layers(model, clean_ids):
        clean_logits, cache = model.run_with_cache(clean_ids)
    labels = [
        f"{a}/{b}" if a != b else a
        for a, b in zip(model.to_str_tokens(clean_ids), model.to_str_tokens(corrupted_ids))
    ]
    results = {}
    for name in sweeps:
        fn = getattr(patching, SWEEPS[name])
        results[name] = fn(
            model,
            corrupted_ids,
            cache,
            metric,
            clean_metric=float(metric(clean_logits)),
            pos_labels=labels,
            progress=progress,
        )
        results[name].plot(out / f"patch-{name}.png")
    write_json(
        out / "patching.json",
        {
            "clean": clean,
            "corrupted": corrupted,
            "answer": answer,
            "wrong": wrong,
            "metric": "logit difference answer - wrong at the last position",
            "sweeps": {n: r.to_dict() for n, r in results.items()},
        },
    )
    return results
