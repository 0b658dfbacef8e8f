"""`attnlab experiment extrapolation`: do positional encodings let a model run past its training
length?

The chapters say RoPE helps models generalise to longer sequences. Here four equal small models
(same width, depth, heads, data, seed, steps) differ only in `positional`: learned, sinusoidal,
rope, none. Each is trained at one context length L and evaluated on fresh sequences of length L, 2L
and 4L from the
same source (common.SyntheticText, whose copied spans may reach back further in a longer sequence).

Design choices:
- Two numbers per length: the mean loss over all positions, and the mean loss over the positions
  past L
  only (the part the model never saw in training). Position 0..L−1 of a longer sequence is the same
  task as in training, so the second number is where extrapolation shows.
- Learned positions have a table of n_ctx = L rows and cannot go past it: reported as n/a, not as a
  number. The other encodings are computed on the fly and run at any length.
- Trained by the training package's Trainer (`common.train_run`: AdamW, constant learning rate after
  a short warm-up), each model a run directory OUT/extrapolation-POSITIONAL that `attnlab.load`
  reads.
- Reported as measured, whatever it shows.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .common import (
    SyntheticText,
    format_table,
    new_figure,
    per_token_loss,
    save_figure,
    threads,
    train_run,
    write_outputs,
)

POSITIONALS = ("learned", "sinusoidal", "rope", "none")
FACTORS = (1, 2, 4)


@dataclass(frozen=True)
class ExtrapolationSetup:
    n_ctx: int = 64  # the training length L
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_vocab: int = 64
    steps: int = 1200
    batch: int = 32
    lr: float = 3e-3
    n_train: int = 3000  # sequences: the first 90% train, the rest the Trainer's val loss
    n_eval: int = 128


FULL = ExtrapolationSetup()
QUICK = ExtrapolationSetup(n_ctx=32, d_model=32, steps=150, n_train=500, n_eval=32)


def run(out: Path, *, seed: int = 0, quick: bool = False, progress: bool = True) -> dict:
    with threads(1):
        return _run(out, seed=seed, quick=quick, progress=progress)


def _run(out: Path, *, seed: int, quick: bool, progress: bool) -> dict:
    setup = QUICK if quick else FULL
    text = SyntheticText(d_vocab=setup.d_vocab)
    data = text.sample(setup.n_train, setup.n_ctx + 1, seed=seed + 1)
    evals = {
        f: text.sample(setup.n_eval, f * setup.n_ctx + 1, seed=seed + 10_000 + f) for f in FACTORS
    }
    rows = []
    for positional in POSITIONALS:
        if progress:
            print(f"training the {positional} model", file=sys.stderr)
        model = train_run(
            data,
            setup.d_vocab,
            out / f"extrapolation-{positional}",
            steps=setup.steps,
            batch=setup.batch,
            lr=setup.lr,
            seed=seed,
            progress=progress,
            n_layer=setup.n_layers,
            n_head=setup.n_heads,
            n_embd=setup.d_model,
            d_mlp=2 * setup.d_model,
            pos=positional,
        )
        row = {"positional": positional}
        for f in FACTORS:
            if f > 1 and positional == "learned":
                # no position table past n_ctx
                row[f"loss_{f}x"] = row[f"loss_beyond_L_{f}x"] = None
                continue
            loss = per_token_loss(model, evals[f])  # [f·L]
            row[f"loss_{f}x"] = float(loss.mean())
            row[f"loss_beyond_L_{f}x"] = float(loss[setup.n_ctx :].mean()) if f > 1 else None
        rows.append(row)
    result = {
        "experiment": "extrapolation",
        "quick": quick,
        "seed": seed,
        "setup": asdict(setup),
        "data": asdict(text),
        "trained_at": setup.n_ctx,
        "note": "learned positions have no table past n_ctx: n/a (null) beyond 1x",
        "rows": rows,
    }
    write_outputs(out, "extrapolation", result, plot)
    return result


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(1, 2, (10, 3.8))
    L = result["trained_at"]
    for ax, (prefix, title) in zip(
        axes[0],
        (("loss_", "mean loss, all positions"), ("loss_beyond_L_", f"mean loss past position {L}")),
    ):
        for row in result["rows"]:
            points = [(f * L, row.get(f"{prefix}{f}x")) for f in FACTORS]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                ax.plot(*zip(*points), "o-", label=row["positional"])
        ax.set_xscale("log", base=2)
        ax.set_xticks([f * L for f in FACTORS], [f"{f}× ({f * L})" for f in FACTORS])
        ax.set_xlabel("evaluation length")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"Trained at {L} tokens, evaluated longer (learned positions: n/a past {L})")
    save_figure(fig, path)


def table(result: dict) -> str:
    rows = [
        [r["positional"]]
        + [r[f"loss_{f}x"] for f in FACTORS]
        + [r[f"loss_beyond_L_{f}x"] for f in FACTORS[1:]]
        for r in result["rows"]
    ]
    L = result["trained_at"]
    header = (
        ["positions"]
        + [f"loss {f}x ({f * L})" for f in FACTORS]
        + [f"past {L} @{f}x" for f in FACTORS[1:]]
    )
    return format_table(header, rows)
