"""Generation you can watch: `generate` with every head's attention row of each step and the logits
each token is drawn from (the explorer's generation view streams them).

Design choices:
- The loop is attnlab.generate.loop.generate, its KV cache, decode step and sampling included, so
  the tokens are `generate`'s for the same settings. Its `on_rows` hands out each step's rows: the
  kernel decode program (the default where it applies) keeps every layer's attention weights of
  the step, which its attention kernel computes anyway (`KernelDecoder.weights`): softmax(q·Kᵀ ·
  scale) over the cached keys, as rotated and normed as the scores use them, with the step's own
  mask and window. A prefill through the modules, and the module path where the C step does not
  apply (`KernelDecoder.unsupported`), hand them out through a hook on every hook_pattern. So a
  step keeps n_layers × n_heads rows of its keys and nothing more. `decode_path` says beforehand
  which path a model takes, and why (the explorer's stream says so in its first line).
- Step t (t = 0 for the first new token) runs the query at position T + t − 1 (the prompt's last
  token, then each new token as it is fed back) over keys 0 … T + t − 1, and its logits choose the
  token at position T + t. So the row given with a token is what every head attended to when it was
  written, over the tokens before it; it is row T + t − 1 of the full pattern recomputed on the
  final ids (tests/test_generation_watch.py checks both paths against that one reference).
- `on_step` may raise to stop (the explorer's Stop button, a closed page): generate unwinds, the
  hooks come off, and the model is as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UserError
from .kernel_decoder import KernelDecoder
from .loop import generate


@dataclass
class Step:
    """One new token and the step that wrote it."""

    index: int  # the token's position in the sequence (prompt positions first)
    token: int  # its id
    rows: torch.Tensor  # [layer, head, key_pos]: the query at index − 1 over keys 0 … index − 1
    logits: torch.Tensor  # [d_vocab], float32: what the token was drawn from
    seconds: float  # the step's wall time: the forward pass (prefill for the first) and sampling


def decode_path(model) -> tuple[str, str | None]:
    """Which decode step a watched generation of `model` runs: ("kernels", None) for attnlab's C
    decode program, or ("modules", why the C step does not apply)."""
    reason = KernelDecoder.unsupported(model)
    return ("kernels", None) if reason is None else ("modules", reason)


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
    new token's Step as soon as it is chosen. The same tokens as generate's for the same settings,
    through the same decode step (`decode_path`)."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[0] != 1:
        raise UserError(
            f"watching a generation takes one prompt, got a batch of {ids.shape[0]}; "
            "generate them one at a time"
        )
    seen: dict[str, torch.Tensor] = {}
    T = ids.shape[1]
    written = 0
    clock = time.perf_counter()

    def keep_rows(rows: torch.Tensor) -> None:  # [batch, layer, head, key_pos]
        seen["rows"] = rows[0]

    def keep_logits(logits: torch.Tensor) -> None:  # [batch, d_vocab]
        # a copy: the kernel decode program's logits are a buffer its next step overwrites
        seen["logits"] = logits[0].to(torch.float32, copy=True)

    def on_token(token: torch.Tensor) -> None:  # [batch, 1]
        nonlocal written, clock
        now = time.perf_counter()
        step = Step(T + written, int(token[0, 0]), seen["rows"], seen["logits"], now - clock)
        written += 1
        on_step(step)
        clock = time.perf_counter()  # the caller's time is not the next step's

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
        on_rows=keep_rows,
    )
