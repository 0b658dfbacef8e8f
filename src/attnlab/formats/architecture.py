"""What every Hugging Face architecture table is made of, and the helpers the tables share.

An `Architecture` says how one family's config.json maps onto ModelConfig and back, and lists its
weights as
`Weight`s (one Hugging Face tensor <-> one or more attnlab tensors); attnlab.formats.gpt2,
.gpt_neox, .llama and .bert each define one, and attnlab.formats.hf reads and writes by them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..model.config import ModelConfig

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Weight:
    """One Hugging Face tensor and the attnlab tensor(s) it holds (several: fused along dim 0 of
    nn.Linear)."""

    hf: str
    ours: tuple[str, ...]
    conv1d: bool = False  # GPT-2's Conv1D stores (in, out), the transpose of nn.Linear's (out, in)
    # fused per head: rows are [part 0 of head 0, part 1 of head 0, ..., part 0 of head 1, ...]
    heads: int = 1

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

    def to_ours(
        self, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]]
    ) -> list[torch.Tensor]:
        if self.conv1d and tensor.dim() == 2:
            tensor = tensor.t()  # Conv1D (in, out) -> Linear (out, in)
        sizes = [shapes[name][0] // self.heads for name in self.ours]  # rows of each part, per head
        # [head, rows of all parts, ...]
        per_head = tensor.reshape(self.heads, sum(sizes), *tensor.shape[1:])
        return [part.reshape(-1, *tensor.shape[1:]) for part in per_head.split(sizes, dim=1)]

    def to_hf(self, parts: list[torch.Tensor]) -> torch.Tensor:
        # [head, rows, ...]
        per_head = [part.reshape(self.heads, -1, *part.shape[1:]) for part in parts]
        tensor = torch.cat(per_head, dim=1).flatten(0, 1) if len(parts) > 1 else parts[0]
        return (tensor.t() if self.conv1d and tensor.dim() == 2 else tensor).contiguous()


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    # stripped from checkpoint names (GPT2LMHeadModel saves "transformer.h.0...")
    read_prefixes: tuple[str, ...]
    write_prefix: str  # added back on writing, so that the *ForCausalLM class loads every tensor
    head_keys: tuple[str, ...]  # names that sit outside the prefix ("lm_head.weight")
    # regexes of checkpoint names that are not attnlab weights (see each module)
    ignored: tuple[str, ...]
    config_from_hf: Callable[[dict, str], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    weights: Callable[[dict, ModelConfig], list[Weight]]


_ACTIVATIONS_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
}
_ACTIVATIONS_TO_HF = {
    "gelu": "gelu",
    "gelu_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "relu2": "relu2",
}


def activation_from_hf(name: str, source: str) -> str:
    if name not in _ACTIVATIONS_FROM_HF:
        raise UserError(
            f"{source}: activation {name!r} is not supported; attnlab reads "
            f"{', '.join(_ACTIVATIONS_FROM_HF)}"
        )
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


def decoder_config(
    hf: dict,
    source: str,
    *,
    partial_default: float | None = None,
    tie_default: bool = False,
    **fields,
) -> ModelConfig:
    """The ModelConfig of a decoder whose config.json names its sizes as LLaMA's
    (sizes_from_hf): the sizes, the key/value heads (num_key_value_heads, else one per query head;
    `fields` may give n_kv_heads instead), RoPE over d_model / n_heads (`partial_default`: see
    rope_from_hf), the tied head (tie_word_embeddings, else `tie_default`) and the special ids;
    `fields` are the architecture's own settings (norm, MLP, biases, wiring)."""
    sizes = sizes_from_hf(hf, source)
    fields.setdefault("n_kv_heads", hf.get("num_key_value_heads") or sizes["n_heads"])
    return ModelConfig(
        **sizes,
        **rope_from_hf(
            hf, source, sizes["d_model"] // sizes["n_heads"], partial_default=partial_default
        ),
        tie_embeddings=hf.get("tie_word_embeddings", tie_default),
        extra=special_ids(hf),
        **fields,
    )


def check_swiglu(hf: dict, source: str, name: str) -> None:
    """Refuse a config.json whose hidden_act is not SwiGLU's silu, for architecture `name`."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(
            f"{source}: hidden_act {hf['hidden_act']!r} is not supported for {name}; expected "
            "'silu' (SwiGLU)"
        )


def special_ids(source: dict, pad_default: int | None = None) -> dict:
    """bos/eos/pad ids, written explicitly even when None: LlamaConfig would otherwise default eos
    to 2."""
    return {
        key: source.get(key, pad_default if key == "pad_token_id" else None) for key in SPECIAL_IDS
    }


def check_writable(cfg: ModelConfig, style: str, **required) -> None:
    for name, value in required.items():
        if getattr(cfg, name) != value:
            raise UserError(
                f"cannot save as Hugging Face {style}: {name}={getattr(cfg, name)!r}, but {style} "
                "needs "
                f"{name}={value!r}; save with format='attnlab' instead"
            )


def check_plain_heads(cfg: ModelConfig, style: str, scales: tuple[float, ...] = ()) -> None:
    """What GPT-2 and BERT share: a plain MLP, one k/v head per query head, d_head = d_model /
    n_heads and the 1/sqrt(d_head) scale (or one of `scales`); the error names the first setting
    that breaks it."""
    if cfg.gated_mlp:
        problem = (
            f"mlp={cfg.mlp!r} (a gated MLP, which only LLaMA style has: positional='rope', "
            "norm='rmsnorm')"
        )
    elif cfg.n_kv_heads != cfg.n_heads:
        problem = (
            f"n_kv_heads={cfg.n_kv_heads} (grouped-query attention, which only LLaMA style has)"
        )
    elif cfg.d_head * cfg.n_heads != cfg.d_model:
        problem = f"d_head={cfg.d_head} must be d_model / n_heads = {cfg.d_model // cfg.n_heads}"
    elif cfg.attn_scale not in (None, cfg.d_head**-0.5, *scales):
        known = " or ".join(["1/sqrt(d_head)", *(f"{s:g}" for s in scales)])
        problem = f"attn_scale={cfg.attn_scale} ({style} knows only {known})"
    else:
        return
    raise UserError(f"cannot save as Hugging Face {style}: {problem}; use format='attnlab'")


# config.json's rope_type -> ModelConfig.rope_scaling (attnlab.model.positions.scale_frequencies
# computes each)
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def rope_from_hf(hf: dict, source: str, d_head: int, partial_default: float | None = None) -> dict:
    """ModelConfig's RoPE fields from config.json: transformers 5 nests them under rope_parameters;
    4.x had rope_theta and rope_scaling at the top (GPT-NeoX: rotary_emb_base and rotary_pct).
    partial_default: the rotary fraction when none is given, for architectures whose RoPE honours
    one (None: rotate every dim)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{source}: rope_parameters must be a JSON object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UserError(
            f"{source}: rope_type {rope_type!r} is not supported; attnlab implements "
            f"{', '.join(ROPE_TYPES)}"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    fields: dict = {
        "positional": "rope",
        "rope_theta": float(theta),
        "rope_scaling": ROPE_TYPES[rope_type],
    }
    if partial_default is not None:
        fraction = rope.get(
            "partial_rotary_factor",
            hf.get("rotary_pct", hf.get("partial_rotary_factor", partial_default)),
        )
        rotary_dim = int(d_head * fraction)  # as transformers counts the rotated dims
        if rotary_dim <= 0 or rotary_dim % 2:
            raise UserError(
                f"{source}: partial_rotary_factor {fraction} of head size {d_head} rotates "
                f"{rotary_dim} "
                "dims; RoPE needs a positive, even number"
            )
        fields["rotary_fraction"] = rotary_dim / d_head
    if rope_type == "default":
        return fields
    for key in (
        "factor",
        *(("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ()),
    ):
        if not isinstance(rope.get(key), (int, float)) or isinstance(rope.get(key), bool):
            raise UserError(
                f"{source}: rope_type {rope_type!r} needs a number {key!r} in rope_parameters, "
                f"got {rope.get(key)!r}"
            )
    fields["rope_scaling_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        fields.update(
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_n_ctx=rope.get("original_max_position_embeddings"),
        )
    return fields


def rope_to_hf(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters for cfg (transformers 5; writers copy it to rope_scaling for
    4.x)."""
    rope_type = {value: key for key, value in ROPE_TYPES.items()}[cfg.rope_scaling]
    rope = {"rope_type": rope_type, "rope_theta": cfg.rope_theta}
    if rope_type != "default":
        rope["factor"] = cfg.rope_scaling_factor
    if rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_n_ctx or cfg.n_ctx,
        )
    return rope


def decoder(
    model_types: tuple[str, ...],
    config_from_hf: Callable[[dict, str], ModelConfig],
    weights: Callable[[dict, ModelConfig], list[Weight]],
    name: str,
) -> Architecture:
    """A decoder in LLaMA's checkpoint layout (`model.` before the blocks, `lm_head` outside),
    read only: saving as it is refused in one line naming `name` (Gemma, Phi-3, StableLM)."""
    return Architecture(
        model_types=model_types,
        read_prefixes=("model.",),
        write_prefix="model.",
        head_keys=("lm_head.weight",),
        ignored=(),
        config_from_hf=config_from_hf,
        config_to_hf=refuse_writing(name),
        weights=weights,
    )


def refuse_writing(name: str) -> Callable[[ModelConfig], dict]:
    """A config_to_hf for an architecture attnlab reads but does not write."""

    def config_to_hf(cfg: ModelConfig) -> dict:
        raise UserError(
            f"attnlab writes no Hugging Face {name} directory; save with format='attnlab'"
        )

    return config_to_hf


def embedding_and_head(cfg: ModelConfig, final_norm_bias: bool = False) -> tuple[list, list]:
    """The Weights before and after the blocks in LLaMA's layout: the token embedding and the final
    norm (with its bias: LayerNorm models), and the LM head unless it is the embedding."""
    first = [
        Weight("embed_tokens.weight", "embed.weight"),
        Weight("norm.weight", "ln_final.weight"),
    ]
    if final_norm_bias:
        first.append(Weight("norm.bias", "ln_final.bias"))
    last = [] if cfg.tie_embeddings else [Weight("lm_head.weight", "unembed.weight")]
    return first, last


def llama_projections(h: str, b: str) -> list[Weight]:
    """One block's seven matrices in LLaMA's names (h: the checkpoint's prefix, b: attnlab's)."""
    return [
        Weight(h + theirs + ".weight", b + ours + ".weight")
        for theirs, ours in (
            ("self_attn.q_proj", "attn.W_Q"),
            ("self_attn.k_proj", "attn.W_K"),
            ("self_attn.v_proj", "attn.W_V"),
            ("self_attn.o_proj", "attn.W_O"),
            ("mlp.gate_proj", "mlp.W_gate"),
            ("mlp.up_proj", "mlp.W_in"),
            ("mlp.down_proj", "mlp.W_out"),
        )
    ]
