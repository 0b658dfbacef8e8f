"""StarCoder2 (Lozhkov et al. 2024): config.json fields onto ModelConfig and the weight names (read
from GGUF files; attnlab.formats.gguf makes the config dict from their metadata).

Design choices:
- StarCoder2 is GPT-2's block in LLaMA's layout: LayerNorm with biases, a plain MLP (c_fc, the
  tanh GELU, c_proj) with biases, biases on every attention projection (use_bias), RoPE on every
  dim of a head (rotate-half convention; llama.cpp's starcoder2 graph asserts the same) and
  grouped-query attention.
- sliding_window windows every layer (ModelConfig.sliding_window), as transformers computes a
  directory; a GGUF file is read without it, as llama.cpp's starcoder2 graph runs it (it reads no
  window).
"""

from __future__ import annotations

from ..model.config import ModelConfig
from .architecture import (
    Weight,
    activation_from_hf,
    decoder,
    decoder_config,
    embedding_and_head,
)

MODEL_TYPE = "starcoder2"


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    return decoder_config(
        hf,
        source,
        tie_default=True,
        sliding_window=hf.get("sliding_window") or None,
        norm="layernorm",
        norm_eps=hf.get("norm_epsilon", 1e-5),
        mlp=activation_from_hf(hf.get("hidden_act", "gelu_pytorch_tanh"), source),
        bias=bool(hf.get("use_bias", True)),
    )


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table, head = embedding_and_head(cfg, final_norm_bias=True)
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        pairs = [
            ("input_layernorm", "ln1"),
            ("post_attention_layernorm", "ln2"),
            ("self_attn.q_proj", "attn.W_Q"),
            ("self_attn.k_proj", "attn.W_K"),
            ("self_attn.v_proj", "attn.W_V"),
            ("self_attn.o_proj", "attn.W_O"),
            ("mlp.c_fc", "mlp.W_in"),
            ("mlp.c_proj", "mlp.W_out"),
        ]
        for theirs, ours in pairs:
            table.append(Weight(h + theirs + ".weight", b + ours + ".weight"))
            if cfg.bias:
                table.append(Weight(h + theirs + ".bias", b + ours + ".bias"))
    return table + head


STARCODER2 = decoder((MODEL_TYPE,), config_from_hf, weights, "StarCoder2")
