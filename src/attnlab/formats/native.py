"""attnlab's own checkpoint format: a directory with config.json, model.safetensors and tokenizer.json.

Design choices:
- config.json holds {"format": "attnlab", "version": 1, "model": ModelConfig fields}; nothing is ever
  unpickled: weights are safetensors, the tokenizer is JSON.
- Every file is written atomically (to a temporary name in the same directory, fsynced, then renamed),
  so a kill at any moment leaves either the old file or the new one, never half of one.
- A tied LM head is stored once (as the embedding) and re-tied on load.
- A quantized model (`attnlab.quantize`) says so in config.json ("quantization": "int8") and stores its int8
  weights and their scales as they are; the loader quantizes the empty model the same way before filling it.
  Its LM head is its own int8 tensor even when tied (the embedding keeps its float rows).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import UserError

FORMAT = "attnlab"
VERSION = 1
META_BUILD_ABOVE = 100_000_000  # parameters above which loaders skip the random init (see empty_model)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path), fsync, then rename onto `path`: readers see the old file or the new, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def state_dict_for_saving(model) -> dict[str, torch.Tensor]:
    """The model's tensors, contiguous, with a tied LM head stored only once."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.unembed is not None and model.unembed.weight is model.embed.weight:
        state.pop("unembed.weight", None)
    return state


def save_native(model, path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT, "version": VERSION, "model": model.config.to_dict()}
    if getattr(model, "quantization", None):
        config["quantization"] = model.quantization
    atomic_write(path / "model.safetensors", lambda tmp: save_file(state_dict_for_saving(model), tmp, metadata={"format": "pt"}))
    if model.tokenizer is not None:
        atomic_write(path / "tokenizer.json", model.tokenizer.save)
    atomic_write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    return path


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
            raise UserError(f"{file}: missing; a checkpoint directory needs its weights file") from None
        raise UserError(f"{file}: not a readable safetensors file ({exc}); the file may be truncated or corrupt") from None


def load_state(model, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Copy `state` into the model, failing on any missing, unexpected or mis-shaped key, named."""
    expected = {k: v for k, v in model.state_dict().items()}
    if model.unembed is not None and model.unembed.weight is model.embed.weight:
        expected.pop("unembed.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise UserError(f"{source}: missing weight {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise UserError(f"{source}: unexpected weight {unexpected[0]!r}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise UserError(
                f"{source}: weight {key!r} has shape {tuple(tensor.shape)} but the config expects "
                f"{tuple(expected[key].shape)}; the config does not match the weights"
            )
    with torch.no_grad():
        for key, tensor in state.items():
            expected[key].copy_(tensor)


def empty_model(config: ModelConfig, device: str | torch.device = "cpu"):
    """A Transformer whose weights a loader is about to overwrite, every one of them.

    Skipping the random init matters for real checkpoints: GPT-2's init of a 1B-parameter model takes about
    a minute on a CPU. Such a model is built on the meta device, then given memory; what that loses is put
    back here: the tied head (to_empty gives it its own tensor) and RoPE's inverse frequencies (a buffer
    computed, not loaded). Small models are simply initialised: the meta path's first use imports torch's
    Python meta kernels, which costs seconds, more than their init.
    """
    from ..model import Transformer
    from ..positions import Rotary

    d, n = config.d_model, config.n_layers
    rough_params = config.d_vocab * d * 2 + n * d * (4 * d + 3 * config.mlp_dim)
    if rough_params < META_BUILD_ABOVE:
        return Transformer(config, device=device)
    model = Transformer(config, device="meta").to_empty(device=device)
    if model.unembed is not None and config.tie_embeddings:
        model.unembed.weight = model.embed.weight
    if model.rotary is not None:
        model.rotary.inv_freq = Rotary.for_config(config).inv_freq.to(device)
    assert [name for name, _ in model.named_buffers()] == (["rotary.inv_freq"] if model.rotary is not None else [])
    return model


def load_native(path: str | Path, device: str | torch.device = "cpu"):
    path = Path(path)
    try:
        meta = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path / 'config.json'}: cannot read it ({exc})") from None
    if meta.get("version", VERSION) > VERSION:
        raise UserError(f"{path}: written by a newer attnlab (format version {meta['version']}); upgrade attnlab")
    config = ModelConfig.from_dict(meta["model"])
    model = empty_model(config, device)
    if meta.get("quantization"):
        from ..layers import quantize

        quantize(model, meta["quantization"])
    load_state(model, read_safetensors(path / "model.safetensors"), path / "model.safetensors")
    attach_tokenizer(model, path)
    return model.eval()


def attach_tokenizer(model, path: str | Path) -> None:
    """Set model.tokenizer from path/tokenizer.json when there is one; a tokenizer with more ids than the
    model has embeddings would index past the table, so it is refused here rather than at the first lookup."""
    from ..tokenizer import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return
    model.tokenizer = Tokenizer.from_file(file)
    if model.tokenizer.vocab_size > model.config.d_vocab:
        raise UserError(
            f"{file}: the tokenizer has {model.tokenizer.vocab_size} tokens but the model's "
            f"vocabulary is {model.config.d_vocab}; the tokenizer does not belong to this model"
        )
