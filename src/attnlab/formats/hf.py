"""Hugging Face-format directories: config.json + model.safetensors (or shards with their index) + tokenizer.json.

Design choices:
- Each architecture (attnlab.formats.gpt2, .gpt_neox, .llama for llama and qwen2, .bert) is an `Architecture`: how
  its config.json maps onto ModelConfig and back, and an explicit table of weight names (`Weight`: one
  Hugging Face tensor <-> one or more attnlab tensors). Reading and writing use the same table, so the two
  directions cannot drift.
- Only three conversions exist: GPT-2's Conv1D weights are transposed, a fused tensor (GPT-2's c_attn)
  is the concatenation of its attnlab parts along the output dim, and a fused tensor interleaved per head
  (GPT-NeoX's query_key_value: q, k, v of head 0, then of head 1, ...) is that concatenation head by head.
- Reading fails loudly and names the key: a checkpoint tensor the table does not know (unless it is a
  listed non-weight such as a saved causal-mask buffer or an encoder's pooler), a tensor the config
  implies but the files lack, a tensor of the wrong shape. Tensors are read one at a time from the
  safetensors files, which are opened without unpickling anything; `.bin` checkpoints are refused.
- A bias one side has and the other lacks is zero on the side that lacks it, which computes the same
  function (nanoGPT's bias=False written as GPT-2, LLaMA's attention_bias without mlp_bias read as attnlab).
- Weights are loaded into float32 (or the model's dtype) whatever the file's dtype: attnlab's views and
  comparisons are about exact numbers.
- Settings needed to write the directory back (special token ids, the original model_type, a
  generation_config.json) travel in ModelConfig.extra.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..errors import UserError, first_line
from .native import atomic_write, atomic_write_text, attach_tokenizer, check_dtype, check_fits, empty_model, state_dict_for_saving, warn_non_finite

INDEX = "model.safetensors.index.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Weight:
    """One Hugging Face tensor and the attnlab tensor(s) it holds (several: fused along dim 0 of nn.Linear)."""

    hf: str
    ours: tuple[str, ...]
    conv1d: bool = False  # GPT-2's Conv1D stores (in, out), the transpose of nn.Linear's (out, in)
    heads: int = 1  # fused per head: rows are [part 0 of head 0, part 1 of head 0, ..., part 0 of head 1, ...]

    def __init__(self, hf: str, *ours: str, conv1d: bool = False, heads: int = 1) -> None:
        object.__setattr__(self, "hf", hf)
        object.__setattr__(self, "ours", ours)
        object.__setattr__(self, "conv1d", conv1d)
        object.__setattr__(self, "heads", heads)

    def hf_shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The shape the checkpoint must have, given the attnlab shapes."""
        first = shapes[self.ours[0]]
        shape = (sum(shapes[name][0] for name in self.ours), *first[1:])
        return shape[::-1] if self.conv1d and len(shape) == 2 else shape

    def to_ours(self, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> list[torch.Tensor]:
        if self.conv1d and tensor.dim() == 2:
            tensor = tensor.t()  # Conv1D (in, out) -> Linear (out, in)
        sizes = [shapes[name][0] // self.heads for name in self.ours]  # rows of each part, per head
        per_head = tensor.reshape(self.heads, sum(sizes), *tensor.shape[1:])  # [head, rows of all parts, ...]
        return [part.reshape(-1, *tensor.shape[1:]) for part in per_head.split(sizes, dim=1)]

    def to_hf(self, parts: list[torch.Tensor]) -> torch.Tensor:
        per_head = [part.reshape(self.heads, -1, *part.shape[1:]) for part in parts]  # [head, rows, ...]
        tensor = torch.cat(per_head, dim=1).flatten(0, 1) if len(parts) > 1 else parts[0]
        return (tensor.t() if self.conv1d and tensor.dim() == 2 else tensor).contiguous()


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    read_prefixes: tuple[str, ...]  # stripped from checkpoint names (GPT2LMHeadModel saves "transformer.h.0...")
    write_prefix: str  # added back on writing, so that the *ForCausalLM class loads every tensor
    head_keys: tuple[str, ...]  # names that sit outside the prefix ("lm_head.weight")
    ignored: tuple[str, ...]  # regexes of checkpoint names that are not attnlab weights (see each module)
    config_from_hf: Callable[[dict, str], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    weights: Callable[[dict, ModelConfig], list[Weight]]


def architectures() -> dict[str, Architecture]:
    """model_type -> Architecture (imported here: the architecture modules import this one)."""
    from .bert import BERT
    from .gpt2 import GPT2
    from .gpt_neox import GPT_NEOX
    from .llama import LLAMA

    return {model_type: arch for arch in (GPT2, GPT_NEOX, LLAMA, BERT) for model_type in arch.model_types}


# Helpers the architecture modules share ----------------------------------------------------------------

_ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                        "relu2": "relu2"}
_ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "relu2": "relu2"}


def activation_from_hf(name: str, source: str) -> str:
    if name not in _ACTIVATIONS_FROM_HF:
        raise UserError(f"{source}: activation {name!r} is not supported; attnlab reads {', '.join(_ACTIVATIONS_FROM_HF)}")
    return _ACTIVATIONS_FROM_HF[name]


def activation_to_hf(mlp: str) -> str:
    return _ACTIVATIONS_TO_HF[mlp]


def hf_value(hf: dict, key: str, source: str, alias: str | None = None) -> int:
    """A required positive integer of config.json, named in the error when absent or wrong."""
    value = hf.get(key, hf.get(alias) if alias else None)
    if value is None:
        raise UserError(f"{source}: missing {key!r}; a {hf.get('model_type')} config.json needs it")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{source}: {key!r} must be a positive integer, got {value!r}")
    return value


def sizes_from_hf(hf: dict, source: str) -> dict:
    """ModelConfig's sizes from the names BERT, LLaMA and GPT-NeoX share (GPT-2 has its own)."""
    return dict(
        d_vocab=hf_value(hf, "vocab_size", source),
        n_ctx=hf_value(hf, "max_position_embeddings", source),
        d_model=hf_value(hf, "hidden_size", source),
        n_layers=hf_value(hf, "num_hidden_layers", source),
        n_heads=hf_value(hf, "num_attention_heads", source),
        d_mlp=hf_value(hf, "intermediate_size", source),
    )


def special_ids(source: dict, pad_default: int | None = None) -> dict:
    """bos/eos/pad ids, written explicitly even when None: LlamaConfig would otherwise default eos to 2."""
    return {key: source.get(key, pad_default if key == "pad_token_id" else None) for key in SPECIAL_IDS}


def check_writable(cfg: ModelConfig, style: str, **required) -> None:
    for name, value in required.items():
        if getattr(cfg, name) != value:
            raise UserError(
                f"cannot save as Hugging Face {style}: {name}={getattr(cfg, name)!r}, but {style} needs "
                f"{name}={value!r}; save with format='attnlab' instead"
            )


def check_plain_heads(cfg: ModelConfig, style: str, scales: tuple[float, ...] = ()) -> None:
    """What GPT-2 and BERT share: a plain MLP, one k/v head per query head, d_head = d_model / n_heads and
    the 1/sqrt(d_head) scale (or one of `scales`); the error names the first setting that breaks it."""
    if cfg.mlp == "swiglu":
        problem = "mlp='swiglu' (a gated MLP, which only LLaMA style has: positional='rope', norm='rmsnorm')"
    elif cfg.kv_heads != cfg.n_heads:
        problem = f"n_kv_heads={cfg.n_kv_heads} (grouped-query attention, which only LLaMA style has)"
    elif cfg.head_dim * cfg.n_heads != cfg.d_model:
        problem = f"d_head={cfg.d_head} must be d_model / n_heads = {cfg.d_model // cfg.n_heads}"
    elif cfg.attn_scale not in (None, cfg.head_dim**-0.5, *scales):
        known = " or ".join(["1/sqrt(d_head)", *(f"{s:g}" for s in scales)])
        problem = f"attn_scale={cfg.attn_scale} ({style} knows only {known})"
    else:
        return
    raise UserError(f"cannot save as Hugging Face {style}: {problem}; use format='attnlab'")


# config.json's rope_type -> ModelConfig.rope_scaling (attnlab.model.positions.scale_frequencies computes each)
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def rope_from_hf(hf: dict, source: str, head_dim: int, partial_default: float | None = None) -> dict:
    """ModelConfig's RoPE fields from config.json: transformers 5 nests them under rope_parameters; 4.x had
    rope_theta and rope_scaling at the top (GPT-NeoX: rotary_emb_base and rotary_pct). partial_default: the
    rotary fraction when none is given, for architectures whose RoPE honours one (None: rotate every dim)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{source}: rope_parameters must be a JSON object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UserError(f"{source}: rope_type {rope_type!r} is not supported; attnlab implements {', '.join(ROPE_TYPES)}")
    theta = rope.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    fields: dict = {"positional": "rope", "rope_theta": float(theta), "rope_scaling": ROPE_TYPES[rope_type]}
    if partial_default is not None:
        fraction = rope.get("partial_rotary_factor", hf.get("rotary_pct", hf.get("partial_rotary_factor", partial_default)))
        rotary_dim = int(head_dim * fraction)  # as transformers counts the rotated dims
        if rotary_dim <= 0 or rotary_dim % 2:
            raise UserError(f"{source}: partial_rotary_factor {fraction} of head size {head_dim} rotates {rotary_dim} "
                            "dims; RoPE needs a positive, even number")
        fields["rotary_fraction"] = rotary_dim / head_dim
    if rope_type == "default":
        return fields
    for key in ("factor", *(("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ())):
        if not isinstance(rope.get(key), (int, float)) or isinstance(rope.get(key), bool):
            raise UserError(f"{source}: rope_type {rope_type!r} needs a number {key!r} in rope_parameters, got {rope.get(key)!r}")
    fields["rope_scaling_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]), rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_n_ctx=rope.get("original_max_position_embeddings"))
    return fields


def rope_to_hf(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters for cfg (transformers 5; writers copy it to rope_scaling for 4.x)."""
    rope_type = {value: key for key, value in ROPE_TYPES.items()}[cfg.rope_scaling]
    rope = {"rope_type": rope_type, "rope_theta": cfg.rope_theta}
    if rope_type != "default":
        rope["factor"] = cfg.rope_scaling_factor
    if rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_n_ctx or cfg.n_ctx)
    return rope


# Reading -------------------------------------------------------------------------------------------------

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
        raise UserError(f"{source}: model_type {model_type!r} is not supported; attnlab reads {', '.join(archs)}")
    return archs[model_type]


def weight_files(path: Path) -> list[Path]:
    """model.safetensors, or the shards its index lists; never a pickle."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{path / INDEX}: not a valid safetensors index (needs a 'weight_map'; {exc!r})") from None
        for shard in shards:
            if not (path / shard).is_file():
                raise UserError(f"{path / INDEX}: lists shard {shard!r}, which is missing from {path}")
        return [path / shard for shard in shards]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")) or list(path.glob("*.pth")):
        raise UserError(
            f"{path}: only pickled weights (.bin/.pt) here; attnlab never unpickles checkpoints. Convert them once "
            "with transformers (model.save_pretrained(dir, safe_serialization=True)) to get model.safetensors"
        )
    raise UserError(f"{path}: no model.safetensors (or {INDEX} with shards); the directory has no weights")


def open_safetensors(file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{file}: not a readable safetensors file ({first_line(exc)}); the file may be truncated or "
                        "corrupt") from None


def _strip(key: str, arch: Architecture) -> str:
    for prefix in arch.read_prefixes:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def load_hf(path: str | Path, device: str | torch.device = "cpu"):
    """A Transformer from a Hugging Face-format directory, in eval mode, with .config and .tokenizer."""
    path = Path(path)
    hf = read_config(path)
    source = str(path / "config.json")
    arch = architecture_for(hf, source)
    try:
        config = arch.config_from_hf(hf, source)
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(f"{source}: a setting has a value of the wrong type ({first_line(exc)})") from None
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
            f"{path}: missing weight {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
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
                f"{file}: weight {key!r} has shape {actual} but {source} implies {w.hf_shape(shapes)}; "
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
            # A bias attnlab's config has but this architecture's does not (see the module docstring).
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
        raise UserError(f"{file}: cannot read weight {key!r} ({first_line(exc)}); the file may be truncated or "
                        "corrupt") from None


# Writing -------------------------------------------------------------------------------------------------

def architecture_to_write(cfg: ModelConfig) -> Architecture:
    """GPT-2 for learned positions; for RoPE, GPT-NeoX with LayerNorm and a plain MLP, else LLaMA (Qwen2/3,
    Mistral); BERT for encoders; a setting none of them has is named by the writer's check."""
    archs = architectures()
    if cfg.logit_softcap is not None:
        raise UserError(f"cannot save as Hugging Face format: logit_softcap={cfg.logit_softcap} (GPT-2 and LLaMA have "
                        "no logit cap, so transformers would compute other logits); save with format='attnlab' instead")
    if not cfg.causal:
        return archs["bert"]
    if cfg.positional == "rope":
        return archs["gpt_neox"] if cfg.norm == "layernorm" and cfg.mlp != "swiglu" else archs["llama"]
    if cfg.positional == "learned":
        return archs["gpt2"]
    raise UserError(
        f"cannot save as Hugging Face format: positional={cfg.positional!r}, but GPT-2 needs 'learned' and "
        "LLaMA 'rope'; save with format='attnlab' instead"
    )


def save_hf(model, path: str | Path) -> Path:
    """Write config.json, model.safetensors (+ tokenizer.json, generation_config.json) for transformers."""
    from safetensors.torch import save_file

    if getattr(model, "quantization", None):
        raise UserError(f"this model is quantized ({model.quantization}), which Hugging Face's format does not hold; "
                        "save it with format=\"attnlab\", or save the float model before quantizing")

    from ..model.transformer import Transformer

    cfg = model.config
    arch = architecture_to_write(cfg)
    hf = arch.config_to_hf(cfg)
    # The checkpoint as transformers will read it: its shapes give the zeros for biases attnlab lacks.
    theirs = arch.config_from_hf(hf, "config.json")
    shapes = {name: tuple(t.shape) for name, t in Transformer(theirs, device="meta").state_dict().items()}
    state = state_dict_for_saving(model)
    tensors, used = {}, set()
    for w in arch.weights(hf, theirs):
        parts = []
        for name in w.ours:
            if name in state:
                assert tuple(state[name].shape) == shapes[name], (name, state[name].shape, shapes[name])
                parts.append(state[name])
                used.add(name)
            else:
                parts.append(torch.zeros(shapes[name], dtype=model.dtype, device=model.device))
        key = w.hf if w.hf in arch.head_keys else arch.write_prefix + w.hf
        tensors[key] = w.to_hf(parts).cpu()
    assert used == set(state), f"tensors with no place in the {hf['model_type']} table: {sorted(set(state) - used)}"

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if model.tokenizer is not None:
        atomic_write(path / "tokenizer.json", model.tokenizer.save)
        # Lets AutoTokenizer open the directory with tokenizer.json alone.
        atomic_write_text(path / "tokenizer_config.json", json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
    if "generation_config" in cfg.extra:
        atomic_write_text(path / "generation_config.json", json.dumps(cfg.extra["generation_config"], indent=2) + "\n")
    config = {**hf, "dtype": str(model.dtype).removeprefix("torch.")}
    atomic_write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    return path
