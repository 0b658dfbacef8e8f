"""Mixtral, Qwen2-MoE and Qwen3-MoE in Hugging Face format: LLaMA-style models whose MLPs are
mixtures of experts (attnlab.model.moe).

Design choices:
- Everything but the MLP is attnlab.formats.llama's: Mixtral's attention is Mistral's (no biases,
  an optional window), Qwen2-MoE's Qwen2's (biases on q, k and v: its `qkv_bias`), Qwen3-MoE's
  Qwen3's (qk-norm). The config is read as that model_type's and the experts' fields are added;
  the weight table is LLaMA's with its dense MLP rows replaced by the router's and the experts'.
- The names on disk are those transformers saves and the Hub holds, one matrix per expert
  (transformers 5 fuses them into 3-D tensors when it loads, and splits them again when it saves):
  Mixtral's `block_sparse_moe.gate` and `experts.{e}.w1 / w3 / w2` (gate, up, down), Qwen's
  `mlp.gate`, `mlp.experts.{e}.gate_proj / up_proj / down_proj`, `mlp.shared_expert.*` and
  `mlp.shared_expert_gate`.
- The top-k weights are renormalised as each computes them: Mixtral always, Qwen2/3-MoE where
  norm_topk_prob is set (transformers' default: not).
- Qwen's dense layers among sparse ones (decoder_sparse_step > 1, mlp_only_layers) are refused by
  name: attnlab's blocks all have the same MLP.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelConfig
from . import llama
from .architecture import Architecture, Weight, hf_value

# model_type -> the LLaMA-style model_type its attention is read as
ATTENTION = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


def _as_llama(hf: dict) -> dict:
    """config.json as the LLaMA-style model its attention is (ATTENTION), with the dense MLP's
    width being the experts'."""
    model_type = hf.get("model_type")
    dense = {**hf, "model_type": ATTENTION[model_type]}
    if model_type == "qwen2_moe" and hf.get("qkv_bias", True) is False:
        dense.update(model_type="llama", attention_bias=False)  # Qwen2 without its biases
    if model_type != "mixtral":
        dense["intermediate_size"] = hf.get("moe_intermediate_size")
    return dense


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    model_type = hf["model_type"]
    if model_type != "mixtral":
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise UserError(
                f"{source}: dense MLPs among the experts' (decoder_sparse_step {step}, "
                f"mlp_only_layers {dense}) are not supported; attnlab's blocks all have the same "
                "MLP"
            )
    # Mixtral's name, and Qwen's (transformers 5 writes both models' count as the first)
    counts = ("num_local_experts", "num_experts")
    key, alias = counts if model_type == "mixtral" else counts[::-1]
    n_experts = hf_value(hf, key, source, alias)
    qwen2 = model_type == "qwen2_moe"
    shared = hf_value(hf, "shared_expert_intermediate_size", source) if qwen2 else 0
    config = llama.config_from_hf(_as_llama(hf), source)
    return config.replace(
        n_experts=n_experts,
        experts_per_token=hf_value(hf, "num_experts_per_tok", source),
        norm_topk_prob=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        d_shared_expert=shared,
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    raise UserError(
        "cannot save a mixture of experts as Hugging Face format yet; save with format='attnlab'"
    )


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    """LLaMA's table without its dense MLP, and each block's router and experts."""
    mixtral = hf.get("model_type") == "mixtral"
    table = [w for w in llama.weights(_as_llama(hf), cfg) if ".mlp." not in w.ours[0]]
    parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    ours = ("W_gate", "W_in", "W_out")
    for i in range(cfg.n_layers):
        h = f"layers.{i}.block_sparse_moe." if mixtral else f"layers.{i}.mlp."
        b = f"blocks.{i}.mlp."
        table.append(Weight(h + "gate.weight", b + "W_gate.weight"))
        for e in range(cfg.n_experts):
            table += [
                Weight(f"{h}experts.{e}.{theirs}.weight", f"{b}experts.{e}.{name}.weight")
                for theirs, name in zip(parts, ours)
            ]
        if cfg.d_shared_expert:
            table += [
                Weight(f"{h}shared_expert.{theirs}.weight", f"{b}shared_expert.{name}.weight")
                for theirs, name in zip(parts, ours)
            ]
            table.append(Weight(h + "shared_expert_gate.weight", b + "shared_expert_gate.weight"))
    return table


MOE = Architecture(
    model_types=tuple(ATTENTION),
    read_prefixes=("model.",),
    write_prefix="model.",
    head_keys=("lm_head.weight",),
    ignored=llama.LLAMA.ignored,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    weights=weights,
)
