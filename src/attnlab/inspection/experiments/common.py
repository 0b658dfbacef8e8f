"""What the experiments share: synthetic text where induction pays, a small training loop, and output files.

Design choices:
- The text is synthetic, so the experiments need no download and no data file, and the payoff of
  induction is known. `repeated_spans`: a random prefix, then a span of random length repeated (the
  induction experiment). `SyntheticText`: a fixed random bigram "language" with, chunk by chunk, either
  fresh bigram text or a copy of an earlier span of the same sequence (the extrapolation experiment).
- Training is a plain AdamW loop in this process (no checkpoints, no CLI), seeded, with linear warm-up;
  `on_eval(step, tokens_seen)` is called on a fixed schedule so experiments can take snapshots.
- Tiny models train on one thread (`threads(1)`): at this size a second thread costs more in
  synchronisation than it gains, badly so on a busy machine (5x slower measured on 2 loaded cores).
- Every experiment writes `<name>.json` (atomically) and `<name>.png` into --out and prints a table.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import UserError
from ...formats.native import atomic_write, atomic_write_text


@dataclass(frozen=True)
class SyntheticText:
    """Bigram text with copied spans. `d_vocab` tokens, `successors` likely next tokens each, a copy with prob `p_copy`."""

    d_vocab: int = 64
    successors: int = 3
    p_copy: float = 0.5
    min_span: int = 6
    max_span: int = 16
    seed: int = 1234  # the language (transition table) itself; sequences use their own seeds

    def transitions(self) -> torch.Tensor:
        """[d_vocab, d_vocab] next-token probabilities: mass mostly on `successors` random tokens, a little everywhere."""
        g = torch.Generator().manual_seed(self.seed)
        probs = torch.full((self.d_vocab, self.d_vocab), 0.1 / self.d_vocab)
        for token in range(self.d_vocab):
            nxt = torch.randperm(self.d_vocab, generator=g)[: self.successors]
            weights = torch.rand(self.successors, generator=g) + 0.5
            probs[token, nxt] += 0.9 * weights / weights.sum()
        return probs / probs.sum(-1, keepdim=True)

    def sample(self, n: int, T: int, seed: int) -> torch.Tensor:
        """n sequences of T tokens (n, T), reproducible from `seed`: bigram text, then copies pasted over it."""
        g = torch.Generator().manual_seed(seed)
        probs = self.transitions()
        out = torch.empty(n, T, dtype=torch.long)
        out[:, 0] = torch.randint(self.d_vocab, (n,), generator=g)
        for t in range(1, T):  # the bigram chain, all rows at once
            out[:, t] = torch.multinomial(probs[out[:, t - 1]], 1, generator=g).squeeze(1)
        # Walk each row in chunks; a chunk is, with prob p_copy, a copy of an earlier span of the same row.
        spans = torch.randint(self.min_span, self.max_span + 1, (n, T // self.min_span + 1), generator=g).tolist()
        coins = (torch.rand(n, T // self.min_span + 1, generator=g) < self.p_copy).tolist()
        starts = torch.rand(n, T // self.min_span + 1, generator=g).tolist()
        for row in range(n):
            pos, chunk = 0, 0
            while pos < T:
                span = min(spans[row][chunk], T - pos)
                if pos > span and coins[row][chunk]:
                    src = int(starts[row][chunk] * (pos - span))  # the copy ends before it starts: src + span <= pos
                    out[row, pos:pos + span] = out[row, src:src + span].clone()
                pos, chunk = pos + span, chunk + 1
        return out


def repeated_spans(n: int, T: int, d_vocab: int, seed: int, min_span: int = 4, max_span: int = 20, max_prefix: int = 8) -> torch.Tensor:
    """n sequences (n, T): a random prefix (0..max_prefix−1 tokens), then one span of distinct random tokens
    repeated to the end. The span's length varies per sequence, so "look ℓ back" cannot predict it: only
    "find the last occurrence of this token and copy what followed" (induction) does.
    """
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, T, dtype=torch.long)
    for row in range(n):
        prefix = int(torch.randint(0, max_prefix, (1,), generator=g))
        span = min(d_vocab, int(torch.randint(min_span, max_span + 1, (1,), generator=g)))
        tokens = torch.randperm(d_vocab, generator=g)[:span]
        out[row] = torch.cat([torch.randint(d_vocab, (prefix,), generator=g), tokens.repeat(T // span + 1)])[:T]
    return out


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with torch using n threads, restoring the previous number afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(
    model,
    data: torch.Tensor,
    *,
    steps: int,
    batch: int,
    lr: float = 1e-3,
    warmup: int = 20,
    seed: int = 0,
    eval_every: int = 0,
    on_eval: Callable[[int, int], None] | None = None,
    progress: str | None = None,
) -> None:
    """AdamW on next-token loss over random rows of `data` (N, T+1); calls on_eval(step, tokens_seen) at 0, every eval_every, and the end."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    T = data.shape[1] - 1
    model.train()
    for step in tqdm(range(steps + 1), desc=progress, disable=progress is None, leave=False):
        if on_eval is not None and (step == steps or (eval_every and step % eval_every == 0)):
            model.eval()
            on_eval(step, step * batch * T)
            model.train()
        if step == steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, warmup))
        rows = data[torch.randint(len(data), (batch,), generator=g)]
        loss = model.loss(rows[:, :-1], rows[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def per_token_loss(model, data: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Mean next-token loss at each position over the rows of `data` (N, T+1) -> [T]."""
    total = torch.zeros(data.shape[1] - 1)
    with torch.no_grad():
        for rows in data.split(batch):
            logits = model(rows[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), rows[:, 1:], reduction="none")
            total += loss.sum(0)
    return total / len(data)


def make_out_dir(out: Path) -> None:
    """Create the output directory, or say in one line why it cannot be one."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory; pass a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)


def write_outputs(out: Path, name: str, result: dict, plot: Callable[[dict, Path], None]) -> None:
    """Write `<out>/<name>.json` and, with `plot(result, path)`, `<out>/<name>.png`, creating `out`."""
    make_out_dir(out)
    write_json(out / f"{name}.json", result)
    plot(result, out / f"{name}.png")


def write_json(path: Path, result: dict) -> None:
    atomic_write_text(path, json.dumps(result, indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def save_figure(fig, path: Path) -> None:
    """Write `fig` as a PNG (atomically) and close it."""
    import matplotlib.pyplot as plt

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def new_figure(rows: int, cols: int, size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    return fig, axes


def format_table(header: list[str], rows: list[list]) -> str:
    """A plain text table; floats with 3 decimals, None as n/a."""

    def cell(v) -> str:
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "n/a"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [header] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
