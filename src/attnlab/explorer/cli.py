"""`attnlab explore` (the local web explorer) and `attnlab export-html` (its views in one HTML
file): their flags, checked and passed on by name; and `attnlab experiment induction --explore`.

Design choices:
- Each command is a function with named parameters (`explore`, which the demo calls too), and
  `run_*` only turns the parsed flags into its arguments: a command never builds another's
  arguments by hand.
- `sources` are the strings the user names (whatever `attnlab.load` accepts; with --revisions, a
  Hub model's training-step revisions become the step slider, as a run's snapshots do); `models`
  are the models loaded from them, by name (loading.py). server.py binds and serves, export.py
  writes the page.
- `experiment induction --explore` opens the explorer on the experiment's two runs: the explorer
  adds that flag to inspection's `experiment` command (added before this module's commands), so
  inspection, which sits below the explorer, never imports it.
- FastAPI, uvicorn and torch-heavy modules are imported inside the commands, not when the CLI
  starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..env import explorer_port
from ..errors import UserError
from . import MAX_TOKENS, QUEUE, VIEWS


def run_explore(args: argparse.Namespace) -> int:
    return explore(
        args.sources,
        host=args.host,
        port=args.port,
        revision=args.revision,
        revisions=args.revisions,
        max_tokens=args.max_tokens,
        queue=args.queue,
    )


def explore(
    sources: list[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    revision: str | None = None,
    revisions: str | None = None,
    max_tokens: int | None = None,
    queue: int = QUEUE,
    also: tuple[str, ...] = (),
) -> int:
    """`attnlab explore SOURCES ...`, its flags as named parameters (the demo opens the explorer
    through this, never by building the command's arguments by hand): checks them, loads the
    models (the newest run and minilm when `sources` is empty) and serves until Ctrl-C. `revisions`
    is the flag's text ("step1000,step2000" or "all"); port None: ATTNLAB_PORT or 8000. `also`:
    sources served beside them when they load (the demo's SmolLM2), each a note when one does
    not."""
    from .loading import default_models, load_models, load_served, model_name
    from .server import serve

    port = explorer_port(port)
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {port}")
    if revision is not None and not sources:
        raise UserError(
            "--revision picks a version of the Hub models given; name one "
            "(attnlab explore gpt2 --revision main)"
        )
    if queue < 1:
        raise UserError(f"--queue must be at least 1, got {queue}")
    steps = None if revisions is None else [r.strip() for r in revisions.split(",") if r.strip()]
    if steps is not None and not sources:
        raise UserError(
            "--revisions picks training steps of the Hub models given; name one "
            "(attnlab explore EleutherAI/pythia-70m --revisions all)"
        )
    if steps is not None and (revision is not None or not steps):
        both = "; --revision picks one version: give one of the two" if revision is not None else ""
        raise UserError("--revisions lists the steps to load (step1000,step2000 or all)" + both)
    models, runs = load_models(sources, revision, steps) if sources else default_models()
    for source in also:
        try:
            model = load_served(source)
        except UserError as exc:
            print(f"attnlab explore: note: {source} is not served ({exc})", flush=True)
        else:
            models[model_name(source)] = model
    return serve(models, host, port, max_tokens, runs, queue=queue)


def run_export(args: argparse.Namespace) -> int:
    from .export import write_html
    from .loading import load_served, model_name

    # checked first: the export takes a while, and the rename would fail at the end
    if Path(args.output).is_dir():
        raise UserError(
            f"-o {args.output} is a directory; name the HTML file to write, e.g. -o "
            f"{Path(args.output) / 'view.html'}"
        )
    ablate = parse_heads(args.ablate) if args.ablate else ()
    model = load_served(args.model, args.revision)
    path = write_html(
        model,
        args.text,
        args.output,
        name=model_name(args.model),
        view=args.view,
        ablate=ablate,
        ablation=args.ablation,
    )
    print(
        f"wrote {args.output} ({path.stat().st_size / 1e6:.1f} MB): open it in a browser, "
        "no server needed"
    )
    return 0


def parse_heads(spec: str) -> list[tuple[int, int]]:
    """--ablate "1.2,1.0" -> [(1, 2), (1, 0)]: LAYER.HEAD pairs, comma-separated (range and
    duplicates are checked against the model by the explorer, as for a request)."""
    heads = []
    for item in spec.split(","):
        layer, dot, head = item.strip().partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            raise UserError(
                f"--ablate {item.strip()!r}: give heads as LAYER.HEAD, comma-separated (--ablate "
                "1.2,1.0 knocks out heads 2 and 0 of layer 1)"
            )
        heads.append((int(layer), int(head)))
    return heads


def run_experiment_and_explore(args: argparse.Namespace) -> int:
    """`attnlab experiment NAME`, then with --explore the explorer on its models."""
    from ..inspection.cli import experiment, run_experiment

    if not args.explore:
        return run_experiment(args)
    if args.name != "induction":
        raise UserError(
            f"--explore opens the explorer on the induction experiment's models; {args.name} has "
            "none to explore"
        )
    result, out = experiment(args)
    return explore_induction(result, out, args.port)


def explore_induction(result: dict, out: Path, port: int | None) -> int:
    """Serve the two models in the explorer, both runs' step sliders opened on the 2L model's phase
    change (the 1L model at the same step, for comparison: it never grows an induction head)."""
    from ..training.snapshots import list_snapshots
    from .models import Run
    from .server import serve

    start = result["phase_change_2L"]["steps"]["induction_rise"]
    runs = {
        name: Run(
            out / name, list_snapshots(out / name), start_step=start, example=result["example_text"]
        )
        for name in ("induction-2L", "induction-1L")
    }
    print(
        f"opening the explorer on induction-2L at step {start}, where its induction score rises "
        "most"
    )
    models = {"induction-2L": result["models"]["2L"], "induction-1L": result["models"]["1L"]}
    return serve(models, "127.0.0.1", explorer_port(port), max_tokens=2048, runs=runs)


def add_commands(sub: argparse._SubParsersAction) -> None:
    add_explore_command(sub)
    add_export_command(sub)
    add_explore_flags(sub.choices["experiment"])


def add_explore_command(sub: argparse._SubParsersAction) -> None:
    from ..formats.cli import add_revision_flag

    p = sub.add_parser(
        "explore",
        help="the local web explorer: attention on real models, in the browser",
        description="Serve the explorer's eight views (soft dictionary, attention matrix, heads, "
        "through a block, next token, generate, atlas, a mixture of experts' router) for the "
        "given models.",
    )
    p.add_argument(
        "sources",
        nargs="*",
        metavar="MODEL",
        help="model directories (attnlab or Hugging Face format), bundled names (minilm) or "
        "Hugging Face Hub names (gpt2, EleutherAI/pythia-70m); default: the newest run under "
        "./runs and minilm",
    )
    add_revision_flag(p, "the MODELs")
    p.add_argument(
        "--revisions",
        default=None,
        metavar="STEPS",
        help="training-step revisions of Hub MODELs for the step slider: step1000,step2000,... or "
        "'all' (every stepN branch, as Pythia publishes them); each is fetched when the slider "
        "first reaches it",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; "
        "any other address requires the token printed with the URL)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="port to listen on (default 8000, or $ATTNLAB_PORT; 0 picks a free one)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="longest text the explorer accepts, in tokens (default: the model's context length, "
        f"at least {MAX_TOKENS}: 8192 for smollm2)",
    )
    p.add_argument(
        "--queue",
        type=int,
        default=QUEUE,
        metavar="N",
        help=f"requests computed or waiting at once; more get 503 and retry (default {QUEUE})",
    )
    p.set_defaults(func=run_explore)


def add_export_command(sub: argparse._SubParsersAction) -> None:
    from ..formats.cli import MODEL_HELP, add_revision_flag

    e = sub.add_parser(
        "export-html",
        help="the explorer's views on one text, as one self-contained HTML file",
        description="Precompute the explorer's views of MODEL on TEXT and write them as one HTML "
        "file that opens in any browser with no server and no network.",
    )
    e.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    add_revision_flag(e)
    e.add_argument("--text", required=True, help="the text to show (at most 128 tokens)")
    e.add_argument(
        "-o", "--output", required=True, metavar="FILE.html", help="where to write the page"
    )
    e.add_argument(
        "--view", choices=VIEWS, default="dict", help="the tab the page opens on (default dict)"
    )
    e.add_argument(
        "--ablate",
        default=None,
        metavar="L.H,...",
        help="heads to show knocked out, as LAYER.HEAD pairs (1.2,1.0): every view is then the "
        "ablated model's, with the per-token loss strip and the next token before and after",
    )
    e.add_argument(
        "--ablation",
        choices=("zero", "mean"),
        default="zero",
        help="knock a head out by zeroing its output, or by its mean over the text (default zero)",
    )
    e.set_defaults(func=run_export)


def add_explore_flags(experiment: argparse.ArgumentParser) -> None:
    """--explore and --port on inspection's `experiment` command (attnlab.cli adds inspection's
    commands before the explorer's)."""
    experiment.add_argument(
        "--explore",
        action="store_true",
        help="induction only: then open the explorer on the two-layer model, "
        "its training step slider at the phase change",
    )
    experiment.add_argument(
        "--port",
        type=int,
        default=None,
        help="with --explore: the explorer's port (default 8000, or $ATTNLAB_PORT)",
    )
    experiment.set_defaults(func=run_experiment_and_explore)
