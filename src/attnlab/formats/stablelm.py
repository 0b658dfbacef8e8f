"""StableLM 2 (Bellagente et al. 2024) and StableLM-3B-4E1T: config.json fields onto ModelConfig
and the weight names (read from GGUF files; attnlab.formats.gguf makes the config dict from their
metadata).

Design choices:
- StableLM is LLaMA's block (SwiGLU, RoPE in the rotate-half convention, grouped-query) with
  LayerNorm (weight and bias) where LLaMA has RMSNorm, RoPE on the first partial_rotary_factor of
  each head's dims (0.25; llama.cpp's rope.dimension_count), and biases on q, k and v where
  use_qkv_bias says so. attnlab's `bias=True` gives the LayerNorms their biases; the linear layers
  that have none in the checkpoint (o_proj, the MLP) are read as zeros, which computes the same
  function.
- Two variants are refused by name: use_parallel_residual (attention and MLP reading one shared
  norm, which attnlab's parallel block, with a norm each, does not express) and qk_layernorm
  (StableLM 2 12B's per-head LayerNorm on q and k).
- attnlab writes no StableLM directory.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelConfig
from .architecture import (
    Weight,
    check_swiglu,
    decoder,
    decoder_config,
    embedding_and_head,
    llama_projections,
)

MODEL_TYPE = "stablelm"


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    check_swiglu(hf, source, "StableLM")
    for key, what in (
        ("use_parallel_residual", "attention and MLP reading one shared norm"),
        ("qk_layernorm", "a LayerNorm on each head's q and k"),
    ):
        if hf.get(key):
            raise UserError(f"{source}: StableLM with {key} ({what}) is not supported")
    return decoder_config(
        hf,
        source,
        partial_default=0.25,
        norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        mlp="swiglu",
        bias=True,  # the LayerNorms' (the linear layers without one read as zeros)
        qkv_bias=bool(hf.get("use_qkv_bias", False)),
    )


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table, head = embedding_and_head(cfg, final_norm_bias=True)
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        for theirs, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
            table += [
                Weight(h + theirs + ".weight", b + ours + ".weight"),
                Weight(h + theirs + ".bias", b + ours + ".bias"),
            ]
        table += llama_projections(h, b)
        if cfg.use_qkv_bias:
            for theirs, ours in (("q_proj", "W_Q"), ("k_proj", "W_K"), ("v_proj", "W_V")):
                table.append(Weight(h + f"self_attn.{theirs}.bias", b + f"attn.{ours}.bias"))
    return table + head


STABLELM = decoder((MODEL_TYPE,), config_from_hf, weights, "StableLM")
