"""Models by Hugging Face Hub name: `attnlab.load("gpt2")`, `attnlab.load("EleutherAI/pythia-70m",
revision="step3000")`.

A name that is neither an existing directory nor a bundled model nor a local path by its spelling or
its first folder (`local_path_reason`: runs/x beside ./runs is a mistyped path, refused without a
request) is a Hub repository id. Its files are fetched by huggingface_hub (the library transformers
uses) into the one Hugging Face cache, and the snapshot folder is then read like any local Hugging
Face directory by attnlab.formats.hf.

Design choices:
- huggingface_hub does all the Hub work: the cache layout, HF_HOME / HF_HUB_CACHE, HF_ENDPOINT,
  HF_HUB_OFFLINE=1, the token (HF_TOKEN or `hf auth login`'s), the retry on a dropped network, the
  progress bars (HF_HUB_DISABLE_PROGRESS_BARS=1 hides them), so all of them behave exactly as in
  transformers, and a model either library downloaded is in the cache for the other. attnlab keeps
  no download code of its own (the house style's "avoid a download path of our own").
- Only the files attnlab reads are fetched: the small files first (config.json,
  generation_config.json, tokenizer.json, tokenizer_config.json, the safetensors index) with
  snapshot_download's allow_patterns; then, once config.json has shown a model_type attnlab can
  read, the weights: model.safetensors or the shards the index lists, each with hf_hub_download (a
  progress bar per file, as transformers shows). An unsupported model or a repository without
  safetensors is refused before gigabytes of weights move.
- The second step asks for the commit the first step resolved, so a branch (Pythia's training
  checkpoints are branches, `step3000`) that moves in between cannot mix two versions of a model.
- Every Hub failure becomes one UserError line that says what to do: offline and not cached, no such
  repository, no such revision, a gated repository without (or with an insufficient) token, only
  pickled `.bin` weights (refused: attnlab never unpickles), an unsupported model_type (the list
  comes from the architecture table, so new architectures appear in it by themselves). The token is
  never part of any message: the messages are built here, from the repository id and the revision
  only.
- Training checkpoints as revisions (`step_revisions`): Pythia publishes its training steps as
  branches named stepN; huggingface_hub's list_repo_refs lists a repository's branches and tags (GET
  /api/models/{repo}/refs), and the stepN ones become the explorer's step slider. Listing needs the
  Hub: offline, the revisions are named on the command line instead.
- A GGUF file is fetched by name (`attnlab.load("OWNER/REPO", file="model-Q4_K_M.gguf")`,
  `download_file`): GGUF repositories hold one model in several quantizations, and the user picks
  one, as with transformers' from_pretrained(repo, gguf_file=...). Only that file comes down.
- huggingface_hub reads its environment when it is imported, as in transformers: set HF_HUB_OFFLINE,
  HF_ENDPOINT and HF_HOME before the first `attnlab.load` of a Hub name.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from huggingface_hub import (
    constants,
    get_token,
    hf_hub_download,
    list_repo_files,
    snapshot_download,
)
from huggingface_hub.utils import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    validate_repo_id,
)

from ..errors import UserError
from ..version import __version__
from .hf import architecture_for, read_config
from .native import is_native

# huggingface_hub's failures: HTTP answers, and its cache and offline errors
# (LocalEntryNotFoundError and OfflineModeIsEnabled are OSErrors); ValueError is its check of a
# repository id's characters
HUB_ERRORS = (HfHubHTTPError, OSError, ValueError)
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
# What attnlab reads besides the weights (see attnlab.formats.hf.load_hf and
# native.attach_tokenizer); tokenizer_config.json is not read by attnlab but lets transformers open
# the same snapshot (attnlab compare).
SMALL_FILES = (CONFIG, "generation_config.json", "tokenizer.json", "tokenizer_config.json", INDEX)
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Pythia's training-checkpoint branches: step0, step1, ..., step143000
STEP_REVISION = re.compile(r"step(\d+)")


def step_of(revision: str) -> int | None:
    """The training step a revision name stands for ("step3000" -> 3000), None for any other
    name."""
    match = STEP_REVISION.fullmatch(revision)
    return int(match.group(1)) if match else None


def step_revisions(repo_id: str) -> dict[int, str]:
    """step -> branch or tag name of every training-step revision (stepN) of `repo_id`, in step
    order, as the Hub lists them (huggingface_hub's list_repo_refs); a UserError when there are none
    or the Hub cannot answer."""
    from huggingface_hub import HfApi

    try:
        refs = HfApi(library_name="attnlab").list_repo_refs(repo_id)
    except HUB_ERRORS as exc:
        if (
            isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError))
            or constants.HF_HUB_OFFLINE
        ):
            raise UserError(
                f"{repo_id}: listing its revisions needs the Hugging Face Hub "
                f"({constants.ENDPOINT}); "
                "name them instead (--revisions step1000,step2000)"
            ) from None
        raise UserError(explain(exc, repo_id, None, repo_id)) from None
    found = {
        step: ref.name
        for ref in [*refs.branches, *refs.tags]
        if (step := step_of(ref.name)) is not None
    }
    if not found:
        names = ", ".join(ref.name for ref in refs.branches[:5])
        raise UserError(
            f"{repo_id}: no training-step revisions (branches named stepN, as Pythia's) on the "
            "Hub; "
            f"its branches are {names}; name revisions with --revision instead"
        )
    return dict(sorted(found.items()))


def is_repo_id(name: str) -> bool:
    """Whether `name` is spelled like a Hub repository id ("gpt2", "EleutherAI/pythia-70m") and does
    not read as a local path (`local_path_reason`), so a mistyped directory is never looked up on
    the Hub."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return local_path_reason(name) is None


def local_path_reason(name: str) -> str | None:
    """Why `name`, which names nothing on disk, is a local path the user mistyped rather than a Hub
    repository id, or None when it may be a Hub id. A path: spelled as one ("./runs/x", "../x",
    "/tmp/x", "~/x", "runs/x/", "a/b/c"), or its first part is a folder here ("runs/x" beside
    ./runs: owner/name on the Hub, but the user meant the folder they have). "EleutherAI/pythia-70m"
    is a Hub id unless ./EleutherAI exists."""
    separators = tuple(filter(None, ("/", os.sep, os.altsep)))
    first, *rest = re.split("|".join(map(re.escape, separators)), name)
    if name.startswith((".", "~", *separators)) or name.endswith(separators) or len(rest) > 1:
        return "the name is spelled as a path, so it is not looked up on the Hugging Face Hub"
    if rest and Path(first).is_dir():
        return (
            f"./{first} is a folder here, so the name is read as a path in it rather than as the "
            "Hugging Face Hub "
            f"repository {name}, which would be loaded from another folder"
        )
    return None


def download(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (default: the main branch), holding the
    files attnlab reads, fetched into the Hugging Face cache if they are not there yet."""
    label = repo_id if revision is None else f"{repo_id} (revision {revision!r})"
    agent = {"library_name": "attnlab", "library_version": __version__}
    try:
        folder = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=list(SMALL_FILES), **agent)
        )
        commit = folder.name  # snapshots/<commit hash>
        if not (folder / CONFIG).is_file():
            raise UserError(
                f"{label}: the repository has no {CONFIG}, so it is not a transformers model; "
                "attnlab loads repositories that transformers' from_pretrained loads"
            )
        if not is_native(folder):
            # an unsupported model_type stops here
            architecture_for(read_config(folder), f"{label} {CONFIG}")
        for name in shard_names(folder):
            try:
                hf_hub_download(repo_id, name, revision=commit, **agent)
            except EntryNotFoundError as exc:
                if name == WEIGHTS or isinstance(exc, LocalEntryNotFoundError):
                    raise
                raise UserError(
                    f"{label}: {INDEX} lists the shard {name!r}, which the repository does not "
                    "have; "
                    "the repository is incomplete"
                ) from None
    except UserError:
        raise
    except HUB_ERRORS as exc:
        raise UserError(explain(exc, repo_id, revision, label)) from None
    return folder


def download_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """One named file of `repo_id` (a GGUF model file: repositories hold several quantizations of
    one model), fetched into the Hugging Face cache if it is not there yet; its path in the snapshot
    folder."""
    label = repo_id if revision is None else f"{repo_id} (revision {revision!r})"
    try:
        return Path(
            hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                library_name="attnlab",
                library_version=__version__,
            )
        )
    except HUB_ERRORS as exc:
        if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
            names = sorted(
                name for name in _repo_files(repo_id, revision) if name.endswith(".gguf")
            )
            raise UserError(
                f"{label}: no file {filename!r} in the repository"
                + (f"; its GGUF files are {', '.join(names[:6])}" if names else "")
            ) from None
        raise UserError(explain(exc, repo_id, revision, f"{label} file {filename!r}")) from None


def shard_names(folder: Path) -> list[str]:
    """The weight files to fetch: the shards the safetensors index lists, else model.safetensors."""
    if not (folder / INDEX).is_file():
        return [WEIGHTS]
    try:
        weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        AttributeError,
    ) as exc:
        raise UserError(
            f"{folder / INDEX}: not a valid safetensors index (needs a 'weight_map'; {exc!r})"
        ) from None


def explain(exc: Exception, repo_id: str, revision: str | None, label: str) -> str:
    """One line for a huggingface_hub failure: the problem and what to do, never the token."""
    page = f"{constants.ENDPOINT}/{repo_id}"
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        if _has_token():
            return (
                f"{label}: a gated repository, and your Hugging Face token has no access to it; "
                "accept its "
                f"conditions at {page} with the account the token belongs to"
            )
        return (
            f"{label}: a gated repository; accept its conditions at {page}, then give attnlab a "
            "token: set "
            "HF_TOKEN or run `hf auth login`"
        )
    if isinstance(exc, RepositoryNotFoundError):
        private = (
            "if it is private, set HF_TOKEN or run `hf auth login`"
            if not _has_token()
            else "if it is private, your token has no access to it"
        )
        return (
            f"{repo_id}: neither a local model directory nor a Hugging Face Hub repository "
            f"({constants.ENDPOINT} "
            f"has no repository of that name; check the spelling, or {private})"
        )
    if isinstance(exc, RevisionNotFoundError):
        return (
            f"{repo_id}: no revision {revision!r} on the Hub; give a branch, tag or commit hash "
            "that exists "
            f"(listed at {page}/tree/main)"
        )
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
        pickled = [name for name in _repo_files(repo_id, revision) if name.endswith(PICKLES)]
        if pickled:
            return (
                f"{label}: only pickled weights ({', '.join(pickled[:2])}), no model.safetensors; "
                "attnlab never "
                "unpickles checkpoints (loading a pickle can run any code). Use a revision or "
                "repository with "
                "safetensors, or convert once with transformers: save_pretrained(dir, "
                "safe_serialization=True)"
            )
        return (
            f"{label}: no model.safetensors (nor {INDEX}) in the repository; it has no weights "
            "attnlab can read"
        )
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        if constants.HF_HUB_OFFLINE:
            return (
                f"{label}: no such local directory, not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), and "
                "HF_HUB_OFFLINE=1 forbids downloading it; run once with a network (HF_HUB_OFFLINE "
                "unset) or pass "
                "a local directory"
            )
        return (
            f"{label}: no such local directory, and the Hugging Face Hub ({constants.ENDPOINT}) "
            "cannot be reached "
            f"to fetch it (nor is it in the cache, {constants.HF_HUB_CACHE}); check the network, "
            "or pass a local "
            "directory"
        )
    # the file system's refusal, not the Hub's
    if isinstance(exc, OSError) and exc.errno is not None:
        return (
            f"{label}: cannot write the Hugging Face cache "
            f"({exc.filename or constants.HF_HUB_CACHE}: "
            f"{exc.strerror}); set HF_HOME to a folder you can write"
        )
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "an error")
        return (
            f"{label}: the Hugging Face Hub ({constants.ENDPOINT}) answered {status}; try again "
            "later"
        )
    return (
        f"{label}: could not fetch it from the Hugging Face Hub ({type(exc).__name__}); check the "
        "network"
    )


def _has_token() -> bool:
    """Whether huggingface_hub will send a token (HF_TOKEN or a saved login); the token itself is
    never read here."""
    return get_token() is not None


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The repository's file names, to tell 'only pickles' from 'no weights'; [] when they cannot be
    listed (the message then says only what is certain)."""
    try:
        return list_repo_files(repo_id, revision=revision)
    except HUB_ERRORS:
        return []
