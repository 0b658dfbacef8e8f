"""Choosing the next token from the logits: temperature (0 = greedy argmax), then top-k, then top-p
(nucleus), from a seeded generator.

Sampling never reads a tensor on the host: greedy is an argmax; otherwise the token is the argmax of
p_i / E_i with E_i ~ Exp(1), which picks i with probability p_i (the "exponential race" of gpt-fast)
and avoids torch.multinomial.
"""

from __future__ import annotations

import torch


def filter_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """logits (B, V) / temperature, with ids outside top-k and top-p set to −∞: softmax of this is
    what `sample_next` draws from (temperature > 0), so the explorer can show that very
    distribution."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest set whose mass reaches top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        # and always the most likely id (a top_p below float32's smallest number is 0 here)
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). temperature 0 is greedy.

    argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p: P(i wins) = p_i (the minimum of
    independent exponentials E_i / p_i). Unlike torch.multinomial it never waits on the host.
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1, keepdim=True)
