"""Attention patterns of long inputs, for chosen layers and heads only, without every T×T matrix.

Design choices:
- `run_with_cache(names_filter=...hook_pattern)` makes the hooked layers materialise all of their
  heads' T×T patterns (and keeps them). Here we hook only the queries and keys
  (`hook_rot_q`/`hook_rot_k` with RoPE, else `hook_q`/`hook_k` plus the layer's own QK-norm), so
  every layer keeps torch's fused kernel, and then compute the chosen heads' patterns with
  attnlab.model.attention's own `attention_scores`, `apply_mask` and `attention_pattern`: the
  equation stays in one place.
- Queries are processed `query_chunk` rows at a time; for a causal model the chunk [a, b) sees keys
  [0, b) only, which is exactly apply_mask's "last T of S queries" alignment, so peak memory is
  chunk × S per chosen head instead of T × S per head of every layer.
- The forward pass stops after the last chosen layer (`stop_at_layer`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import UserError
from ..generate.fast_layers import inference_layers
from ..model.attention import apply_mask, attention_pattern, attention_scores, expand_kv


def capture_patterns(
    model,
    ids: torch.Tensor,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    *,
    query_chunk: int | None = 256,
    attention_mask: torch.Tensor | None = None,
    **forward_kwargs,
) -> dict[int, torch.Tensor]:
    """{layer: pattern [batch, len(heads), query_pos, key_pos]} for the chosen layers and heads.

    Equal to `run_with_cache(...)["blocks.{layer}.attn.hook_pattern"][:, heads]` (tested), computed
    from the hooked queries and keys. Works without a KV cache only (a full forward pass).
    """
    cfg = model.config
    layers = sorted(set(range(cfg.n_layers) if layers is None else layers))
    heads = list(range(cfg.n_heads) if heads is None else heads)
    if not layers or not heads:
        raise UserError(
            f"choose at least one layer and one head; got layers={layers}, heads={heads}"
        )
    for layer in layers:
        if not 0 <= layer < cfg.n_layers:
            raise UserError(
                f"layer {layer} does not exist; this model has layers 0..{cfg.n_layers - 1}"
            )
    for head in heads:
        if not 0 <= head < cfg.n_heads:
            raise UserError(
                f"head {head} does not exist; this model has heads 0..{cfg.n_heads - 1}"
            )
    head_index = torch.tensor(heads, device=ids.device)
    mask = None
    if attention_mask is not None:
        # [batch, 1, 1, key_pos], as the model builds it
        mask = attention_mask.to(torch.bool)[:, None, None, :]
    patterns = {}
    captured = capture_queries_keys(
        model, ids, layers, attention_mask=attention_mask, **forward_kwargs
    )
    for layer, (q, k) in captured.items():
        k = expand_kv(q, k)[:, head_index]
        q = q[:, head_index]
        patterns[layer] = _chunked_pattern(
            q, k, cfg.scale, cfg.causal, mask, query_chunk, model.blocks[layer].attn.window
        )
    return patterns


def capture_queries_keys(
    model, ids: torch.Tensor, layers: Iterable[int], **forward_kwargs
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (q [batch, head, pos, d_head], k [batch, kv_head, key_pos, d_head])}: the queries
    and keys of the chosen layers as the scores use them (after QK-norm and RoPE), from one forward
    pass that stops after the last of them and keeps torch's fused kernel in every layer. Run it
    under no_grad; hooks already attached to the model (an ablation) run too."""
    cfg = model.config
    layers = sorted(set(layers))
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    rotated = cfg.positional == "rope"
    q_name, k_name = ("hook_rot_q", "hook_rot_k") if rotated else ("hook_q", "hook_k")
    captured: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, hook) -> None:
        captured[hook.name] = tensor.detach()

    fwd_hooks = [(f"blocks.{l}.attn.{n}", keep) for l in layers for n in (q_name, k_name)]
    start = forward_kwargs.get("start_at_layer")
    with torch.no_grad(), model.hooks(fwd_hooks), inference_layers(model, ids, start):
        model(ids, stop_at_layer=layers[-1] + 1, **forward_kwargs)
    out = {}
    for layer in layers:
        attn = model.blocks[layer].attn
        q = captured.pop(f"blocks.{layer}.attn.{q_name}")  # [batch, pos, head, d_head]
        k = captured.pop(f"blocks.{layer}.attn.{k_name}")  # [batch, key_pos, kv_head, d_head]
        if not rotated and attn.q_norm is not None:  # hook_q/hook_k come before the QK-norm
            with torch.no_grad():
                q, k = attn.q_norm(q), attn.k_norm(k)
        out[layer] = q.transpose(1, 2), k.transpose(1, 2)  # [batch, heads, pos, d_head]
    return out


def _chunked_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None,
    query_chunk: int | None,
    window: int | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) for q [B, h, T, D], k [B, h, S, D], query_chunk rows at a time
    -> [B, h, T, S] (a sliding window keeps its band: the chunk's causal offset is the one the band
    is measured from)."""
    B, h, T, _ = q.shape
    S = k.shape[-2]
    chunk = query_chunk or T
    out = torch.zeros(B, h, T, S, dtype=q.dtype, device=q.device)
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        # causal: rows [a, b) see keys up to their own position only
        end = b + (S - T) if causal else S
        part_mask = mask[..., :end] if mask is not None else None
        scores = attention_scores(q[:, :, a:b], k[:, :, :end], scale)  # [B, h, b − a, end]
        out[:, :, a:b, :end] = attention_pattern(
            apply_mask(scores, causal=causal, mask=part_mask, window=window)
        )
    return out
