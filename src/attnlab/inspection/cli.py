"""`attnlab heads`, `experiment`, `attribute` and `patch`: head scores, the chapters' claims as
experiments, direct logit attribution and activation patching.

Design choices:
- `heads MODEL` takes whatever `attnlab.load` takes (a native or Hugging Face directory, or
  "minilm"), prints one layer × head table per score with standout heads starred, and can write the
  scores as JSON and a grid of heat maps as PNG.
- `experiment NAME` runs one experiment module (attnlab.inspection.experiments.NAME), which writes
  NAME.json and NAME.png into --out and returns its result; this file prints the module's table.
  Its --explore (open the explorer on the induction runs) is the explorer's: explorer/cli.py adds
  the flag, since inspection sits below the explorer and never imports it.
- `attribute MODEL --prompt P --answer A [--wrong W]` prints every head's and MLP's direct logit
  attribution, largest first, and writes a PNG; `patch MODEL --clean C --corrupted X --answer A
  --wrong W` writes the patching heat maps (attnlab.inspection.attribution holds the work).
- matplotlib and the experiment modules are imported inside the commands, not at import time.
"""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path

from ..errors import UserError

EXPERIMENTS = ("induction", "scaling", "extrapolation", "coreference")
DEFAULT_MODEL = "minilm"  # coreference's model: the bundled pretrained encoder


def run_heads(args: argparse.Namespace) -> int:
    from ..formats import load
    from .experiments.common import write_json
    from .scores import STANDOUT, head_scores

    model = load(args.model, revision=args.revision)
    scores = head_scores(model, n_repeats=args.repeats, batch=args.batch, seed=args.seed)
    print(
        f"head scores of {args.model} ({scores.notes['input']}); * = at least the standout "
        "threshold"
    )
    for name, values in scores.scores.items():
        print(f"\n{name} (standout >= {STANDOUT[name]})")
        print(score_table(values, STANDOUT[name]))
        if name in scores.notes:
            print(f"  {scores.notes[name]}")
    if args.json:
        write_json(Path(args.json), {"model": str(args.model), **scores.to_dict()})
        print(f"\nwrote {args.json}")
    if args.png:
        plot_scores(scores, Path(args.png), title=str(args.model))
        print(f"wrote {args.png}")
    return 0


def score_table(values, threshold: float) -> str:
    """Layers as rows, heads as columns; a star after each standout score."""
    n_layers, n_heads = values.shape
    lines = ["layer " + "".join(f"{f'H{h}':>7}" for h in range(n_heads))]
    for layer in range(n_layers):
        cells = []
        for h in range(n_heads):
            v = float(values[layer, h])
            cells.append(
                f"{'n/a':>7}" if math.isnan(v) else f"{v:6.2f}{'*' if v >= threshold else ' '}"
            )
        lines.append(f"{f'L{layer}':>5} " + "".join(cells))
    return "\n".join(lines)


def plot_scores(scores, path: Path, title: str = "") -> None:
    """One heat map per score (layer × head), standout heads outlined."""
    from matplotlib.patches import Rectangle

    from .experiments.common import new_figure, save_figure
    from .scores import STANDOUT

    names = list(scores.scores)
    n_layers, n_heads = scores.scores[names[0]].shape
    fig, axes = new_figure(
        1, len(names), (len(names) * (1.0 + 0.3 * n_heads), 1.2 + 0.3 * n_layers)
    )
    for ax, name in zip(axes[0], names):
        values = scores.scores[name]
        low = -1.0 if name == "copying" else 0.0
        image = ax.imshow(
            values.nan_to_num(low).numpy(), vmin=low, vmax=1.0, cmap="viridis", aspect="auto"
        )
        for layer, head, _ in scores.standout(name):
            ax.add_patch(
                Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.5)
            )
        ax.set_title(f"{name}\n(red: >= {STANDOUT[name]})", fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"head scores {title}", fontsize=10)
    save_figure(fig, path)


def run_experiment(args: argparse.Namespace) -> int:
    experiment(args)
    return 0


def experiment(args: argparse.Namespace) -> tuple[dict, Path]:
    """`attnlab experiment NAME`: runs it, prints its table; (its result, the output directory)."""
    from .experiments.common import make_out_dir

    module = importlib.import_module(f"attnlab.inspection.experiments.{args.name}")
    out = Path(args.out)
    make_out_dir(out)  # before a run of minutes, not after it
    kwargs = {"seed": args.seed, "quick": args.quick}
    if args.name == "coreference":
        kwargs.update(model_name=args.model, revision=args.revision)
    elif args.revision is not None or args.model != DEFAULT_MODEL:
        raise UserError(
            f"--model and --revision choose the model of the coreference experiment; {args.name} "
            "trains its own models, so drop them"
        )
    result = module.run(out, **kwargs)
    print(f"experiment {args.name}{' (quick)' if args.quick else ''}, seed {args.seed}")
    print(module.table(result))
    print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.png')}")
    return result, out


def run_attribute(args: argparse.Namespace) -> int:
    from ..formats import load
    from .attribution import direct_logit_attribution
    from .experiments.common import write_json

    model = load(args.model)
    result = direct_logit_attribution(model, args.prompt, args.answer, args.wrong)
    target = repr(args.answer) + (f" - {args.wrong!r}" if args.wrong is not None else "")
    print(f"direct logit attribution to {target} at the last token of {result.prompt_tokens}")
    print(
        f"logit{' difference' if args.wrong is not None else ''}: {result.logit:.4f} = sum of the "
        "terms "
        f"{result.total() - result.constant:.4f} + final-norm/unembedding bias "
        f"{result.constant:.4f}"
    )
    ranked = result.ranked()
    print(f"{'term':>12} {'attribution':>12}")
    for name, value in ranked[: args.top]:
        print(f"{name:>12} {value:12.4f}")
    if len(ranked) > args.top:
        print(f"... {len(ranked) - args.top} more (--top N)")
    png = Path(args.png)
    result.plot(png, title=None)
    print(f"wrote {png}")
    if args.json:
        write_json(Path(args.json), result.to_dict())
        print(f"wrote {args.json}")
    return 0


def run_patch(args: argparse.Namespace) -> int:
    import torch

    from ..formats import load
    from .attribution import parse_sweeps, patch_sweeps

    sweeps = parse_sweeps(args.sweeps)  # before loading: a typo costs nothing
    model = load(args.model)
    out = Path(args.out)
    results = patch_sweeps(model, args.clean, args.corrupted, args.answer, args.wrong, sweeps, out)
    first = next(iter(results.values()))
    print(
        f"logit difference {args.answer!r} - {args.wrong!r}: clean {first.clean:.4f}, corrupted "
        f"{first.corrupted:.4f}"
    )
    for name, result in results.items():
        values = result.normalized()
        flat = values.nan_to_num(float("-inf")).flatten()
        best = flat.argsort(descending=True)[:5].tolist()
        cells = []
        for index in best:
            at = [int(i) for i in torch.unravel_index(torch.tensor(index), tuple(values.shape))]
            cells.append(
                ", ".join(f"{a}={result.labels[a][i]}" for a, i in zip(result.axis_names, at))
                + f": {float(flat[index]):.2f}"
            )
        path = result.notes.get("path", "reference")
        why = f": {result.notes['why']}" if "why" in result.notes else ""
        print(
            f"\n{name} ({' x '.join(result.axis_names)}, {path} path{why}), restored fraction, "
            "top 5:"
        )
        print("\n".join("  " + c for c in cells))
        print(f"wrote {out / f'patch-{name}.png'}")
    print(f"wrote {out / 'patching.json'}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from ..formats.cli import MODEL_HELP, add_revision_flag

    p = sub.add_parser(
        "heads",
        help="score every head (previous-token, induction, duplicate, first-token, local-window, "
        "copying)",
    )
    p.add_argument("model", help=MODEL_HELP)
    add_revision_flag(p)
    p.add_argument("--json", metavar="FILE", help="write the scores as JSON")
    p.add_argument("--png", metavar="FILE", help="draw a layer x head grid per score")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    p.add_argument(
        "--repeats", type=int, default=4, help="how often the random span repeats (default 4)"
    )
    p.add_argument("--batch", type=int, default=4, help="sequences of random tokens (default 4)")
    p.set_defaults(func=run_heads)

    p = sub.add_parser(
        "experiment", help="run an experiment: writes NAME.json and NAME.png, prints a table"
    )
    p.add_argument("name", choices=EXPERIMENTS)
    p.add_argument("--out", default="experiments", help="output directory (default ./experiments)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smaller version of the experiment (for tests and a first look)",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"coreference only: the model to inspect, {MODEL_HELP} (default {DEFAULT_MODEL})",
    )
    add_revision_flag(p, "--model")
    # the explorer adds --explore and --port (explorer/cli.py: it sits above inspection)
    p.set_defaults(func=run_experiment)

    p = sub.add_parser(
        "attribute", help="direct logit attribution of every head and MLP to an answer"
    )
    p.add_argument("model", help="model directory (attnlab or Hugging Face format)")
    p.add_argument("--prompt", required=True, help="the text whose next token is explained")
    p.add_argument(
        "--answer", required=True, help="the answer token, with its leading space if any: ' Paris'"
    )
    p.add_argument("--wrong", help="a wrong answer: attribute the logit difference answer - wrong")
    p.add_argument("--top", type=int, default=15, help="print this many terms (default 15)")
    p.add_argument(
        "--png", default="attribution.png", help="heat map file (default attribution.png)"
    )
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")
    p.set_defaults(func=run_attribute)

    p = sub.add_parser(
        "patch", help="activation patching heat maps of a clean and a corrupted prompt"
    )
    p.add_argument("model", help="model directory (attnlab or Hugging Face format)")
    p.add_argument("--clean", required=True, help="the prompt the model answers correctly")
    p.add_argument(
        "--corrupted",
        required=True,
        help="the same number of tokens, changed so the answer changes",
    )
    p.add_argument("--answer", required=True, help="the clean prompt's answer token")
    p.add_argument("--wrong", required=True, help="the corrupted prompt's answer token")
    p.add_argument(
        "--sweeps",
        default="block,heads",
        help="comma-separated: block, heads, heads-by-pos, head-outputs (default block,heads)",
    )
    p.add_argument("--out", default="patching", help="output directory (default ./patching)")
    p.set_defaults(func=run_patch)
