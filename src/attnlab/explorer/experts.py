"""The router of a mixture-of-experts model (attnlab.model.moe) on a text, for the experts view: one
layer's scores over every expert for each token, the experts each token chose with their weights,
and every layer's load (how many tokens chose each expert).

Design choices:
- The numbers are the model's own hook points, read with `run_with_cache` as a lens user reads
  them: the scores are `blocks.{layer}.mlp.hook_expert_weights` (the router's softmax over every
  expert, [pos, n_experts]), the choices `blocks.{layer}.mlp.hook_expert_indices` ([pos,
  experts_per_token], best first); the weights are attnlab.model.moe's `mixing_weights` of the
  chosen scores (renormalised where the model renormalises), the one place that rule lives.
- One layer's per-token scores travel (T × n_experts numbers); the load of every layer travels
  with it (n_layers × n_experts counts), so switching layers changes only the heatmap and the
  overview is there at once. The forward pass runs every block either way: the load needs them.
- The load is the count of tokens routed to each expert, and beside it each expert's mean score
  over the tokens: the two factors of the Switch Transformer's load-balancing loss (Fedus et al.
  2021, f_i and P_i; balanced: every count T·k/n_experts).
- A dense model has no router: `Unsupported` (HTTP 409) naming the model and what to pick instead.
- Knocked-out heads and a training step apply as in every view (the request's `Variant`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..model.moe import mixing_weights
from .models import PLAIN, Unsupported, Variant

SCORES, CHOSEN = "mlp.hook_expert_weights", "mlp.hook_expert_indices"


def experts(explorer, name: str, text: str, layer: int, variant: Variant = PLAIN) -> dict[str, Any]:
    """Layer `layer`'s router on `text` (scores, chosen experts, their weights) and every layer's
    load."""
    entry = explorer.served.entry(name, variant)
    cfg = entry.model.config
    if not cfg.n_experts:
        raise Unsupported(
            f"model {name!r} has no experts (a dense MLP in every block), so no router to show; "
            "pick a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE)"
        )
    explorer.served.check_index(entry, layer)
    ids, tokens = explorer.served.encode(entry, text)
    cache, _ = explorer.served.cached_run(entry, ids, lambda n: n.endswith((SCORES, CHOSEN)))
    counts, mean_scores = [], []
    for block in range(cfg.n_layers):
        scores = cache[f"blocks.{block}.{SCORES}"][0]  # [pos, n_experts]
        chosen = cache[f"blocks.{block}.{CHOSEN}"][0]  # [pos, experts_per_token]
        counts.append(torch.bincount(chosen.flatten(), minlength=cfg.n_experts).tolist())
        mean_scores.append(scores.float().mean(0).tolist())
    scores = cache[f"blocks.{layer}.{SCORES}"][0]
    chosen = cache[f"blocks.{layer}.{CHOSEN}"][0]
    weights = mixing_weights(scores.gather(-1, chosen), cfg.norm_topk_prob)
    return {
        "layer": layer,
        "tokens": tokens,
        "n_layers": cfg.n_layers,
        "n_experts": cfg.n_experts,
        "experts_per_token": cfg.experts_per_token,
        "norm_topk_prob": cfg.norm_topk_prob,
        "shared_expert": bool(cfg.d_shared_expert),
        "hooks": {
            "scores": f"blocks.{layer}.{SCORES}",
            "chosen": f"blocks.{layer}.{CHOSEN}",
        },
        "scores": scores.float().tolist(),  # [pos, n_experts]
        "chosen": chosen.tolist(),  # [pos, experts_per_token], best first
        "weights": weights.float().tolist(),  # [pos, experts_per_token]
        "load": {"counts": counts, "mean_scores": mean_scores},  # [n_layers, n_experts] each
    }
