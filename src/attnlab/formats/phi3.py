"""Phi-3 (Abdin et al. 2024) and Phi-4-mini: config.json fields onto ModelConfig and the weight
names (read from GGUF files; attnlab.formats.gguf makes the config dict from their metadata).

Design choices:
- Phi-3 is LLaMA (RMSNorm, SwiGLU, RoPE in the rotate-half convention, no biases) with two fused
  matrices: `qkv_proj` holds all of W_Q's rows, then W_K's, then W_V's, and `gate_up_proj` W_gate's
  rows then W_in's, which the table splits along the rows (llama.cpp keeps both fused, as
  attn_qkv and ffn_up, in the same order: convert_hf_to_gguf.py's Phi3MiniModel writes them as
  they are).
- RoPE may rotate part of each head (partial_rotary_factor: Phi-4-mini's 0.75; transformers'
  Phi3 honours it, as does llama.cpp's rope.dimension_count); `longrope` scaling (the 128k models,
  with their rope_factors tensors) is refused by name.
- sliding_window windows every layer (ModelConfig.sliding_window), as transformers computes a
  Phi-3 directory; a GGUF file is read without it, as llama.cpp runs it (attnlab.formats.gguf).
- attnlab writes no Phi-3 directory.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelConfig
from .architecture import Weight, check_swiglu, decoder, decoder_config, embedding_and_head

MODEL_TYPE = "phi3"


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    check_swiglu(hf, source, "Phi-3")
    window = hf.get("sliding_window") or None
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise UserError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    return decoder_config(
        hf,
        source,
        partial_default=1.0,
        sliding_window=window,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        mlp="swiglu",
        bias=False,
    )


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table, head = embedding_and_head(cfg)
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table += [
            Weight(h + "input_layernorm.weight", b + "ln1.weight"),
            Weight(h + "post_attention_layernorm.weight", b + "ln2.weight"),
            Weight(
                h + "self_attn.qkv_proj.weight",
                b + "attn.W_Q.weight",
                b + "attn.W_K.weight",
                b + "attn.W_V.weight",
            ),
            Weight(h + "self_attn.o_proj.weight", b + "attn.W_O.weight"),
            Weight(h + "mlp.gate_up_proj.weight", b + "mlp.W_gate.weight", b + "mlp.W_in.weight"),
            Weight(h + "mlp.down_proj.weight", b + "mlp.W_out.weight"),
        ]
    return table + head


PHI3 = decoder((MODEL_TYPE,), config_from_hf, weights, "Phi-3")
