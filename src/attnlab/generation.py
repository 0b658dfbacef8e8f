"""Generation: one token at a time, with a KV cache.

Design choices (after gpt-fast):
- `KVCache` is static: one preallocated buffer per layer for keys and values, written in place, so a
  decode step allocates nothing that grows with the sequence.
- `prefill` runs the whole prompt once and fills the cache; `decode_one_token` feeds back a single token
  whose query is the last position, attending to every cached key (the causal offset of
  attnlab.attention handles T < S; torch's top-left `is_causal` would be wrong here).
- Sampling: temperature (0 = greedy argmax), then top-k, then top-p (nucleus), from a seeded generator.
- Left-padded batches: `attention_mask` marks real tokens; positions count real tokens only, so each row
  generates as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import UserError


class KVCache:
    """Keys and values of every layer for positions [0, max_len): k, v of shape [layer, batch, kv_head, pos, d_head]."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, d_head: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (n_layers, batch, n_kv_heads, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim, model.dtype, model.device)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [batch, kv_head, T, d_head] at positions start..start+T; return all keys/values up to there."""
        end = start + k.shape[-2]
        if end > self.max_len:
            raise UserError(f"the KV cache holds {self.max_len} positions but generation reached {end}; raise max_len")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """logits (B, V) / temperature, with ids outside top-k and top-p set to −∞: softmax of this is what
    `sample_next` draws from (temperature > 0), so the explorer can show that very distribution."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def _check_args(model, ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k, top_p) -> None:
    if not model.config.causal:
        raise UserError("generate needs a causal (decoder) model; this one is an encoder")
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise UserError(f"top_k must be a positive integer, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")
    total = ids.shape[-1] + max_new_tokens
    if model.config.positional == "learned" and total > model.config.n_ctx:
        raise UserError(
            f"prompt ({ids.shape[-1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's "
            f"context n_ctx={model.config.n_ctx}; shorten the prompt or generate fewer tokens"
        )


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt (B, T), filling the cache; return the logits of its last position (B, V)."""
    return model(ids, kv_cache=cache, start_pos=0, positions=positions, attention_mask=attention_mask)[:, -1]


@torch.no_grad()
def decode_one_token(model, token: torch.Tensor, cache: KVCache, pos: int, positions: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Feed one token (B, 1) at cache position `pos`; return the next-token logits (B, V)."""
    return model(token, kv_cache=cache, start_pos=pos, positions=positions, attention_mask=attention_mask)[:, -1]


@torch.no_grad()
def generate(model, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, attention_mask: torch.Tensor | None = None,
             eos_token_id: int | None = None, on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """The prompt followed by `max_new_tokens` new tokens: (B, T) -> (B, T + new).

    attention_mask (B, T): 1 for real prompt tokens, 0 for left padding. `on_token` receives each new
    token column (B, 1) as it is chosen (for streaming). Stops early once every row has produced
    `eos_token_id`, padding the rest with it.
    """
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    _check_args(model, ids, max_new_tokens, temperature, top_k, top_p)
    was_training = model.training
    model.eval()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=ids.device).manual_seed(seed)
    B, T = ids.shape
    cache = KVCache.for_model(model, B, T + max_new_tokens)
    positions = None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=ids.device, dtype=torch.long)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = [ids]
    try:
        if max_new_tokens == 0:
            return ids
        logits = prefill(model, ids, cache, positions, attention_mask)
        done = torch.zeros(B, 1, dtype=torch.bool, device=ids.device)
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
                done = done | (token == eos_token_id)
            out.append(token)
            if on_token is not None:
                on_token(token)
            if step == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
                break
            pos = T + step
            step_positions = None
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=-1)
                step_positions = positions[:, -1:] + 1
                positions = torch.cat([positions, step_positions], dim=-1)
            logits = decode_one_token(model, token, cache, pos, step_positions, attention_mask)
    finally:
        model.train(was_training)
    result = torch.cat(out, dim=-1)
    if result.shape[-1] < T + max_new_tokens and eos_token_id is not None:
        pad = result.new_full((B, T + max_new_tokens - result.shape[-1]), eos_token_id)
        result = torch.cat([result, pad], dim=-1)
    return result
