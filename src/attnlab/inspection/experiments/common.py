"""What the experiments share: synthetic text where induction pays, training it with the Trainer,
output files.

Design choices:
- The text is synthetic, so the experiments need no download and no data file, and the payoff of
  induction is known. `repeated_spans`: a random prefix, then a span of random length repeated (the
  induction experiment). `SyntheticText`: a fixed random bigram "language" with, chunk by chunk,
  either fresh bigram text or a copy of an earlier span of the same sequence (the extrapolation
  experiment).
- One training loop: `train_run` trains with attnlab.training.Trainer (`attnlab train`'s loop), each
  model a run directory (checkpoint, tokenizer, metrics, optional snapshots) that `attnlab.load`,
  `attnlab attribute`/`patch` and the explorer read. The synthetic token ids go in as text, one
  character per id.
- Tiny models train on one thread (`threads(1)`): at this size a second thread costs more in
  synchronisation than it gains, badly so on a busy machine.
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
from ...files import atomic_write, atomic_write_text
from ...generate.fast_layers import inference_layers
from ...model.transformer import next_token_loss
from ...tokenizer import Tokenizer
from ...training.config import TrainConfig
from ...training.trainer import Trainer


@dataclass(frozen=True)
class SyntheticText:
    """Bigram text with copied spans. `d_vocab` tokens, `successors` likely next tokens each, a copy
    with prob `p_copy`."""

    d_vocab: int = 64
    successors: int = 3
    p_copy: float = 0.5
    min_span: int = 6
    max_span: int = 16
    seed: int = 1234  # the language (transition table) itself; sequences use their own seeds

    def transitions(self) -> torch.Tensor:
        """[d_vocab, d_vocab] next-token probabilities: mass mostly on `successors` random tokens, a
        little everywhere."""
        g = torch.Generator().manual_seed(self.seed)
        probs = torch.full((self.d_vocab, self.d_vocab), 0.1 / self.d_vocab)
        for token in range(self.d_vocab):
            nxt = torch.randperm(self.d_vocab, generator=g)[: self.successors]
            weights = torch.rand(self.successors, generator=g) + 0.5
            probs[token, nxt] += 0.9 * weights / weights.sum()
        return probs / probs.sum(-1, keepdim=True)

    def sample(self, n: int, T: int, seed: int) -> torch.Tensor:
        """n sequences of T tokens (n, T), reproducible from `seed`: bigram text, then copies pasted
        over it."""
        g = torch.Generator().manual_seed(seed)
        probs = self.transitions()
        out = torch.empty(n, T, dtype=torch.long)
        out[:, 0] = torch.randint(self.d_vocab, (n,), generator=g)
        for t in range(1, T):  # the bigram chain, all rows at once
            out[:, t] = torch.multinomial(probs[out[:, t - 1]], 1, generator=g).squeeze(1)
        # Walk each row in chunks; a chunk is, with prob p_copy, a copy of an earlier span of the
        # same row.
        spans = torch.randint(
            self.min_span, self.max_span + 1, (n, T // self.min_span + 1), generator=g
        ).tolist()
        coins = (torch.rand(n, T // self.min_span + 1, generator=g) < self.p_copy).tolist()
        starts = torch.rand(n, T // self.min_span + 1, generator=g).tolist()
        for row in range(n):
            pos, chunk = 0, 0
            while pos < T:
                span = min(spans[row][chunk], T - pos)
                if pos > span and coins[row][chunk]:
                    # the copy ends before it starts: src + span <= pos
                    src = int(starts[row][chunk] * (pos - span))
                    out[row, pos : pos + span] = out[row, src : src + span].clone()
                pos, chunk = pos + span, chunk + 1
        return out


def repeated_spans(
    n: int,
    T: int,
    d_vocab: int,
    seed: int,
    min_span: int = 4,
    max_span: int = 20,
    max_prefix: int = 8,
) -> torch.Tensor:
    """n sequences (n, T): a random prefix (0..max_prefix−1 tokens), then one span of distinct
    random tokens repeated to the end. The span's length varies per sequence, so "look ℓ back"
    cannot predict it: only "find the last occurrence of this token and copy what followed"
    (induction) does.
    """
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, T, dtype=torch.long)
    for row in range(n):
        prefix = int(torch.randint(0, max_prefix, (1,), generator=g))
        span = min(d_vocab, int(torch.randint(min_span, max_span + 1, (1,), generator=g)))
        tokens = torch.randperm(d_vocab, generator=g)[:span]
        out[row] = torch.cat(
            [torch.randint(d_vocab, (prefix,), generator=g), tokens.repeat(T // span + 1)]
        )[:T]
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


# one printable character per token id (no spaces: every character is one token, in sorted order)
ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789αβγδεζηθικλμνξοπρστυφχψω"
    "ΓΔΘΛΞΠΣΦΨΩбгдёжзийлпфцчшщъыьэюя!#$%&*+<=>?"
)


def token_tokenizer(d_vocab: int):
    """A character tokenizer whose ids 0..d_vocab-1 are d_vocab distinct printable characters:
    synthetic token ids written as text, for the Trainer (which reads text) and the explorer (which
    shows it)."""
    assert len(set(ALPHABET)) == len(ALPHABET) >= d_vocab
    return Tokenizer.train_char("".join(sorted(ALPHABET)[:d_vocab]))


def train_run(
    data: torch.Tensor,
    d_vocab: int,
    out: Path,
    *,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    progress: bool = False,
    on_snapshot=None,
    **flags,
):
    """Train a model on the sequences `data` (N, T+1) of token ids below d_vocab with the training
    package's
    Trainer (the loop of `attnlab train`), into the run directory `out`; return the trained model
    (eval mode).

    The sequences are written end to end as text, one character per id (`token_tokenizer`), into
    out/data.txt; the run's character tokenizer, trained on that text, gives back the same ids
    (checked), and windows start only at sequence starts (--window-stride T + 1). The Trainer keeps
    the first 90% of the sequences for training and the rest for its val loss. The experiments'
    recipe: AdamW with betas 0.9, 0.98 and no weight decay, a 20-step warm-up to a constant learning
    rate (min_lr = lr), clipping at 1. `flags` are further TrainConfig fields (the model's shape,
    snapshots, eval_interval). With `progress`, the Trainer's progress bar on stderr, without its
    line per evaluation (metrics.jsonl has them). `on_snapshot`:
    the Trainer's, called with (step, model) at every snapshot step."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = token_tokenizer(d_vocab)
    data_file = out / "data.txt"
    atomic_write_text(data_file, tokenizer.decode(data.flatten().tolist()))
    T = data.shape[1] - 1
    cfg = TrainConfig(
        **{
            "data": str(data_file),
            "tokenizer": "char",
            "out": str(out),
            "window_stride": T + 1,
            "block_size": T,
            "batch_size": batch,
            "max_iters": steps,
            "learning_rate": lr,
            "min_lr": lr,
            "warmup_iters": 20,
            "weight_decay": 0.0,
            "beta1": 0.9,
            "beta2": 0.98,
            "grad_clip": 1.0,
            "eval_interval": steps,
            "eval_iters": 4,
            "seed": seed,
            "device": "cpu",
            "dtype": "float32",
            **flags,
        }
    )
    # the bar, not 100 lines a model
    trainer = Trainer(
        cfg, overwrite=True, progress=progress, evaluation_lines=False, on_snapshot=on_snapshot
    )
    ids = list(range(d_vocab))
    assert trainer.tokenizer.encode(tokenizer.decode(ids)) == ids, (
        "every token id must occur in the data"
    )
    trainer.run()
    return trainer.raw_model.eval()


def per_token_loss(model, data: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Mean next-token loss at each position over the rows of `data` (N, T+1) -> [T]."""
    total = torch.zeros(data.shape[1] - 1)
    with torch.no_grad():
        for rows in data.split(batch):
            with inference_layers(model, rows[:, :-1]):  # the C kernels' layers
                logits = model(rows[:, :-1])
            total += next_token_loss(logits, rows[:, 1:], reduction="none").sum(0)
    return total / len(data)


def make_out_dir(out: Path) -> None:
    """Create the output directory, or say in one line why it cannot be one."""
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--out {out} is a file, not a directory; pass a directory (it is created if missing)"
        )
    out.mkdir(parents=True, exist_ok=True)


def write_outputs(out: Path, name: str, result: dict, plot: Callable[[dict, Path], None]) -> None:
    """Write `<out>/<name>.json` and, with `plot(result, path)`, `<out>/<name>.png`, creating
    `out`."""
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
    """A matplotlib figure of rows x cols axes (a 2-D array even for one), `size` in inches, drawn
    off screen (the Agg backend); `save_figure` writes it."""
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
