"""The worked example of docs/tutorials/induction-heads.md: find the induction heads of a
two-layer attention-only model by direct logit attribution and by head patching, and see the
K-composition that links them.

    attnlab experiment induction --out runs/induction          # trains the 1- and 2-layer models
    (under a minute)
    python docs/tutorials/induction_heads.py runs/induction/induction-2L \
        --out docs/tutorials/induction-heads

Writes dla.png, patching.png, composition.png and numbers.json into --out and prints the numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import attnlab
from attnlab.inspection import patching
from attnlab.inspection.experiments.common import new_figure, save_figure


def repeated_tokens(d_vocab: int, span: int, batch: int, seed: int) -> torch.Tensor:
    """[batch, 2 · span]: a span of distinct random tokens, then the same span again."""
    g = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(d_vocab, generator=g)[:span] for _ in range(batch)])
    return torch.cat([first, first], dim=1)


def heat_map(
    values: torch.Tensor,
    path: Path,
    title: str,
    xlabel: str = "head",
    ylabel: str = "layer",
    yticks: list[str] | None = None,
) -> None:
    fig, axes = new_figure(1, 1, (1.6 + 0.6 * values.shape[1], 1.4 + 0.55 * values.shape[0]))
    ax = axes[0][0]
    limit = float(values.abs().max()) or 1.0
    image = ax.imshow(values.numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    for (i, j), v in zip(
        torch.cartesian_prod(torch.arange(values.shape[0]), torch.arange(values.shape[1])).tolist(),
        values.flatten().tolist(),
    ):
        ax.text(
            j,
            i,
            f"{v:.2f}",
            ha="center",
            va="center",
            fontsize=8,
            color="white" if abs(v) > 0.6 * limit else "black",
        )
    ax.set_xticks(range(values.shape[1]))
    ax.set_yticks(range(values.shape[0]), yticks or [str(i) for i in range(values.shape[0])])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8)
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the two-layer model: runs/induction/induction-2L")
    parser.add_argument("--out", default="docs/tutorials/induction-heads")
    parser.add_argument("--span", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = attnlab.load(args.model)
    cfg = model.config
    L, H, S = cfg.n_layers, cfg.n_heads, args.span
    clean = repeated_tokens(cfg.d_vocab, S, args.batch, seed=0)
    numbers: dict = {"model": str(args.model), "span": S, "batch": args.batch}

    # 1. Direct logit attribution: each head's output, read through the frozen final norm, along the
    #    unembedding direction of the correct next token, at every position of the second copy.
    with torch.no_grad():
        logits, cache = model.run_with_cache(clean)
    # positions S .. 2S-2 predict tokens S+1 .. 2S-1, all known from the first copy
    second = (S, 2 * S - 1)
    heads = cache.stack_head_results(pos_slice=second)  # [L·H, batch, S-1, d_model]
    dla = cache.logit_attrs(heads, clean[:, S + 1 :], pos_slice=second).mean((1, 2)).view(L, H)
    rest, labels = cache.decompose_resid(pos_slice=second, return_labels=True)
    others = cache.logit_attrs(rest, clean[:, S + 1 :], pos_slice=second).mean((1, 2))
    numbers["dla_heads"] = dla.tolist()
    numbers["dla_other_terms"] = dict(zip(labels, others.tolist()))
    heat_map(
        dla,
        out / "dla.png",
        "direct logit attribution to the correct next token\n(second copy, mean)",
    )

    # 2. Head patching: the corrupted run has a different first copy, so the second copy has nothing
    #    to copy. Patch each head's output, query, key, value or pattern (all positions) from the
    #    clean run.
    corrupted = clean.clone()
    corrupted[:, :S] = repeated_tokens(cfg.d_vocab, S, args.batch, seed=1)[:, :S]
    targets = clean[:, S + 1 :]

    def correct_logprob(logits: torch.Tensor) -> torch.Tensor:
        logprobs = logits[:, S : 2 * S - 1].log_softmax(-1)
        return logprobs.gather(-1, targets[..., None]).mean()

    with torch.no_grad():
        clean_value = float(correct_logprob(logits))
    result = patching.get_act_patch_attn_head_all_pos_every(
        model, corrupted, cache, correct_logprob, clean_metric=clean_value, progress=True
    )
    result.plot(
        out / "patching.png",
        title="head patching, clean -> corrupted: restored fraction of the "
        "correct tokens' log-probability (second copy)",
    )
    numbers["patching"] = {
        "clean": result.clean,
        "corrupted": result.corrupted,
        "restored": dict(zip(result.labels["activation"], result.normalized().tolist())),
    }

    # 3. K-composition: how much each layer-0 head's output is read by each layer-1 head's keys.
    k_comp = model.all_composition_scores("K")[0, :, 1, :]  # [layer-0 head, layer-1 head]
    numbers["k_composition_L0_to_L1"] = k_comp.tolist()
    heat_map(
        k_comp,
        out / "composition.png",
        "K-composition: layer-0 head (row) -> layer-1 head (column)",
        xlabel="layer-1 head",
        ylabel="layer-0 head",
    )

    from attnlab.inspection.scores import head_scores

    scores = head_scores(model)
    numbers["previous_token_score"] = scores.scores["previous_token"].tolist()
    numbers["induction_score"] = scores.scores["induction"].tolist()
    (out / "numbers.json").write_text(json.dumps(numbers, indent=2) + "\n")
    print(json.dumps({k: v for k, v in numbers.items() if k != "patching"}, indent=1))
    print("patching, restored fraction:", json.dumps(numbers["patching"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
