"""`attnlab experiment induction`: the induction-head phase change of Olsson et al. 2022, on a CPU.

What is trained: one-layer and two-layer attention-only Transformers (ModelConfig attn_only=True,
learned positions, untied embeddings), same width, heads, data, seed and steps, on
`common.repeated_spans`: a span of distinct random tokens, of a length that varies per sequence
(8-24), repeated to the end. Past the first copy every token is predictable, but only by looking
back for "what came after this token last time" (induction); a fixed look-back offset cannot work
because the span length varies.

Why these settings (measured, 2L model, 600 steps of batch 32, lr 3e-3, d_model 64, 4 heads, n_ctx
48):
- untied embeddings: with W_U = W_Eᵀ (the library's default) the best induction score stayed below
  0.2 for 600 steps, with vocabularies of 128 and 256, learned positions or RoPE, 2 or 4 heads,
  d_model 64 or 128, lr up to 1e-2 (and with a vocabulary of 64 it began only near step 3800 of
  4000); untied, it jumps from about 0.1 to 0.9 between steps 175 and 275. Elhage et al.'s and
  Olsson et al.'s small attention-only models have separate W_E and W_U too.
- a vocabulary of 128 and spans of 8-24: a larger vocabulary than the span, so the earlier
  occurrence of a token is unambiguous; the 4-20 spans with a random prefix left the 2L model at
  0.18 by step 600.
- no random prefix before the span (max_prefix=1): a prefix of 0-7 tokens delayed the phase change
  past
  step 600 (seeds 0 and 1; best induction score 0.09 at step 600). Without it the phase change comes
  at step 200-250 for seeds 0, 1 and 2, and the full run's 1000 steps, snapshot every 10, resolve
  it.

How it is trained: by the training package's Trainer, the one training loop (`attnlab train`'s),
with the experiment's settings as TrainConfig flags (`common.train_run`). The token sequences are
written as text,
one character per token id: `common.token_tokenizer` names the 128 ids by 128 distinct letters,
digits and symbols, and the run's character tokenizer, trained on that text, gives back the same
ids. The Trainer's windows start only at sequence starts (`--window-stride n_ctx + 1`): windows at
any offset were measured to delay the phase change past the quick run's 600 steps (best induction
score 0.09 at step 600), as a random prefix does (below).
Each model is a run directory, `OUT/induction-1L` and `OUT/induction-2L`: checkpoint, tokenizer,
float16 weight snapshots and a train/val loss (metrics.jsonl) every eval_every steps. `attnlab
attribute`, `attnlab patch` and the explorer load them; with `attnlab experiment induction
--explore` the explorer's step sliders scrub through both runs, opened at the step where the
two-layer model's induction score rises most.

What is measured at every snapshot step (on the float32 model during training; the snapshot files
are float16):
- loss: mean next-token loss on held-out sequences;
- in-context-learning (ICL) score: loss at a late token minus loss at an early one, Olsson et al.'s
  token 500 minus token 50 of 512, scaled to the context length (negative = later tokens are
  easier);
- best previous-token and best induction score over all heads (attnlab.inspection.scores, on
  repeated random tokens).
The phase change is located, for the two-layer model, as the snapshot interval where each of three
curves
moves most: the induction score rises most, the ICL score falls most, and the loss gap to the
one-layer
model (2L loss − 1L loss) falls most, i.e. the bump in the loss curve that only the two-layer model
has. The experiment reports those three places and whether they coincide; it asserts nothing.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..scores import head_scores
from .common import (
    format_table,
    new_figure,
    per_token_loss,
    repeated_spans,
    save_figure,
    threads,
    token_tokenizer,
    train_run,
    write_outputs,
)


@dataclass(frozen=True)
class InductionSetup:
    n_ctx: int = 48
    d_model: int = 64
    n_heads: int = 4
    d_vocab: int = 128
    min_span: int = 8  # the repeated span's length varies per sequence in [min_span, max_span]
    max_span: int = 24
    max_prefix: int = 1  # random tokens before the span: 0..max_prefix−1
    steps: int = 1000
    batch: int = 32
    lr: float = 3e-3
    eval_every: int = 10
    # sequences: the first 90% train (drawn with replacement), the rest the Trainer's val loss
    n_train: int = 4000
    n_eval: int = 200  # held-out sequences for the loss and ICL score

    def data(self, n: int, seed: int) -> torch.Tensor:
        """n training or evaluation sequences (n, n_ctx + 1) of this setup's repeated spans."""
        return repeated_spans(
            n,
            self.n_ctx + 1,
            self.d_vocab,
            seed=seed,
            min_span=self.min_span,
            max_span=self.max_span,
            max_prefix=self.max_prefix,
        )


FULL = InductionSetup()
QUICK = InductionSetup(steps=600, eval_every=50, n_eval=128)


def icl_positions(n_ctx: int) -> tuple[int, int]:
    """Olsson et al.'s tokens 50 and 500 of a 512-token context, scaled to n_ctx."""
    return round(50 / 512 * n_ctx), min(n_ctx - 1, round(500 / 512 * n_ctx))


def example_text(setup: InductionSetup, seed: int) -> str:
    """One held-out sequence of repeated spans, written in the tokenizer's characters."""
    return token_tokenizer(setup.d_vocab).decode(
        setup.data(1, seed=seed)[0, : setup.n_ctx].tolist()
    )


def train_with_snapshots(
    setup: InductionSetup,
    n_layers: int,
    data,
    eval_data,
    seed: int,
    out: Path,
    progress: bool = False,
):
    """Train one model with the Trainer into the run directory `out` (`common.train_run`), a float16
    snapshot and a train/val loss (the explorer's loss curve) every eval_every steps, and measure
    the model at every snapshot step on its float32 weights as they are then. Returns (model,
    snapshots).

    Measured on the float16 snapshot files instead, the numbers moved in their 4th-5th digit (full
    run, seed
    0: up to 3e-4 in an ICL score, 7e-5 in an induction score; 12 of the table's 808 cells changed
    in the third decimal; the phase change's steps and the best heads did not), so the files serve
    the explorer's slider and the table is the float32 model's."""
    early, late = icl_positions(setup.n_ctx)
    snapshots: list[dict] = []

    def measure(step: int, model) -> None:
        # training goes on untouched
        snap = copy.deepcopy(model, memo={id(model.tokenizer): model.tokenizer}).eval()
        loss = per_token_loss(snap, eval_data)
        scores = head_scores(snap, seed=seed)
        prev, ind = scores.scores["previous_token"], scores.scores["induction"]
        snapshots.append(
            {
                "step": step,
                "tokens": step * setup.batch * setup.n_ctx,
                "loss": float(loss.mean()),
                "icl_score": float(loss[late] - loss[early]),
                "best_previous_token": float(prev.max()),
                "best_previous_token_head": _argmax_head(prev),
                "best_induction": float(ind.max()),
                "best_induction_head": _argmax_head(ind),
            }
        )

    model = train_run(
        data,
        setup.d_vocab,
        out,
        steps=setup.steps,
        batch=setup.batch,
        lr=setup.lr,
        seed=seed,
        progress=progress,
        n_layer=n_layers,
        n_head=setup.n_heads,
        n_embd=setup.d_model,
        pos="learned",
        attn_only=True,
        # tied, the induction circuit did not form in 600 steps (module docstring)
        tie_embeddings=False,
        snapshots=setup.steps // setup.eval_every + 1,
        eval_interval=setup.eval_every,
        on_snapshot=measure,
    )
    return model, snapshots


def _argmax_head(scores: torch.Tensor) -> list[int]:
    index = int(scores.argmax())
    return [index // scores.shape[1], index % scores.shape[1]]


def locate_phase_change(two: list[dict], one: list[dict]) -> dict:
    """Where, between snapshots, the 2L model's induction score rises most, its ICL score falls
    most, and its loss gap to 1L falls most."""

    def steepest(values: list[float], sign: float) -> int:
        diffs = [sign * (b - a) for a, b in zip(values, values[1:])]
        # index of the snapshot that ends the interval
        return max(range(len(diffs)), key=diffs.__getitem__) + 1

    gap = [a["loss"] - b["loss"] for a, b in zip(two, one)]
    at = {
        "induction_rise": steepest([s["best_induction"] for s in two], +1),
        "icl_fall": steepest([s["icl_score"] for s in two], -1),
        "loss_gap_fall": steepest(gap, -1),
    }
    spread = max(at.values()) - min(at.values())
    return {
        "tokens": {k: two[i]["tokens"] for k, i in at.items()},
        "steps": {k: two[i]["step"] for k, i in at.items()},
        "spread_snapshots": spread,
        "coincide": spread <= 1,
        "loss_gap_before": gap[max(0, at["induction_rise"] - 1)],
        "loss_gap_after": gap[at["induction_rise"]],
    }


def run(out: Path, *, seed: int = 0, quick: bool = False, progress: bool = True) -> dict:
    with threads(1):
        return _run(out, seed=seed, quick=quick, progress=progress)


def _run(out: Path, *, seed: int, quick: bool, progress: bool) -> dict:
    setup = QUICK if quick else FULL
    data = setup.data(setup.n_train, seed=seed + 1)
    eval_data = setup.data(setup.n_eval, seed=seed + 10_000)
    models, runs = {}, {}
    for n_layers in (1, 2):
        name = f"{n_layers}L"
        if progress:
            print(f"training the {name} model", file=sys.stderr)
        models[name], runs[name] = train_with_snapshots(
            setup, n_layers, data, eval_data, seed, out / f"induction-{name}", progress=progress
        )
    phase = locate_phase_change(runs["2L"], runs["1L"])
    result = {
        "experiment": "induction",
        "quick": quick,
        "seed": seed,
        "setup": asdict(setup),
        "data": f"repeated_spans: a span of {setup.min_span}-{setup.max_span} distinct random "
        "tokens repeated to the end",
        "training": "attnlab.training.Trainer (the runs are in induction-1L/ and induction-2L/, "
        "with their snapshots)",
        "icl_positions": icl_positions(setup.n_ctx),
        "snapshots": runs,
        "final": {name: snaps[-1] for name, snaps in runs.items()},
        "phase_change_2L": phase,
        # a held-out text for the explorer (one character per token)
        "example_text": example_text(setup, seed + 20_000),
    }
    write_outputs(out, "induction", result, plot)
    result["models"] = models
    return result


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(1, 4, (17, 3.8))
    panels = (
        ("best_previous_token", "best previous-token score"),
        ("best_induction", "best induction score"),
        ("icl_score", "in-context-learning score"),
        ("loss", "loss"),
    )
    phase_tokens = result["phase_change_2L"]["tokens"]["induction_rise"]
    for ax, (key, title) in zip(axes[0], panels):
        for name, style in (("1L", "s--"), ("2L", "o-")):
            snaps = result["snapshots"][name]
            ax.plot(
                [s["tokens"] for s in snaps],
                [s[key] for s in snaps],
                style,
                ms=3,
                label=f"{name} attention-only",
            )
        ax.axvline(phase_tokens, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("training tokens")
        ax.set_title(title)
        ax.legend(fontsize=8)
    early, late = result["icl_positions"]
    fig.suptitle(
        f"One- vs two-layer attention-only models (ICL = loss@{late} − loss@{early}; dotted: 2L's "
        "steepest induction-score rise)"
    )
    save_figure(fig, path)


def table(result: dict) -> str:
    one, two = result["snapshots"]["1L"], result["snapshots"]["2L"]
    rows = [
        [
            a["step"],
            a["tokens"],
            a["loss"],
            b["loss"],
            a["icl_score"],
            b["icl_score"],
            a["best_previous_token"],
            b["best_previous_token"],
            a["best_induction"],
            b["best_induction"],
        ]
        for a, b in zip(one, two)
    ]
    text = format_table(
        [
            "step",
            "tokens",
            "loss 1L",
            "loss 2L",
            "ICL 1L",
            "ICL 2L",
            "prev 1L",
            "prev 2L",
            "ind 1L",
            "ind 2L",
        ],
        rows,
    )
    phase = result["phase_change_2L"]
    text += (
        "\n2L phase change (steepest interval ends at step): induction rise "
        f"{phase['steps']['induction_rise']}, "
        f"ICL fall {phase['steps']['icl_fall']}, loss-gap fall {phase['steps']['loss_gap_fall']} "
        "-> "
        f"{'coincide' if phase['coincide'] else 'do not coincide'} (spread "
        f"{phase['spread_snapshots']} snapshots)"
    )
    return text
