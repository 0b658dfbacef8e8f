"""attnlab's own checkpoint format: a directory with config.json, model.safetensors and
tokenizer.json.

Design choices:
- config.json holds {"format": "attnlab", "version": 1, "model": ModelConfig fields}; nothing is
  ever
  unpickled: weights are safetensors, the tokenizer is JSON.
- Every file is written atomically (attnlab.files.atomic_write), so a kill at any moment leaves
  either the old file or the new one, never half of one. A training checkpoint's files go instead
  into a hidden folder that no reader sees until one rename commits it whole (`ManifestFolder`):
  there each file is written once under its own name and fsynced once, and hashed from the bytes
  written.
- A directory may carry `manifest.json` (every file's size and SHA-256, written last: training
  checkpoints do, see attnlab.training.checkpoint). Loading verifies it when it is there, so a
  truncated or bit-flipped file is refused with one line naming it instead of loading silently.
- A tied LM head is stored once (as the embedding) and re-tied on load.
- A quantized model (`attnlab.quantize`) says so in config.json ("quantization": "int8") and stores
  its int8 weights and their scales as they are; the loader quantizes the empty model the same way
  before filling it. Its LM head is its own int8 tensor even when tied (the embedding keeps its
  float rows).
- Files are untrusted input (for every format, shared with attnlab.formats.hf): a config whose sizes
  need more weights than the files can hold is refused before anything is allocated (`check_fits`),
  a tensor that is not floating point is refused by name, a NaN or infinite weight is a warning
  naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from ..errors import UserError, first_line
from ..files import atomic_write
from ..model.config import ModelConfig
from ..model.positions import Rotary
from ..model.transformer import Transformer
from ..quant.quantize import QUANTIZATIONS, quantize
from ..tokenizer import Tokenizer

FORMAT = "attnlab"
VERSION = 1
# parameters above which loaders skip the random init (see empty_model)
META_BUILD_ABOVE = 100_000_000
MANIFEST = "manifest.json"
# what save_native writes (config.json last)
MODEL_FILES = ("tokenizer.json", "model.safetensors", "config.json")
# a training run's folder of checkpoints, step-NNNNNNN/ each (attnlab.training.checkpoint)
CHECKPOINTS = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"step-(\d{7,})")
T = TypeVar("T")


def state_dict_for_saving(model) -> dict[str, torch.Tensor]:
    """The model's tensors, contiguous, with a tied LM head stored only once."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.unembed is not None and model.unembed.weight is model.embed.weight:
        state.pop("unembed.weight", None)
    return state


def _as_bytes(data: bytes | memoryview | str) -> bytes | memoryview:
    return data.encode("utf-8") if isinstance(data, str) else data


class AtomicFiles:
    """The files of a folder that readers may look at while it is written: each one swapped in whole
    (`atomic_write`); tensors are streamed to the file by safetensors, never held as one more copy
    in memory."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, data: bytes | memoryview | str) -> None:
        atomic_write(self.folder / name, lambda tmp: Path(tmp).write_bytes(_as_bytes(data)))

    def write_tensors(
        self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
    ) -> None:
        from safetensors.torch import save_file

        atomic_write(self.folder / name, lambda tmp: save_file(tensors, tmp, metadata=metadata))


class ManifestFolder:
    """The files of a fresh folder that no reader sees until it is renamed into place (a training
    checkpoint's hidden folder, attnlab.training.checkpoint.write_checkpoint), and its manifest.

    Each file is written once under its own name and fsynced once; its size and SHA-256 come from
    the bytes as they are written, so the manifest reads nothing back. A temporary name and a rename
    per file would add
    nothing here: the folder's own rename is the commit, and the caller fsyncs the folder before it.
    Tensors are serialized in memory first, so that the bytes hashed are the bytes written:
    safetensors' `save` builds its buffer and copies it out, so the peak is about twice the weights'
    bytes, still below train_state.pt's bytes with the optimizer's moments, which a training save
    holds before this."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files: dict[str, dict] = {}

    def write(self, name: str, data: bytes | memoryview | str) -> None:
        data = _as_bytes(data)
        # x: a name written twice is a bug, never an overwrite
        with open(self.folder / name, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {
            "bytes": memoryview(data).nbytes,
            "sha256": hashlib.sha256(data).hexdigest(),
        }

    def write_tensors(
        self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
    ) -> None:
        from safetensors.torch import save

        self.write(name, save(tensors, metadata=metadata))

    def write_manifest(self, extra: dict | None = None) -> None:
        """manifest.json, written last: every file written so far with its size and SHA-256, so a
        folder whose manifest verifies holds exactly what was written."""
        files = dict(sorted(self.files.items()))
        self.write(
            MANIFEST,
            json.dumps(
                {"format": FORMAT, "version": VERSION, **(extra or {}), "files": files}, indent=1
            )
            + "\n",
        )


def save_native(model, path: str | Path | ManifestFolder) -> Path:
    """Write `model` as config.json, model.safetensors and tokenizer.json into the folder `path`,
    each file atomically; or through a checkpoint's ManifestFolder, which writes each once and lists
    it in its manifest."""
    files = path if isinstance(path, ManifestFolder) else AtomicFiles(path)
    config = {"format": FORMAT, "version": VERSION, "model": model.config.to_dict()}
    if getattr(model, "quantization", None) not in (None, *QUANTIZATIONS):
        raise UserError(
            f"this model holds a GGUF file's blocks mixed with other types "
            f"({model.quantization}), which attnlab's format cannot record yet; save the model "
            "loaded without keep_blocks=True"
        )
    if getattr(model, "quantization", None):
        config["quantization"] = model.quantization
    files.write_tensors("model.safetensors", state_dict_for_saving(model), {"format": "pt"})
    if model.tokenizer is not None:
        files.write("tokenizer.json", model.tokenizer.to_json())
    files.write("config.json", json.dumps(config, indent=2) + "\n")
    return files.folder


def file_digest(file: str | Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of a file, read in 1 MiB blocks."""
    digest, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


# Folders whose manifest verified in this process, with the (size, mtime, inode) of every file it
# lists then:
# loading a run folder verifies its newest checkpoint to choose it and then loads it, and the second
# check of unchanged files would hash every byte again. Any write to a listed file changes its
# mtime, so it is hashed anew.
_verified: dict[Path, tuple] = {}


def _stamp(path: Path, names) -> tuple:
    stats = [(path / name).stat() for name in names]
    return tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in zip(names, stats))


def verify_manifest(path: str | Path) -> dict | None:
    """Check every file manifest.json lists (size, then SHA-256); None when there is no manifest. A
    file that is missing, of another size or another digest is a UserError naming it. Files
    unchanged since they last verified in this process are not hashed again."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        files = manifest["files"]
        listed = {
            str(name): (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()
        }
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
    ) as exc:
        raise UserError(
            f"{file}: not a readable manifest ({exc!r}); the checkpoint is damaged"
        ) from None
    for name, (size, sha256) in listed.items():
        target = path / name
        if Path(name).name != name or not target.is_file():
            raise UserError(f"{target}: missing, but {file} lists it; the checkpoint is incomplete")
        actual = target.stat().st_size
        if actual != size:
            raise UserError(
                f"{target}: {actual} bytes, but {file} says {size}; the file is truncated or "
                "damaged"
            )
    stamp = _stamp(path, [MANIFEST, *listed])
    if _verified.get(path.resolve()) == stamp:
        return manifest
    for name, (size, sha256) in listed.items():
        target = path / name
        if file_digest(target)["sha256"] != sha256:
            raise UserError(
                f"{target}: its SHA-256 differs from {file}'s; the file is damaged (a flipped bit)"
            )
    _verified[path.resolve()] = stamp
    return manifest


def checkpoint_dirs(run: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint of a training run, newest first (hidden
    temporaries, which an interrupted save leaves, excluded)."""
    root = Path(run) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _CHECKPOINT_NAME.fullmatch(p.name)) and p.is_dir()
    ]
    return sorted(found, reverse=True)


def verified_checkpoint(folder: Path) -> Path:
    """`folder`, when its manifest verifies; a UserError naming what is wrong with it otherwise."""
    if verify_manifest(folder) is None:
        raise UserError(f"{folder}: no {MANIFEST}; the checkpoint was never completed")
    return folder


def newest_complete(run: str | Path, check: Callable[[Path], T]) -> tuple[T | None, list[str]]:
    """Walk a training run's checkpoints newest first: check(folder) on each until one passes
    (returns rather than raising a UserError). Returns what it returned (None when none passed) and
    why each newer one failed. Loading a run folder (`run_model_dir`) and --resume
    (attnlab.training.checkpoint. find_checkpoint) choose their checkpoint by this one walk, with
    their own `check`."""
    problems: list[str] = []
    for _, folder in checkpoint_dirs(run):
        try:
            return check(folder), problems
        except UserError as exc:
            problems.append(str(exc))
    return None, problems


def run_model_dir(run: str | Path) -> Path:
    """The folder that loading a training run's folder reads: its newest checkpoint whose manifest
    verifies (so it never depends on the model files linked into the run folder being up to date),
    with a warning naming each newer one skipped as damaged; the run folder itself when it has no
    checkpoint folders.

    When every checkpoint is damaged, the run folder's own model files (hard links into the newest
    checkpoint, or copies) are loaded only if a checkpoint's manifest vouches for their bytes, with
    a warning naming what was damaged; if they hold the damaged bytes or no manifest vouches for
    them, a UserError names the file and the way out."""
    run = Path(run)
    checkpoints = checkpoint_dirs(run)
    if not checkpoints:
        return run
    folder, damaged = newest_complete(run, verified_checkpoint)
    if folder is not None:
        if damaged:
            warnings.warn(
                f"skipped a damaged checkpoint ({damaged[0]}); loading the previous complete one, "
                f"{folder}",
                stacklevel=3,
            )
        return folder
    why = "; ".join(damaged)
    vouching, problem = model_files_vouched_for(run, [folder for _, folder in checkpoints])
    if vouching is not None:
        warnings.warn(
            f"every checkpoint of {run} is damaged ({why}); loading the model files in {run} "
            f"itself, whose size and SHA-256 match {vouching / MANIFEST}",
            stacklevel=3,
        )
        return run
    raise UserError(
        f"{run}: every checkpoint is damaged ({why}), and {problem}; nothing here verifies, so "
        "nothing is loaded: restore the run from a backup, or train it again with --overwrite"
    )


def model_files_vouched_for(run: Path, checkpoints: list[Path]) -> tuple[Path | None, str]:
    """The first of `checkpoints` whose manifest lists the run folder's model files (MODEL_FILES
    that are there) with their exact size and SHA-256, or None and why not (the run folder's weights
    are the damaged checkpoint's own file, or hold its bytes, or no readable manifest lists
    them)."""
    present = [name for name in MODEL_FILES if (run / name).is_file()]
    weights = run / "model.safetensors"
    if "model.safetensors" not in present:
        return None, f"{weights} is missing"
    digests = {name: file_digest(run / name) for name in present}
    for folder in checkpoints:
        try:
            listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
            if all(listed[name] == digests[name] for name in present):
                return folder, ""
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            # a manifest that is missing, unreadable or silent about a file vouches for nothing
            continue
    for folder in checkpoints:
        theirs = folder / "model.safetensors"
        if theirs.is_file() and os.path.samefile(theirs, weights):
            return None, f"{weights} is the same file as {theirs} (a hard link), damaged with it"
        if theirs.is_file() and file_digest(theirs) == digests["model.safetensors"]:
            return None, f"{weights} holds the same bytes as the damaged {theirs}"
    return (
        None,
        f"no checkpoint's manifest lists {weights} with its size and SHA-256, so it cannot be "
        "verified",
    )


def is_native(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def read_safetensors(file: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a truncated or corrupt file is a UserError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise UserError(
                f"{file}: missing; a checkpoint directory needs its weights file"
            ) from None
        raise UserError(
            f"{file}: not a readable safetensors file ({first_line(exc)}); the file may be "
            "truncated or "
            "corrupt"
        ) from None


def stored_elements_at_least(config: ModelConfig) -> int:
    """A lower bound on the number of weights a checkpoint of `config` stores: the token embedding,
    each block's W_Q and W_O, and its MLP's two matrices (every format stores at least these)."""
    d, width = config.d_model, config.n_heads * config.d_head
    per_block = 2 * d * width + (0 if config.attn_only else 2 * d * config.d_mlp)
    learned = config.n_ctx * d if config.positional == "learned" else 0
    return config.d_vocab * d + learned + config.n_token_types * d + config.n_layers * per_block


def check_fits(config: ModelConfig, files: list[Path], source: str | Path) -> None:
    """Refuse a config whose weights cannot be in `files` (fewer bytes than half a byte per weight),
    before
    any of them is allocated: a config.json claiming d_model = 10^9 must not ask for terabytes
    first."""
    available = sum(file.stat().st_size for file in files)
    needed = stored_elements_at_least(config)
    if needed > 2 * available:
        raise UserError(
            f"{source}: the config needs at least {needed:,} weights, but the weight files hold "
            f"{available:,} bytes; the config does not match the weights (or claims absurd sizes)"
        )


def check_dtype(key: str, tensor_dtype: torch.dtype | str, source: str | Path) -> None:
    """Weights must be floating point: an integer or boolean tensor is not a weight (and would be
    cast silently)."""
    floating = (
        tensor_dtype.is_floating_point
        if isinstance(tensor_dtype, torch.dtype)
        # safetensors' names: F16, BF16, F32, F8_E4M3, ...
        else str(tensor_dtype).startswith(("F", "BF"))
    )
    if not floating:
        raise UserError(
            f"{source}: weight {key!r} has dtype {tensor_dtype}, not a floating-point type; "
            "the file is not a model checkpoint (or is damaged)"
        )


def warn_non_finite(tensors: dict[str, torch.Tensor], source: str | Path) -> None:
    """A warning naming the first tensor (by its name in the file) holding NaN or infinity: a
    diverged or damaged checkpoint still loads, for inspection, but not silently."""
    bad = [name for name, tensor in tensors.items() if not torch.isfinite(tensor).all()]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        warnings.warn(
            f"{source}: weight {bad[0]!r}{more} holds NaN or infinite values; outputs will be NaN",
            stacklevel=3,
        )


def load_state(model, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Copy `state` into the model, failing on any missing, unexpected or mis-shaped key, named."""
    expected = {k: v for k, v in model.state_dict().items()}
    if model.unembed is not None and model.unembed.weight is model.embed.weight:
        expected.pop("unembed.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise UserError(
            f"{source}: missing weight {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    if unexpected:
        raise UserError(
            f"{source}: unexpected weight {unexpected[0]!r}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    for key, tensor in state.items():
        if expected[key].dtype.is_floating_point:
            check_dtype(key, tensor.dtype, source)
        elif tensor.dtype != expected[key].dtype:  # a quantized model's int8 weights stay int8
            raise UserError(
                f"{source}: weight {key!r} has dtype {tensor.dtype}, but this quantized model "
                "stores "
                f"it as {expected[key].dtype}; the file is damaged or not this model's"
            )
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise UserError(
                f"{source}: weight {key!r} has shape {tuple(tensor.shape)} but the config expects "
                f"{tuple(expected[key].shape)}; the config does not match the weights"
            )
    with torch.no_grad():
        for key, tensor in state.items():
            expected[key].copy_(tensor)


def empty_model(
    config: ModelConfig,
    device: str | torch.device = "cpu",
    modules: dict[str, torch.nn.Module] | None = None,
):
    """A Transformer whose weights a loader is about to overwrite, every one of them.

    Skipping the random init matters for real checkpoints: GPT-2's init of a 1B-parameter model
    takes about a minute on a CPU. Such a model is built on the meta device, then given memory; what
    that loses is put
    back here: the tied head (to_empty gives it its own tensor) and RoPE's inverse frequencies (a
    buffer computed, not loaded). Small models are simply initialised: the meta path's first use
    imports torch's Python meta kernels, which costs seconds, more than their init.

    modules: {name: module} put in the model in place of its own (a GGUF file's matrices kept as
    blocks); on the meta path before the model gets memory, so the float weights they replace are
    never allocated (Gemma 3 270M's would be about 1 GB).
    """
    modules = modules or {}
    d, n = config.d_model, config.n_layers
    rough_params = config.d_vocab * d * 2 + n * d * (4 * d + 3 * config.d_mlp)
    if rough_params < META_BUILD_ABOVE:
        return _install(Transformer(config, device=device), modules, device)
    model = _install(Transformer(config, device="meta"), modules, device)
    # (a head kept as blocks already shares the embedding's blocks)
    floats = isinstance(model.unembed, nn.Linear) and isinstance(model.embed, nn.Embedding)
    if config.tie_embeddings and floats:
        model.unembed.weight = model.embed.weight
    if model.rotary is not None:
        model.rotary.inv_freq = Rotary.for_config(config).inv_freq.to(device)
    if model.rotary_local is not None:
        model.rotary_local.inv_freq = Rotary.for_config(config, local=True).inv_freq.to(device)
    assert {name for name, _ in model.named_buffers()} - {
        f"{module}.blocks" for module in modules
    } == ({"rotary.inv_freq"} if model.rotary is not None else set()) | (
        {"rotary_local.inv_freq"} if model.rotary_local is not None else set()
    )
    return model


def _install(model, modules: dict[str, torch.nn.Module], device: str | torch.device):
    """`model` with `modules` in place of its own, then memory (uninitialised) for every tensor
    still on the meta device, and only those."""
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                empty = torch.empty_like(p, device=device)
                setattr(module, name, torch.nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(module, name, torch.empty_like(b, device=device))
    return model


def load_native(path: str | Path, device: str | torch.device = "cpu"):
    path = Path(path)
    source = path / "config.json"
    try:
        meta = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{source}: cannot read it ({first_line(exc)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise UserError(
            f'{source}: an attnlab config.json is an object with a "model" object; this one is not'
        )
    version = meta.get("version", VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise UserError(f'{source}: "version" must be an integer, got {version!r}')
    if version > VERSION:
        raise UserError(
            f"{path}: written by a newer attnlab (format version {version}); upgrade attnlab"
        )
    verify_manifest(path)
    config = model_config_from(meta["model"], source)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights}: missing; a checkpoint directory needs its weights file")
    state = read_safetensors(weights)  # what the file holds (memory bounded by its size)
    check_fits(config, [weights], source)
    model = empty_model(config, device)
    if meta.get("quantization"):
        quantize(model, meta["quantization"])
    load_state(model, state, weights)
    warn_non_finite(state, weights)
    attach_tokenizer(model, path)
    return model.eval()


def model_config_from(values: dict, source: str | Path) -> ModelConfig:
    """ModelConfig from a file's values; a value of the wrong type is a UserError naming the
    file."""
    try:
        return ModelConfig.from_dict(values)
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None
    # e.g. a string where a number goes
    except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:
        raise UserError(
            f"{source}: a model setting has a value of the wrong type ({first_line(exc)})"
        ) from None


def attach_tokenizer(model, path: str | Path) -> None:
    """Set model.tokenizer from path/tokenizer.json when there is one; a tokenizer with more ids
    than the model has embeddings would index past the table, so it is refused here rather than at
    the first lookup."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return
    model.tokenizer = Tokenizer.from_file(file)
    if model.tokenizer.vocab_size > model.config.d_vocab:
        raise UserError(
            f"{file}: the tokenizer has {model.tokenizer.vocab_size} tokens but the model's "
            f"vocabulary is {model.config.d_vocab}; the tokenizer does not belong to this model"
        )
