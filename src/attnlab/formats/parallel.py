"""Falcon (Almazrouei et al. 2023, the 7B's layout), Command-R (Cohere) and Phi-2 (Microsoft):
parallel blocks with one norm that attention and MLP share, read from GGUF files
(attnlab.formats.gguf makes the config dict from their metadata): config.json fields onto
ModelConfig and the weight names.

Design choices:
- Both compute resid_post = resid_pre + attn(norm(resid_pre)) + mlp(norm(resid_pre)) with one
  norm. attnlab's parallel block has a norm per branch (ModelConfig.parallel_residual, GPT-NeoX's):
  the shared norm's weights are read into both ln1 and ln2 (two Weights on one tensor), which
  computes the same function, and the lens sees both hooks.
- Falcon (`falcon`): LayerNorm with a bias, no other biases (read as zeros), one fused
  query_key_value holding every query head, then the key head(s), then the value head(s)
  (Falcon-7B's multi-query: one; llama.cpp's converter writes the same order), the exact GELU MLP
  (dense_h_to_4h, dense_4h_to_h), RoPE on every dim (rotate-half). Falcon-40B's layout
  (new_decoder_architecture: two norms, grouped heads) and ALiBi are refused by name.
- Command-R (`cohere`; GGUF `command-r`): LayerNorm without a bias, no biases, SwiGLU, the logits
  times logit_scale (ModelConfig.logit_scale), a tied embedding, and RoPE on interleaved pairs
  (transformers' Cohere rotates x[2i], x[2i+1]; llama.cpp's command-r graph too): attnlab rotates
  halves, so the q and k rows are put in halves order on reading (attnlab.formats.gguf's PERMUTED),
  which computes the same scores. use_qk_norm (Command-R+ 08-2024) is refused by name.
- Phi-2 (`phi`; GGUF `phi2`): LayerNorm and every linear layer with a bias, the LM head's too
  (ModelConfig.unembed_bias), the tanh GELU MLP (fc1, fc2), RoPE on the first
  partial_rotary_factor of each head (rotate-half), an untied head. qk_layernorm is refused.
- attnlab writes none of these directories.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelConfig
from .architecture import (
    Architecture,
    Weight,
    activation_from_hf,
    decoder,
    decoder_config,
    embedding_and_head,
    llama_projections,
    refuse_writing,
)


def _parallel_config(hf: dict, source: str, **fields) -> ModelConfig:
    """decoder_config with what the three share: one LayerNorm before a parallel block."""
    return decoder_config(hf, source, norm="layernorm", parallel_residual=True, **fields)


def _shared_norm(h: str, b: str, norm: str, bias: bool) -> list[Weight]:
    """The one norm of a parallel block, read into both of attnlab's (ln1, ln2)."""
    names = [".weight"] + ([".bias"] if bias else [])
    return [Weight(h + norm + end, b + ours + end) for ours in ("ln1", "ln2") for end in names]


def falcon_config(hf: dict, source: str) -> ModelConfig:
    for key, what in (
        ("new_decoder_architecture", "Falcon-40B's layout"),
        ("alibi", "ALiBi positions"),
    ):
        if hf.get(key):
            raise UserError(f"{source}: Falcon with {key} ({what}) is not supported")
    if not hf.get("parallel_attn", True):
        raise UserError(f"{source}: Falcon without parallel_attn is not supported")
    d_model, n_heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    return _parallel_config(
        {**hf, "intermediate_size": hf.get("ffn_hidden_size") or 4 * (d_model or 0)},
        source,
        tie_default=True,
        n_kv_heads=1 if hf.get("multi_query", True) else n_heads,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        mlp="gelu",
        bias=True,  # the LayerNorms' (the linear layers' read as zeros unless bias)
    )


def falcon_weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    linear_bias = bool(hf.get("bias", False))
    table = [
        Weight("word_embeddings.weight", "embed.weight"),
        Weight("ln_f.weight", "ln_final.weight"),
        Weight("ln_f.bias", "ln_final.bias"),
    ]
    for i in range(cfg.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        table += _shared_norm(h, b, "input_layernorm", bias=True)
        parts = [b + f"attn.{m}" for m in ("W_Q", "W_K", "W_V")]
        table.append(
            Weight(h + "self_attention.query_key_value.weight", *(p + ".weight" for p in parts))
        )
        linears = [
            ("self_attention.dense", "attn.W_O"),
            ("mlp.dense_h_to_4h", "mlp.W_in"),
            ("mlp.dense_4h_to_h", "mlp.W_out"),
        ]
        table += [Weight(h + t + ".weight", b + o + ".weight") for t, o in linears]
        if linear_bias:
            table.append(
                Weight(h + "self_attention.query_key_value.bias", *(p + ".bias" for p in parts))
            )
            table += [Weight(h + t + ".bias", b + o + ".bias") for t, o in linears]
    if not cfg.tie_embeddings:
        table.append(Weight("lm_head.weight", "unembed.weight"))
    return table


def cohere_config(hf: dict, source: str) -> ModelConfig:
    if hf.get("use_qk_norm"):
        raise UserError(f"{source}: Command-R with use_qk_norm is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act {hf['hidden_act']!r}; Command-R has 'silu'")
    return _parallel_config(
        hf,
        source,
        tie_default=True,
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        mlp="swiglu",
        bias=False,
        logit_scale=float(hf.get("logit_scale", 1.0)),
    )


def cohere_weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table, head = embedding_and_head(cfg)
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table += _shared_norm(h, b, "input_layernorm", bias=False) + llama_projections(h, b)
    return table + head


FALCON = Architecture(
    model_types=("falcon",),
    read_prefixes=("transformer.",),
    write_prefix="transformer.",
    head_keys=("lm_head.weight",),
    ignored=(),
    config_from_hf=falcon_config,
    config_to_hf=refuse_writing("Falcon"),
    weights=falcon_weights,
)
COHERE = decoder(("cohere",), cohere_config, cohere_weights, "Command-R")


def phi2_config(hf: dict, source: str) -> ModelConfig:
    if hf.get("qk_layernorm"):
        raise UserError(f"{source}: Phi-2 with qk_layernorm is not supported")
    return _parallel_config(
        hf,
        source,
        partial_default=0.5,
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        mlp=activation_from_hf(hf.get("hidden_act", "gelu_new"), source),
        bias=True,
        unembed_bias=True,
    )


def phi2_weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table = [
        Weight("embed_tokens.weight", "embed.weight"),
        Weight("final_layernorm.weight", "ln_final.weight"),
        Weight("final_layernorm.bias", "ln_final.bias"),
        Weight("lm_head.bias", "unembed.bias"),
    ]
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table += _shared_norm(h, b, "input_layernorm", bias=True)
        for theirs, ours in (
            ("self_attn.q_proj", "attn.W_Q"),
            ("self_attn.k_proj", "attn.W_K"),
            ("self_attn.v_proj", "attn.W_V"),
            ("self_attn.dense", "attn.W_O"),
            ("mlp.fc1", "mlp.W_in"),
            ("mlp.fc2", "mlp.W_out"),
        ):
            table += [Weight(h + theirs + end, b + ours + end) for end in (".weight", ".bias")]
    if not cfg.tie_embeddings:
        table.append(Weight("lm_head.weight", "unembed.weight"))
    return table


PHI2 = Architecture(
    model_types=("phi",),
    read_prefixes=("model.",),
    write_prefix="model.",
    head_keys=("lm_head.weight", "lm_head.bias"),
    ignored=(),
    config_from_hf=phi2_config,
    config_to_hf=refuse_writing("Phi-2"),
    weights=phi2_weights,
)
