"""Generation you can watch: `generate` with every head's attention row of each step and the logits
each token is drawn from (the explorer's generation view streams them).

Design choices:
- The loop is attnlab.generate.loop.generate, its KV cache and sampling included, run through the
  model's modules (use_kernels=False): the kernel decode program computes no pattern. A hook on
  every hook_pattern keeps the last query row of each layer as the step computes it, so a step
  keeps n_layers × n_heads rows of its keys and nothing more.
- Step t (t = 0 for the first new token) runs the query at position T + t − 1 (the prompt's last
  token, then each new token as it is fed back) over keys 0 … T + t − 1, and its logits choose the
  token at position T + t. So the row given with a token is what every head attended to when it was
  written, over the tokens before it; it is row T + t − 1 of the full pattern recomputed on the
  final ids (tests/test_generation_watch.py checks it against that one reference).
- `on_step` may raise to stop (the explorer's Stop button, a closed page): generate unwinds, the
  hooks come off, and the model is as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UserError
from .loop import generate


@dataclass
class Step:
    """One new token and the step that wrote it."""

    index: int  # the token's position in the sequence (prompt positions first)
    token: int  # its id
    rows: torch.Tensor  # [layer, head, key_pos]: the query at index − 1 over keys 0 … index − 1
    logits: torch.Tensor  # [d_vocab], float32: what the token was drawn from
    seconds: float  # the step's wall time: the forward pass (prefill for the first) and sampling


@torch.no_grad()
def generate_watched(
    model,
    ids: torch.Tensor,
    max_new_tokens: int,
    on_step: Callable[[Step], None],
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """`generate(model, ids, ...)` of one prompt (1, T) -> (1, T + new), calling `on_step` with each
    new token's Step as soon as it is chosen. The same tokens as generate's for the same settings
    (its module path)."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[0] != 1:
        raise UserError(
            f"watching a generation takes one prompt, got a batch of {ids.shape[0]}; "
            "generate them one at a time"
        )
    layer_of = {
        f"blocks.{layer}.attn.hook_pattern": layer for layer in range(model.config.n_layers)
    }
    rows: list[torch.Tensor | None] = [None] * model.config.n_layers
    seen: dict[str, torch.Tensor] = {}
    T = ids.shape[1]
    written = 0
    clock = time.perf_counter()

    def keep_row(pattern: torch.Tensor, hook) -> None:  # [batch, head, query_pos, key_pos]
        # the last query's row, copied: a view would keep the prompt's whole T × T pattern alive
        rows[layer_of[hook.name]] = pattern[0, :, -1].float().clone()

    def keep_logits(logits: torch.Tensor) -> None:  # [batch, d_vocab]
        seen["logits"] = logits[0].float()

    def on_token(token: torch.Tensor) -> None:  # [batch, 1]
        nonlocal written, clock
        now = time.perf_counter()
        step = Step(T + written, int(token[0, 0]), torch.stack(rows), seen["logits"], now - clock)
        written += 1
        on_step(step)
        clock = time.perf_counter()  # the caller's time is not the next step's

    with model.hooks([(layer_of.__contains__, keep_row)]):
        return generate(
            model,
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
            on_token=on_token,
            on_logits=keep_logits,
            use_kernels=False,
        )
