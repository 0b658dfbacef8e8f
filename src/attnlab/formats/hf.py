"""Hugging Face-format directories: config.json + model.safetensors (or shards with their index) +
tokenizer.json.

Design choices:
- Each architecture (attnlab.formats.gpt2, .gpt_neox, .llama for llama and qwen2, .bert) is an
  `Architecture` (attnlab.formats.architecture, which also holds the helpers they share): how
  its config.json maps onto ModelConfig and back, and an explicit table of weight names (`Weight`:
  one Hugging Face tensor <-> one or more attnlab tensors). Reading and writing use the same table,
  so the two directions cannot drift.
- Only three conversions exist: GPT-2's Conv1D weights are transposed, a fused tensor (GPT-2's
  c_attn) is the concatenation of its attnlab parts along the output dim, and a fused tensor
  interleaved per head (GPT-NeoX's query_key_value: q, k, v of head 0, then of head 1, ...) is that
  concatenation head by head.
- Reading fails loudly and names the key: a checkpoint tensor the table does not know (unless it is
  a listed non-weight such as a saved causal-mask buffer or an encoder's pooler), a tensor the
  config implies but the files lack, a tensor of the wrong shape. Tensors are read one at a time
  from the safetensors files, which are opened without unpickling anything; `.bin` checkpoints are
  refused.
- A bias one side has and the other lacks is zero on the side that lacks it, which computes the same
  function (nanoGPT's bias=False written as GPT-2, LLaMA's attention_bias without mlp_bias read as
  attnlab).
- Weights are loaded into float32 (or the model's dtype) whatever the file's dtype: attnlab's views
  and comparisons are about exact numbers.
- Settings needed to write the directory back (special token ids, the original model_type, a
  generation_config.json) travel in ModelConfig.extra.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import UserError, first_line
from ..files import atomic_write, atomic_write_text
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from .architecture import Architecture
from .bert import BERT
from .gpt2 import GPT2
from .gpt_neox import GPT_NEOX
from .llama import LLAMA
from .moe import MOE
from .native import attach_tokenizer, empty_model, state_dict_for_saving
from .untrusted import check_dtype, check_fits, warn_non_finite

INDEX = "model.safetensors.index.json"


def architectures() -> dict[str, Architecture]:
    """model_type -> Architecture."""
    return {
        model_type: arch
        for arch in (GPT2, GPT_NEOX, LLAMA, BERT, MOE)
        for model_type in arch.model_types
    }


# Reading
# -------------------------------------------------------------------------------------------------


def read_config(path: Path, name: str = "config.json") -> dict:
    file = path / name
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no {name}; a model directory needs one") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{file}: not readable JSON ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def is_hf(path: str | Path) -> bool:
    """A directory whose config.json names a model_type (supported or not: load says which are)."""
    try:
        return "model_type" in read_config(Path(path))
    except UserError:
        return False


def architecture_for(hf: dict, source: str) -> Architecture:
    model_type = hf.get("model_type")
    archs = architectures()
    if not isinstance(model_type, str) or model_type not in archs:
        raise UserError(
            f"{source}: model_type {model_type!r} is not supported; attnlab reads "
            f"{', '.join(archs)}"
        )
    return archs[model_type]


def weight_files(path: Path) -> list[Path]:
    """model.safetensors, or the shards its index lists; never a pickle."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            raise UserError(
                f"{path / INDEX}: not a valid safetensors index (needs a 'weight_map'; {exc!r})"
            ) from None
        for shard in shards:
            if not (path / shard).is_file():
                raise UserError(
                    f"{path / INDEX}: lists shard {shard!r}, which is missing from {path}"
                )
        return [path / shard for shard in shards]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")) or list(path.glob("*.pth")):
        raise UserError(
            f"{path}: only pickled weights (.bin/.pt) here; attnlab never unpickles checkpoints. "
            "Convert them once "
            "with transformers (model.save_pretrained(dir, safe_serialization=True)) to get "
            "model.safetensors"
        )
    raise UserError(
        f"{path}: no model.safetensors (or {INDEX} with shards); the directory has no weights"
    )


def open_safetensors(file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(
            f"{file}: not a readable safetensors file ({first_line(exc)}); the file may be "
            "truncated or "
            "corrupt"
        ) from None


def _strip(key: str, arch: Architecture) -> str:
    for prefix in arch.read_prefixes:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def load_hf(path: str | Path, device: str | torch.device = "cpu"):
    """A Transformer from a Hugging Face-format directory, in eval mode, with .config and
    .tokenizer."""
    path = Path(path)
    hf = read_config(path)
    source = str(path / "config.json")
    arch = architecture_for(hf, source)
    try:
        config = arch.config_from_hf(hf, source)
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(
            f"{source}: a setting has a value of the wrong type ({first_line(exc)})"
        ) from None
    extra = {**config.extra, "hf_model_type": hf["model_type"]}
    if (path / "generation_config.json").is_file():
        extra["generation_config"] = read_config(path, "generation_config.json")
    config = config.replace(extra=extra)

    # Where each checkpoint tensor lives, by its name with the class prefix removed.
    handles, found = {}, {}
    files = weight_files(path)
    for file in files:
        handles[file] = handle = open_safetensors(file)
        for key in handle.keys():
            found[_strip(key, arch)] = (key, file)

    table = arch.weights(hf, config)
    expected = {w.hf for w in table}
    ignored = re.compile("|".join(f"(?:{pattern})" for pattern in arch.ignored))
    for name, (key, file) in found.items():
        if name not in expected and not ignored.fullmatch(name):
            raise UserError(
                f"{file}: unknown weight {key!r} for a {hf['model_type']} model with this config "
                f"(expected names such as {table[-1].hf!r}); the weights do not match config.json"
            )
    missing = [w.hf for w in table if w.hf not in found]
    if missing:
        raise UserError(
            f"{path}: missing weight {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f", which {source} implies; the weights do not match the config"
        )

    check_fits(config, files, source)
    model = empty_model(config, device)
    params = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in params.items()}
    for w in table:
        key, file = found[w.hf]
        check_dtype(key, handles[file].get_slice(key).get_dtype(), file)
        actual = tuple(handles[file].get_slice(key).get_shape())
        if actual != w.hf_shape(shapes):
            raise UserError(
                f"{file}: weight {key!r} has shape {actual} but {source} implies "
                f"{w.hf_shape(shapes)}; "
                "the config does not match the weights"
            )
    covered, non_finite = set(), {}
    with torch.no_grad():
        for w in table:
            key, file = found[w.hf]
            tensor = read_tensor(handles[file], key, file)
            if not torch.isfinite(tensor).all():
                non_finite[key] = tensor
            for name, part in zip(w.ours, w.to_ours(tensor, shapes)):
                params[name].copy_(part)
                covered.add(name)
        for name, tensor in params.items():
            if name in covered or (name == "unembed.weight" and config.tie_embeddings):
                continue
            # A bias attnlab's config has but this architecture's does not (see the module
            # docstring).
            assert name.endswith(".bias"), f"{name} has no entry in the {hf['model_type']} table"
            tensor.zero_()
    warn_non_finite(non_finite, path)
    attach_tokenizer(model, path)
    return model.eval()


def read_tensor(handle, key: str, file: Path) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return handle.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(
            f"{file}: cannot read weight {key!r} ({first_line(exc)}); the file may be truncated or "
            "corrupt"
        ) from None


# Writing
# -------------------------------------------------------------------------------------------------


def architecture_to_write(cfg: ModelConfig) -> Architecture:
    """GPT-2 for learned positions; for RoPE, GPT-NeoX with LayerNorm and a plain MLP, else LLaMA
    (Qwen2/3, Mistral); BERT for encoders; a setting none of them has is named by the writer's
    check."""
    archs = architectures()
    if cfg.logit_softcap is not None:
        raise UserError(
            f"cannot save as Hugging Face format: logit_softcap={cfg.logit_softcap} (GPT-2 and "
            "LLaMA have "
            "no logit cap, so transformers would compute other logits); save with "
            "format='attnlab' instead"
        )
    gemma = {
        name: getattr(cfg, name)
        for name in ("sandwich_norm", "scale_embed", "sliding_window_pattern", "rope_theta_local")
        if getattr(cfg, name) not in (None, False)
    }
    if gemma:
        name, value = next(iter(gemma.items()))
        raise UserError(
            f"cannot save as Hugging Face format: {name}={value!r} (a Gemma 3 setting, and "
            "attnlab writes no Gemma 3 directory); save with format='attnlab' instead"
        )
    if cfg.n_experts:
        return archs["mixtral"]  # its writer names what it cannot write yet
    if not cfg.causal:
        return archs["bert"]
    if cfg.positional == "rope":
        return (
            archs["gpt_neox"] if cfg.norm == "layernorm" and not cfg.gated_mlp else archs["llama"]
        )
    if cfg.positional == "learned":
        return archs["gpt2"]
    raise UserError(
        f"cannot save as Hugging Face format: positional={cfg.positional!r}, but GPT-2 needs "
        "'learned' and "
        "LLaMA 'rope'; save with format='attnlab' instead"
    )


def weight_parts(
    arch: Architecture,
    hf: dict,
    state: dict,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
):
    """Each tensor of the checkpoint `arch` writes for a model of config.json `hf`: its
    Weight, its full name and the attnlab tensors it is made of, from `state` (a state dict; a value
    may be any object with the tensor's .shape, such as a GGUF writer's ready-made blocks), zeros
    for a bias attnlab lacks. Every tensor of `state` has a place (asserted)."""
    # The checkpoint as transformers will read it: its shapes give the zeros for biases attnlab
    # lacks.
    theirs = arch.config_from_hf(hf, "config.json")
    shapes = {
        name: tuple(t.shape) for name, t in Transformer(theirs, device="meta").state_dict().items()
    }
    used = set()
    for w in arch.weights(hf, theirs):
        parts = []
        for name in w.ours:
            if name in state:
                assert tuple(state[name].shape) == shapes[name], (
                    name,
                    state[name].shape,
                    shapes[name],
                )
                parts.append(state[name])
                used.add(name)
            else:
                parts.append(torch.zeros(shapes[name], dtype=dtype, device=device))
        yield w, (w.hf if w.hf in arch.head_keys else arch.write_prefix + w.hf), parts
    assert used == set(state), (
        f"tensors with no place in the {hf['model_type']} table: {sorted(set(state) - used)}"
    )


def save_hf(model, path: str | Path) -> Path:
    """Write config.json, model.safetensors (+ tokenizer.json, generation_config.json) for
    transformers."""
    from safetensors.torch import save_file

    if getattr(model, "quantization", None):
        raise UserError(
            f"this model is quantized ({model.quantization}), which Hugging Face's format does "
            "not hold; "
            'save it with format="attnlab", or save the float model before quantizing'
        )

    cfg = model.config
    arch = architecture_to_write(cfg)
    hf = arch.config_to_hf(cfg)
    tensors = {
        key: w.to_hf(parts).cpu()
        for w, key, parts in weight_parts(
            arch, hf, state_dict_for_saving(model), model.dtype, model.device
        )
    }

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(
        path / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"})
    )
    if model.tokenizer is not None:
        atomic_write(path / "tokenizer.json", model.tokenizer.save)
        # Lets AutoTokenizer open the directory with tokenizer.json alone.
        atomic_write_text(
            path / "tokenizer_config.json",
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n",
        )
    if "generation_config" in cfg.extra:
        atomic_write_text(
            path / "generation_config.json",
            json.dumps(cfg.extra["generation_config"], indent=2) + "\n",
        )
    config = {**hf, "dtype": str(model.dtype).removeprefix("torch.")}
    atomic_write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    return path
