"""attnlab's own checkpoint format: a directory with config.json, model.safetensors and
tokenizer.json.

Design choices:
- config.json holds {"format": "attnlab", "version": 1, "model": ModelConfig fields}; nothing is
  ever unpickled: weights are safetensors, the tokenizer is JSON.
- Every file is written atomically (attnlab.files.AtomicFiles), so a kill at any moment leaves
  either the old file or the new one, never half of one; a training checkpoint passes its own
  folder instead (attnlab.files.ManifestFolder), which writes each file once and lists it in the
  checkpoint's manifest.
- Loading verifies the folder's manifest.json when there is one (attnlab.files.verify_manifest):
  a truncated or bit-flipped file is refused with one line naming it. A training run's folder is
  read through attnlab.formats.runs, which picks its newest complete checkpoint.
- A tied LM head is stored once (as the embedding) and re-tied on load.
- A quantized model (`attnlab.quantize`) says so in config.json ("quantization": "int8") and stores
  its int8 weights and their scales as they are; the loader quantizes the empty model the same way
  before filling it. Its LM head is its own int8 tensor even when tied (the embedding keeps its
  float rows).
- Files are untrusted input (attnlab.formats.untrusted, shared with every format): the config must
  fit the weight files, every weight is floating point, a NaN or infinite one is a warning; here
  also every tensor's name, shape and dtype must match the model (`load_state`).
- Loaders that overwrite every weight build their model without the random init (`empty_model`,
  shared with attnlab.formats.hf and .gguf).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError, first_line
from ..files import AtomicFiles, ManifestFolder, verify_manifest
from ..model.config import ModelConfig
from ..model.positions import Rotary
from ..model.transformer import Transformer
from ..quant.quantize import QUANTIZATIONS, quantize
from ..tokenizer import Tokenizer
from .untrusted import check_dtype, check_fits, warn_non_finite

FORMAT = "attnlab"
VERSION = 1
# parameters above which loaders skip the random init (see empty_model)
META_BUILD_ABOVE = 100_000_000
# what save_native writes (config.json last)
MODEL_FILES = ("tokenizer.json", "model.safetensors", "config.json")


def state_dict_for_saving(model) -> dict[str, torch.Tensor]:
    """The model's tensors, contiguous, with a tied LM head stored only once."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.unembed is not None and model.unembed.weight is model.embed.weight:
        state.pop("unembed.weight", None)
    return state


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
