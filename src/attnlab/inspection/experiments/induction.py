"""`attnlab experiment induction`: the induction-head phase change of Olsson et al. 2022, on a CPU.

What is trained: one-layer and two-layer attention-only Transformers (ModelConfig attn_only=True, learned
positions, untied embeddings), same width, heads, data, seed and steps, on `common.repeated_spans`: a span
of distinct random tokens, of a length that varies per sequence (8-24), repeated to the end. Past the
first copy every token is predictable, but only by looking back for "what came after this token last
time" (induction); a fixed look-back offset cannot work because the span length varies.

Why these settings (measured, 2L model, 600 steps of batch 32, lr 3e-3, d_model 64, 4 heads, n_ctx 48):
- untied embeddings: with W_U = W_Eᵀ (the library's default) the best induction score stayed below 0.2
  for 600 steps, with vocabularies of 128 and 256, learned positions or RoPE, 2 or 4 heads, d_model
  64 or 128, lr up to 1e-2 (and with a vocabulary of 64 it began only near step 3800 of 4000); untied,
  it jumps from about 0.1 to 0.9 between steps 175 and 275. Elhage et al.'s and Olsson et al.'s small
  attention-only models have separate W_E and W_U too.
- a vocabulary of 128 and spans of 8-24: a larger vocabulary than the span, so the earlier occurrence of
  a token is unambiguous; the 4-20 spans with a random prefix left the 2L model at 0.18 by step 600.
- no random prefix before the span (max_prefix=1): a prefix of 0-7 tokens delayed the phase change past
  step 600 (seeds 0 and 1; best induction score 0.09 at step 600). Without it the phase change comes at
  step 200-250 for seeds 0, 1 and 2, and the full run's 1000 steps, snapshot every 10, resolve it.

What is measured at every snapshot (weights are kept in memory at each one):
- loss: mean next-token loss on held-out sequences;
- in-context-learning (ICL) score: loss at a late token minus loss at an early one, Olsson et al.'s
  token 500 minus token 50 of 512, scaled to the context length (negative = later tokens are easier);
- best previous-token and best induction score over all heads (attnlab.inspection.scores, on repeated
  random tokens).
The phase change is located, for the two-layer model, as the snapshot interval where each of three curves
moves most: the induction score rises most, the ICL score falls most, and the loss gap to the one-layer
model (2L loss − 1L loss) falls most, i.e. the bump in the loss curve that only the two-layer model has.
The experiment reports those three places and whether they coincide; it asserts nothing.

For the explorer (`attnlab experiment induction --explore`), each model is saved with a character tokenizer
that names its 128 token ids by 128 distinct letters, digits and symbols (`induction_tokenizer`), and the
two-layer model's snapshots go beside it as a training run (float16 weights in induction-2L/snapshots,
their losses in metrics.jsonl), so the step slider scrubs through its phase change.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...config import ModelConfig
from ...model import Transformer
from ..scores import head_scores
from .common import format_table, new_figure, per_token_loss, repeated_spans, save_figure, threads, train, write_outputs


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
    n_train: int = 4000  # training sequences (sampled with replacement each step)
    n_eval: int = 200  # held-out sequences for the loss and ICL score

    def data(self, n: int, seed: int) -> torch.Tensor:
        """n training or evaluation sequences (n, n_ctx + 1) of this setup's repeated spans."""
        return repeated_spans(n, self.n_ctx + 1, self.d_vocab, seed=seed, min_span=self.min_span,
                              max_span=self.max_span, max_prefix=self.max_prefix)


FULL = InductionSetup()
QUICK = InductionSetup(steps=600, eval_every=50, n_eval=128)


def model_config(setup: InductionSetup, n_layers: int) -> ModelConfig:
    return ModelConfig(
        d_vocab=setup.d_vocab, n_ctx=setup.n_ctx, d_model=setup.d_model, n_layers=n_layers,
        n_heads=setup.n_heads, attn_only=True, positional="learned",
        tie_embeddings=False,  # tied, the induction circuit did not form in 600 steps (module docstring)
    )


def icl_positions(n_ctx: int) -> tuple[int, int]:
    """Olsson et al.'s tokens 50 and 500 of a 512-token context, scaled to n_ctx."""
    return round(50 / 512 * n_ctx), min(n_ctx - 1, round(500 / 512 * n_ctx))


# one printable character per token id (no spaces: every character is one token, in sorted order)
ALPHABET = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789αβγδεζηθικλμνξοπρστυφχψω"
            "ΓΔΘΛΞΠΣΦΨΩбгдёжзийлпфцчшщъыьэюя!#$%&*+<=>?")


def induction_tokenizer(d_vocab: int):
    """A character tokenizer whose ids 0..d_vocab-1 are d_vocab distinct printable characters."""
    from ...tokenizer import Tokenizer

    assert len(set(ALPHABET)) == len(ALPHABET) >= d_vocab
    return Tokenizer.train_char("".join(sorted(ALPHABET)[:d_vocab]))


def example_text(setup: InductionSetup, seed: int) -> str:
    """One held-out sequence of repeated spans, written in the tokenizer's characters."""
    return induction_tokenizer(setup.d_vocab).decode(setup.data(1, seed=seed)[0, : setup.n_ctx].tolist())


def save_run(model, snapshots: list[dict], path: Path) -> None:
    """The model and its snapshots as a training run the explorer reads: weights, snapshots, metrics.jsonl."""
    import json

    from ...formats.native import atomic_write_text, save_native
    from ...training.snapshots import save_snapshot

    save_native(model, path)
    final = copy.deepcopy(model.state_dict())
    for snap in snapshots:
        model.load_state_dict(snap["state_dict"])
        save_snapshot(model, path, snap["step"])
    model.load_state_dict(final)
    atomic_write_text(path / "metrics.jsonl", "".join(json.dumps({"iter": s["step"], "train_loss": s["loss"], "val_loss": s["loss"]}) + "\n"
                                                      for s in snapshots))


def train_with_snapshots(setup: InductionSetup, n_layers: int, data, eval_data, seed: int, progress: str | None = None):
    """Train one model; return (model, snapshots) where each snapshot has the measurements and the weights."""
    torch.manual_seed(seed)
    model = Transformer(model_config(setup, n_layers))
    early, late = icl_positions(setup.n_ctx)
    snapshots: list[dict] = []

    def snapshot(step: int, tokens: int) -> None:
        loss = per_token_loss(model, eval_data)
        scores = head_scores(model, seed=seed)
        prev, ind = scores.scores["previous_token"], scores.scores["induction"]
        snapshots.append({
            "step": step,
            "tokens": tokens,
            "loss": float(loss.mean()),
            "icl_score": float(loss[late] - loss[early]),
            "best_previous_token": float(prev.max()),
            "best_previous_token_head": _argmax_head(prev),
            "best_induction": float(ind.max()),
            "best_induction_head": _argmax_head(ind),
            "state_dict": copy.deepcopy(model.state_dict()),
        })

    train(model, data, steps=setup.steps, batch=setup.batch, lr=setup.lr, seed=seed, eval_every=setup.eval_every,
          on_eval=snapshot, progress=progress)
    return model, snapshots


def _argmax_head(scores: torch.Tensor) -> list[int]:
    index = int(scores.argmax())
    return [index // scores.shape[1], index % scores.shape[1]]


def locate_phase_change(two: list[dict], one: list[dict]) -> dict:
    """Where, between snapshots, the 2L model's induction score rises most, its ICL score falls most, and its loss gap to 1L falls most."""
    def steepest(values: list[float], sign: float) -> int:
        diffs = [sign * (b - a) for a, b in zip(values, values[1:])]
        return max(range(len(diffs)), key=diffs.__getitem__) + 1  # index of the snapshot that ends the interval

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
        models[name], runs[name] = train_with_snapshots(
            setup, n_layers, data, eval_data, seed, progress=f"induction {name}" if progress else None
        )
    phase = locate_phase_change(runs["2L"], runs["1L"])
    final = {name: {k: v for k, v in snaps[-1].items() if k != "state_dict"} for name, snaps in runs.items()}
    result = {
        "experiment": "induction",
        "quick": quick,
        "seed": seed,
        "setup": asdict(setup),
        "data": f"repeated_spans: a span of {setup.min_span}-{setup.max_span} distinct random tokens repeated to the end",
        "icl_positions": icl_positions(setup.n_ctx),
        "snapshots": {name: [{k: v for k, v in s.items() if k != "state_dict"} for s in snaps] for name, snaps in runs.items()},
        "final": final,
        "phase_change_2L": phase,
        "example_text": example_text(setup, seed + 20_000),  # a held-out text for the explorer (one character per token)
    }
    write_outputs(out, "induction", result, plot)
    from ...formats.native import save_native

    for name, model in models.items():  # the trained models, for `attnlab heads`, the ablation test and the explorer
        model.tokenizer = induction_tokenizer(setup.d_vocab)
        if name == "2L":
            save_run(model, runs[name], out / f"induction-{name}")
        else:
            save_native(model, out / f"induction-{name}")
    result["models"] = models
    result["snapshot_weights"] = {name: [s["state_dict"] for s in snaps] for name, snaps in runs.items()}
    return result


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(1, 4, (17, 3.8))
    panels = (("best_previous_token", "best previous-token score"), ("best_induction", "best induction score"),
              ("icl_score", "in-context-learning score"), ("loss", "loss"))
    phase_tokens = result["phase_change_2L"]["tokens"]["induction_rise"]
    for ax, (key, title) in zip(axes[0], panels):
        for name, style in (("1L", "s--"), ("2L", "o-")):
            snaps = result["snapshots"][name]
            ax.plot([s["tokens"] for s in snaps], [s[key] for s in snaps], style, ms=3, label=f"{name} attention-only")
        ax.axvline(phase_tokens, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("training tokens")
        ax.set_title(title)
        ax.legend(fontsize=8)
    early, late = result["icl_positions"]
    fig.suptitle(f"One- vs two-layer attention-only models (ICL = loss@{late} − loss@{early}; dotted: 2L's steepest induction-score rise)")
    save_figure(fig, path)


def table(result: dict) -> str:
    one, two = result["snapshots"]["1L"], result["snapshots"]["2L"]
    rows = [[a["step"], a["tokens"], a["loss"], b["loss"], a["icl_score"], b["icl_score"], a["best_previous_token"],
             b["best_previous_token"], a["best_induction"], b["best_induction"]] for a, b in zip(one, two)]
    text = format_table(["step", "tokens", "loss 1L", "loss 2L", "ICL 1L", "ICL 2L", "prev 1L", "prev 2L", "ind 1L", "ind 2L"], rows)
    phase = result["phase_change_2L"]
    text += (
        f"\n2L phase change (steepest interval ends at step): induction rise {phase['steps']['induction_rise']}, "
        f"ICL fall {phase['steps']['icl_fall']}, loss-gap fall {phase['steps']['loss_gap_fall']} -> "
        f"{'coincide' if phase['coincide'] else 'do not coincide'} (spread {phase['spread_snapshots']} snapshots)"
    )
    return text
