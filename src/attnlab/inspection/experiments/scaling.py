"""`attnlab experiment scaling`: why the chapters divide Q·Kᵀ by √d_k.

The claim: with q and k of unit-variance components, q·k has variance d_k, so without the scale the
softmax saturates as d_k grows (one key takes nearly all the weight) and the gradient that flows
back through it vanishes; with 1/√d_k the scores keep unit variance and none of that depends on d_k.

Design choices:
- Measured, not argued: random q, k ~ N(0, 1) (fixed seed), S keys per query, for growing d_k, with
  scale 1/√d_k and with scale 1. The scores and weights come from attnlab.model.attention's own
  `attention_scores` and `attention_pattern`, the functions every model here runs.
- Three numbers per setting, averaged over queries: the softmax's entropy (nats; log S is uniform),
  its largest weight, and the norm of the gradient reaching the softmax input (the scaled scores)
  when a random N(0, 1) gradient arrives at the weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...model.attention import attention_pattern, attention_scores
from .common import format_table, new_figure, save_figure, write_outputs

D_KS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)


def measure(
    d_k: int, scaled: bool, *, n_queries: int = 512, n_keys: int = 64, seed: int = 0
) -> dict:
    """Entropy, largest weight and gradient norm of softmax(q·kᵀ · scale) for one d_k."""
    g = torch.Generator().manual_seed(seed + d_k)
    # [query, 1, d_k]: one query per row
    q = torch.randn(n_queries, 1, d_k, generator=g, dtype=torch.float64)
    k = torch.randn(n_queries, n_keys, d_k, generator=g, dtype=torch.float64)  # [query, key, d_k]
    upstream = torch.randn(n_queries, 1, n_keys, generator=g, dtype=torch.float64)
    scale = d_k**-0.5 if scaled else 1.0
    scores = attention_scores(q, k, scale).detach().requires_grad_(True)  # [query, 1, key]
    pattern = attention_pattern(scores)
    (pattern * upstream).sum().backward()
    p = pattern.detach()
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return {
        "d_k": d_k,
        "scaled": scaled,
        "score_std": float(scores.detach().std()),
        "entropy": float(entropy.mean()),
        "max_weight": float(pattern.detach().max(-1).values.mean()),
        "grad_norm": float(scores.grad.norm(dim=-1).mean()),
    }


def run(out: Path, *, seed: int = 0, quick: bool = False) -> dict:
    n_keys = 64
    d_ks = D_KS[::2] if quick else D_KS
    rows = [measure(d, scaled, n_keys=n_keys, seed=seed) for scaled in (True, False) for d in d_ks]
    result = {
        "experiment": "scaling",
        "what": "softmax(q.k * scale) over random q, k ~ N(0,1): scale = 1/sqrt(d_k) (scaled) vs "
        "1 (unscaled)",
        "n_keys": n_keys,
        "uniform_entropy": math.log(n_keys),
        "seed": seed,
        "rows": rows,
    }
    write_outputs(out, "scaling", result, plot)
    return result


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(1, 3, (13, 3.8))
    panels = (
        ("entropy", "softmax entropy (nats)"),
        ("max_weight", "largest weight"),
        ("grad_norm", "gradient norm at the softmax input"),
    )
    for ax, (key, title) in zip(axes[0], panels):
        for scaled, style in ((True, "o-"), (False, "s--")):
            rows = [r for r in result["rows"] if r["scaled"] == scaled]
            ax.plot(
                [r["d_k"] for r in rows],
                [r[key] for r in rows],
                style,
                label="× 1/√d_k" if scaled else "no scale",
            )
        if key == "entropy":
            ax.axhline(
                result["uniform_entropy"], color="gray", lw=0.8, ls=":", label="uniform (log S)"
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_k")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"Why divide by √d_k: random q, k ~ N(0,1), {result['n_keys']} keys")
    save_figure(fig, path)


def table(result: dict) -> str:
    rows = [
        [
            r["d_k"],
            "1/√d_k" if r["scaled"] else "none",
            r["score_std"],
            r["entropy"],
            r["max_weight"],
            r["grad_norm"],
        ]
        for r in result["rows"]
    ]
    return format_table(["d_k", "scale", "score std", "entropy", "max weight", "grad norm"], rows)
