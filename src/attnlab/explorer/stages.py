"""One token through one block, stage by stage (the trace view): each stage's equation, hook, full
shape and this token's values, in the order the block computes them (ModelConfig.wiring)."""

from __future__ import annotations

from typing import Any

import torch

from ..model.attention import attention_scores
from .encoding import finite
from .models import ModelEntry


def block_stages(
    entry: ModelEntry, qkv: tuple[torch.Tensor, ...], cache, layer: int, token: int
) -> list[dict[str, Any]]:
    """The stages of one block for one token, in the order the block computes them (its
    ModelConfig.wiring)."""
    model = entry.model
    cfg = model.config
    block = model.blocks[layer]
    pre_norm, parallel = cfg.wiring in ("pre", "parallel"), cfg.wiring == "parallel"
    p, t = f"blocks.{layer}.", token
    q, k, v = qkv  # [head, pos, d_head]

    def stage(
        key: str,
        title: str,
        equation: str,
        hook: str | None,
        full: torch.Tensor,
        row: torch.Tensor,
        dims: list[str],
    ) -> dict[str, Any]:
        return {
            "key": key,
            "title": title,
            "equation": equation,
            "hook": hook,
            "shape": list(full.shape),
            "dims": dims,
            "values": finite(row.float().tolist()),
        }

    def vec(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        full = cache[p + name][0]  # [pos, ...]
        return full, full[t]

    # hook_normalized is TransformerLens's: the normalized input before the norm's weight (and bias)
    normalized = "(x − mean) / scale" if cfg.norm == "layernorm" else "x / scale"
    stages = []
    resid_pre, resid_pre_t = vec("hook_resid_pre")
    stages.append(
        stage(
            "resid_pre",
            "residual stream in",
            "x = resid_pre",
            p + "hook_resid_pre",
            resid_pre,
            resid_pre_t,
            ["pos", "d_model"],
        )
    )
    if pre_norm:
        full, row = vec("ln1.hook_normalized")
        stages.append(
            stage(
                "ln1",
                f"{cfg.norm} 1",
                f"x̂ = {normalized}, before its weight",
                p + "ln1.hook_normalized",
                full,
                row,
                ["pos", "d_model"],
            )
        )
    for name, label in (("q", "queries"), ("k", "keys"), ("v", "values")):
        full, row = vec(f"attn.hook_{name}")
        eq = (
            f"{name} = (x̂ ⊙ w + b) W_{name.upper()}" if pre_norm else f"{name} = x W_{name.upper()}"
        )
        stages.append(
            stage(name, label, eq, p + f"attn.hook_{name}", full, row, ["pos", "head", "d_head"])
        )
    if cfg.positional == "rope":
        for name in ("q", "k"):
            full, row = vec(f"attn.hook_rot_{name}")
            stages.append(
                stage(
                    f"rot_{name}",
                    f"RoPE on {name}",
                    f"{name} ← rotate({name}, pos · θ)",
                    p + f"attn.hook_rot_{name}",
                    full,
                    row,
                    ["pos", "head", "d_head"],
                )
            )
    else:
        stages.append(
            {
                "key": "rope",
                "title": "RoPE",
                "hook": None,
                "shape": None,
                "dims": None,
                "values": None,
                "equation": f"skipped: positions are {cfg.positional}"
                + (
                    " (added to the embeddings)"
                    if cfg.positional in ("learned", "sinusoidal")
                    else ""
                ),
            }
        )
    raw = attention_scores(q, k, cfg.scale)  # [head, query_pos, key_pos]
    stages.append(
        stage(
            "scores",
            "scores",
            "s = q kᵀ / √d_head",
            None,
            raw,
            raw[:, t],
            ["head", "query_pos", "key_pos"],
        )
    )
    # the model's own masked scores: apply_mask(raw) in the layer
    masked = cache[p + "attn.hook_attn_scores"][0]
    window = block.attn.window  # this block's own (Gemma 3 windows 5 blocks in 6)
    band = f" and more than {window - 1} keys back (sliding window {window})" if window else ""
    stages.append(
        stage(
            "masked",
            "mask",
            f"s ← −∞ above the diagonal{band}"
            if cfg.causal
            else "no mask (encoder: every key visible)",
            p + "attn.hook_attn_scores",
            masked,
            masked[:, t],
            ["head", "query_pos", "key_pos"],
        )
    )
    pattern = cache[p + "attn.hook_pattern"][0]
    stages.append(
        stage(
            "pattern",
            "softmax",
            "a = softmax(s)",
            p + "attn.hook_pattern",
            pattern,
            pattern[:, t],
            ["head", "query_pos", "key_pos"],
        )
    )
    full, row = vec("attn.hook_z")
    stages.append(
        stage(
            "z", "weighted sum", "z = a v", p + "attn.hook_z", full, row, ["pos", "head", "d_head"]
        )
    )
    attn_out, attn_out_t = vec("hook_attn_out")
    stages.append(
        stage(
            "attn_out",
            "W_O",
            "attn_out = concat(z) W_O",
            p + "hook_attn_out",
            attn_out,
            attn_out_t,
            ["pos", "d_model"],
        )
    )
    if parallel:
        pass  # the MLP reads x too: no resid_mid between the two (as in TransformerLens)
    elif pre_norm:
        full, row = vec("hook_resid_mid")
        stages.append(
            stage(
                "resid_mid",
                "residual",
                "resid_mid = x + attn_out",
                p + "hook_resid_mid",
                full,
                row,
                ["pos", "d_model"],
            )
        )
    else:
        added = resid_pre + attn_out
        stages.append(
            stage("add1", "residual", "x + attn_out", None, added, added[t], ["pos", "d_model"])
        )
        full, row = vec("hook_resid_mid")
        stages.append(
            stage(
                "resid_mid",
                f"{cfg.norm} 1",
                "resid_mid = norm(x + attn_out)",
                p + "hook_resid_mid",
                full,
                row,
                ["pos", "d_model"],
            )
        )
    if block.mlp is None:
        stages.append(
            {
                "key": "mlp",
                "title": "MLP",
                "hook": None,
                "shape": None,
                "dims": None,
                "values": None,
                "equation": "skipped: attention-only model",
            }
        )
        return stages
    if pre_norm:
        full, row = vec("ln2.hook_normalized")
        source = "x" if parallel else "resid_mid"
        equation = f"m̂ = {normalized.replace('x', source)}, before its weight"
        if parallel:
            equation += "  (parallel block: the MLP reads resid_pre)"
        stages.append(
            stage(
                "ln2",
                f"{cfg.norm} 2",
                equation,
                p + "ln2.hook_normalized",
                full,
                row,
                ["pos", "d_model"],
            )
        )
    full, row = vec("mlp.hook_pre")
    stages.append(
        stage(
            "mlp_pre",
            "MLP in",
            "h = (m̂ ⊙ w + b) W_in" if cfg.mlp != "swiglu" else "h = (m̂ ⊙ w) W_gate",
            p + "mlp.hook_pre",
            full,
            row,
            ["pos", "d_mlp"],
        )
    )
    full, row = vec("mlp.hook_post")
    stages.append(
        stage(
            "mlp_post",
            "MLP activation",
            f"{cfg.mlp}(h)",
            p + "mlp.hook_post",
            full,
            row,
            ["pos", "d_mlp"],
        )
    )
    mlp_out, mlp_out_t = vec("hook_mlp_out")
    stages.append(
        stage(
            "mlp_out",
            "MLP out",
            "mlp_out = act(h) W_out",
            p + "hook_mlp_out",
            mlp_out,
            mlp_out_t,
            ["pos", "d_model"],
        )
    )
    resid_post, resid_post_t = vec("hook_resid_post")
    if parallel:
        stages.append(
            stage(
                "resid_post",
                "residual",
                "resid_post = x + attn_out + mlp_out",
                p + "hook_resid_post",
                resid_post,
                resid_post_t,
                ["pos", "d_model"],
            )
        )
    elif pre_norm:
        stages.append(
            stage(
                "resid_post",
                "residual",
                "resid_post = resid_mid + mlp_out",
                p + "hook_resid_post",
                resid_post,
                resid_post_t,
                ["pos", "d_model"],
            )
        )
    else:
        resid_mid = cache[p + "hook_resid_mid"][0]
        added = resid_mid + mlp_out
        stages.append(
            stage(
                "add2", "residual", "resid_mid + mlp_out", None, added, added[t], ["pos", "d_model"]
            )
        )
        stages.append(
            stage(
                "resid_post",
                f"{cfg.norm} 2",
                "resid_post = norm(resid_mid + mlp_out)",
                p + "hook_resid_post",
                resid_post,
                resid_post_t,
                ["pos", "d_model"],
            )
        )
    return stages
