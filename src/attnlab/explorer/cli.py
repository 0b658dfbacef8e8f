"""`attnlab explore` (the local web explorer) and `attnlab export-html` (its views in one HTML
file).

Design choices:
- Models come only from the command line: whatever `attnlab.load` accepts (directories, bundled
  names such as minilm, Hugging Face Hub names such as gpt2, with --revision; with --revisions, a
  Hub model's training-step revisions become the step slider, as a run's snapshots do). With none
  given, the newest run
  under ./runs (written by `attnlab train`) and the bundled MiniLM are served, whichever exist.
- The server binds 127.0.0.1 unless --host says otherwise. The socket is bound here, before uvicorn
  starts, so a port in use is one clear line (and exit 2) rather than a log of tracebacks. Requests
  for any other Host header are refused (DNS rebinding); see security.py.
- A --host beyond this machine (0.0.0.0, a LAN address) prints a warning and, as Jupyter does, makes
  a token that the printed URL carries: without it every API call is refused (403).
- FastAPI, uvicorn and torch-heavy modules are imported inside the commands, not when the CLI
  starts.
- Scripts and tests start the explorer with the two helpers after `serve`, on 127.0.0.1 and a free
  port:
  `serving(app)` in a thread of the caller (an app built in the same process),
  `explorer_process(ARGS)` as `attnlab explore ARGS` in a process of its own, as a user runs it (it
  reads the URL line `serve` prints).
"""

from __future__ import annotations

import argparse
import errno
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..env import explorer_port
from ..errors import UserError
from . import MAX_TOKENS, QUEUE, VIEWS

DEFAULT_MODEL = "minilm"  # the bundled pretrained encoder (attnlab.load's name for it)


def newest_run(root: Path = Path("runs")) -> Path | None:
    """The most recently written attnlab checkpoint directory under `root` (or one level deeper), if
    any."""
    from ..formats.native import is_native

    if not root.is_dir():
        return None
    found = [
        c.parent
        for pattern in ("*/config.json", "*/*/config.json")
        for c in root.glob(pattern)
        if is_native(c.parent)
    ]
    if not found:
        return None

    def written(run: Path) -> float:
        weights = run / "model.safetensors"
        return (weights if weights.exists() else run / "config.json").stat().st_mtime

    return max(found, key=written)


def load_models(
    specs: list[str],
    runs: dict | None = None,
    revision: str | None = None,
    revisions: list[str] | None = None,
) -> dict[str, object]:
    """name -> model for each MODEL argument; names are directory names (a Hub name's last part),
    made unique with a suffix; `revision` applies to every one (they must all be Hub names then).

    runs: when given, filled with name -> service.Run for each directory that holds training
    snapshots (`attnlab train --snapshots N`), which the page's step slider scrubs through.
    revisions: training-step revisions of Hub models (["step1000", "step2000"], or ["all"]: every
    stepN branch the Hub lists) for the same step slider; the model is served at the last of them,
    and the others are fetched when the slider first reaches them."""
    from ..workbench import load

    models: dict[str, object] = {}
    for spec in specs:
        steps = hub_steps(spec, revisions) if revisions else None
        # the page opens on the last step: that revision loads now, the others when the slider
        # reaches them
        model = load(spec, revision=steps[max(steps)] if steps else revision)
        if model.tokenizer is None:
            raise UserError(
                f"{spec}: has no tokenizer.json; the explorer needs one to turn text into tokens"
            )
        name = Path(spec).name or spec
        base, n = name, 2
        while name in models:
            name, n = f"{base}-{n}", n + 1
        models[name] = model
        if steps and runs is not None:
            from .models import Run

            runs[name] = Run(None, steps, repo_id=spec, served_step=max(steps))
        elif runs is not None and Path(spec).is_dir():
            from ..training.snapshots import list_snapshots
            from .models import Run

            snapshots = list_snapshots(spec)
            if snapshots:
                runs[name] = Run(Path(spec), snapshots)
    return models


def hub_steps(spec: str, revisions: list[str]) -> dict[int, str]:
    """step -> revision for `explore SPEC --revisions ...`: the names given (each stepN), or with
    "all" every training-step branch the Hub lists for SPEC."""
    from ..formats.hub import is_repo_id, local_path_reason, step_of, step_revisions

    if Path(spec).exists():
        raise UserError(
            f"{spec}: --revisions picks training-step revisions of a Hugging Face Hub model, and "
            "this is "
            "a local model; explore a training run's directory for its snapshots instead"
        )
    if not is_repo_id(spec):
        reason = local_path_reason(spec) or "it is not spelled as a Hub repository id (owner/name)"
        raise UserError(
            f"{spec}: --revisions picks training-step revisions of a Hugging Face Hub model, and "
            f"{spec} "
            f"does not exist here as a folder: {reason}"
        )
    if revisions == ["all"]:
        return step_revisions(spec)
    steps: dict[int, str] = {}
    for name in revisions:
        step = step_of(name)
        if step is None:
            raise UserError(
                f"--revisions {name!r}: the step slider takes training-step revisions named stepN "
                "(Pythia's: step1000,step2000), or 'all'"
            )
        if step in steps:
            raise UserError(f"--revisions lists step {step} twice; list each revision once")
        steps[step] = name
    return dict(sorted(steps.items()))


def default_models(runs: dict | None = None) -> dict[str, object]:
    """The newest run under ./runs and the bundled MiniLM, whichever are available."""
    from ..workbench import load

    run = newest_run()
    models = load_models([str(run)], runs) if run is not None else {}
    try:
        models[DEFAULT_MODEL] = load(DEFAULT_MODEL)
    except UserError as exc:
        print(f"attnlab explore: note: the bundled {DEFAULT_MODEL} is not available ({exc})")
    if not models:
        raise UserError(
            "no model to explore: pass a model directory (attnlab explore runs/NAME) or train one "
            "with `attnlab train`; the bundled minilm is not installed either (make venv installs "
            "it)"
        )
    return models


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or a UserError that says the port is taken and what to
    do."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(
            f"cannot resolve --host {host!r} ({exc.strerror}); use an address such as 127.0.0.1"
        ) from None
    family, _, proto, _, address = infos[0]
    # proto named (IPPROTO_TCP), not left 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets
    # that say they are TCP, and with Nagle on, every answer written in two parts (headers, body)
    # waited for the
    # client's delayed ACK: 40 ms added to each request, a refusal included (benchmarks/README.md)
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    # as uvicorn does: restart right after a stop
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is already in use (another explorer?); pass --port "
                f"{port + 1} "
                "or stop the program using it"
            ) from None
        raise UserError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pass another --host or --port"
        ) from None
    # listening already, so the URL works the moment it is printed: connections wait in the backlog
    # until uvicorn's loop accepts them
    sock.listen(2048)
    return sock


def url_of(host: str, port: int, token: str | None = None) -> str:
    url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
    return url + (f"?token={token}" if token else "")


def run_explore(args: argparse.Namespace) -> int:
    return explore(
        args.models,
        host=args.host,
        port=args.port,
        revision=args.revision,
        revisions=args.revisions,
        max_tokens=args.max_tokens,
        queue=args.queue,
    )


def explore(
    models: list[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    revision: str | None = None,
    revisions: str | None = None,
    max_tokens: int | None = None,
    queue: int = QUEUE,
    also: tuple[str, ...] = (),
) -> int:
    """`attnlab explore MODELS ...`, its flags as named parameters (the demo opens the explorer
    through this, never by building the command's arguments by hand): checks them, loads the
    models (the newest run and minilm when `models` is empty) and serves until Ctrl-C. `revisions`
    is the flag's text ("step1000,step2000" or "all"); port None: ATTNLAB_PORT or 8000. `also`:
    models served beside them when they load (the demo's SmolLM2), each a note when one does not."""
    port = explorer_port(port)
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {port}")
    if revision is not None and not models:
        raise UserError(
            "--revision picks a version of the Hub models given; name one "
            "(attnlab explore gpt2 --revision main)"
        )
    if queue < 1:
        raise UserError(f"--queue must be at least 1, got {queue}")
    steps = None if revisions is None else [r.strip() for r in revisions.split(",") if r.strip()]
    if steps is not None and not models:
        raise UserError(
            "--revisions picks training steps of the Hub models given; name one "
            "(attnlab explore EleutherAI/pythia-70m --revisions all)"
        )
    if steps is not None and (revision is not None or not steps):
        both = "; --revision picks one version: give one of the two" if revision is not None else ""
        raise UserError("--revisions lists the steps to load (step1000,step2000 or all)" + both)
    runs: dict = {}
    loaded = load_models(models, runs, revision, steps) if models else default_models(runs)
    for spec in also:
        try:
            loaded.update(load_models([spec]))
        except UserError as exc:
            print(f"attnlab explore: note: {spec} is not served ({exc})", flush=True)
    return serve(loaded, host, port, max_tokens, runs, queue=queue)


def serve(
    models: dict[str, object],
    host: str,
    port: int,
    max_tokens: int | None,
    runs: dict | None = None,
    queue: int = QUEUE,
) -> int:
    """Serve the explorer on host:port until Ctrl-C (`attnlab explore`, `attnlab experiment
    induction --explore`)."""
    import uvicorn

    from .app import create_app
    from .security import is_loopback, new_token

    token = None if is_loopback(host) else new_token()
    app = create_app(
        models, max_tokens=max_tokens, runs=runs, hosts=[host], token=token, queue=queue
    )
    sock = bind(host, port)
    port = sock.getsockname()[1]
    if token:
        print(
            f"attnlab explore: warning: listening on {host}: other machines on your network can "
            "reach it; "
            "every request needs the token in the URL below (keep it to yourself)"
        )
    print(
        f"attnlab explorer: {', '.join(models)} at {url_of(host, port, token)}  (Ctrl-C to stop)",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0


@contextmanager
def serving(app, start_timeout: float = 60) -> Iterator[str]:
    """uvicorn serving `app` (create_app's) in a thread of this process on 127.0.0.1 and a free
    port, for a
    script or a test: yields the page's URL once the server accepts, and stops the server on
    leaving."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the explorer's server did not start")
        time.sleep(0.05)
    try:
        yield url_of("127.0.0.1", sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# serve's
URL_LINE = re.compile(r"^attnlab explorer: .* at (http://127\.0\.0\.1:\d+/)  \(Ctrl-C to stop\)$")


@contextmanager
def explorer_process(*args: str, **popen) -> Iterator[tuple[subprocess.Popen, str]]:
    """`attnlab explore ARGS --port 0` in a process of its own (its memory and its event loop its
    own, as when a user runs it), for a script or a test; `popen` goes to subprocess.Popen (env,
    cwd). Yields the process and the URL it prints, once it prints it; stops the process on
    leaving."""
    process = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "explore", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    try:
        for line in process.stdout:  # a warning or a note may come first
            found = URL_LINE.match(line.rstrip("\n"))
            if found:
                break
        else:
            process.wait(timeout=30)
            raise RuntimeError(
                f"attnlab explore {' '.join(args)} did not start (exit {process.returncode}): "
                f"{process.stderr.read().strip()}"
            )
        yield process, found.group(1)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        process.stdout.close()
        process.stderr.close()


def run_export(args: argparse.Namespace) -> int:
    from ..files import atomic_write_text
    from .export import export_html

    # checked first: the export takes a while, and the rename would fail at the end
    if Path(args.output).is_dir():
        raise UserError(
            f"-o {args.output} is a directory; name the HTML file to write, e.g. -o "
            f"{Path(args.output) / 'view.html'}"
        )
    ablate = parse_heads(args.ablate) if args.ablate else ()
    models = load_models([args.model], revision=args.revision)
    name, model = next(iter(models.items()))
    page = export_html(
        model, args.text, name=name, view=args.view, ablate=ablate, ablation=args.ablation
    )
    atomic_write_text(args.output, page)
    print(
        f"wrote {args.output} ({len(page.encode('utf-8')) / 1e6:.1f} MB): open it in a browser, "
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
                "1.2,1.0 "
                "knocks out heads 2 and 0 of layer 1)"
            )
        heads.append((int(layer), int(head)))
    return heads


def add_commands(sub: argparse._SubParsersAction) -> None:
    from ..formats.cli import MODEL_HELP, add_revision_flag

    p = sub.add_parser(
        "explore",
        help="the local web explorer: attention on real models, in the browser",
        description="Serve the explorer's seven views (soft dictionary, attention matrix, heads, "
        "through a block, next token, generate, atlas) for the given models.",
    )
    p.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="model directories (attnlab or Hugging Face format), bundled names (minilm) or "
        "Hugging Face "
        "Hub names (gpt2, EleutherAI/pythia-70m); default: the newest run under ./runs and minilm",
    )
    add_revision_flag(p, "the MODELs")
    p.add_argument(
        "--revisions",
        default=None,
        metavar="STEPS",
        help="training-step revisions of Hub MODELs for the step slider: step1000,step2000,... or "
        "'all' "
        "(every stepN branch, as Pythia publishes them); each is fetched when the slider first "
        "reaches it",
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
        "ablated "
        "model's, with the per-token loss strip and the next token before and after",
    )
    e.add_argument(
        "--ablation",
        choices=("zero", "mean"),
        default="zero",
        help="knock a head out by zeroing its output, or by its mean over the text (default zero)",
    )
    e.set_defaults(func=run_export)
