"""OLMo 2 (Team OLMo 2024): config.json fields onto ModelConfig and the weight names (read from
GGUF files; attnlab.formats.gguf makes the config dict from their metadata).

Design choices:
- OLMo 2 is LLaMA's attention and SwiGLU MLP wired with its norms after each sublayer instead of
  before: resid_mid = resid_pre + post_attention_layernorm(attn(resid_pre)), resid_post = resid_mid
  + post_feedforward_layernorm(mlp(resid_mid)). In attnlab that is the sandwich norms without the
  norms before the sublayers (`sandwich_norm=True, input_norms=False`: ln1_post and ln2_post, no
  ln1 or ln2), so the hooks' attn_out and mlp_out are what joins the residual stream.
- Its q_norm and k_norm are RMSNorms over the whole projection (n_heads · d_head for q, n_kv_heads
  · d_head for k), before the heads are split and rotated (`qk_norm_whole`), where Qwen3's norm
  each head.
- The norms store their multiplier (no Gemma-style 1 + w) and the converter keeps the checkpoint's
  q/k rows (llama.cpp rotates halves, as transformers does), so the file's tensors load as they
  are.
- A file with a sliding window (OLMo 3, which llama.cpp's converter also writes as olmo2) is
  refused in one line by attnlab.formats.gguf; attnlab writes no OLMo 2 directory and does not read
  one (its Hugging Face directories are refused by model_type).
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

MODEL_TYPE = "olmo2"


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    check_swiglu(hf, source, "OLMo 2")
    if hf.get("attention_bias"):
        raise UserError(f"{source}: OLMo 2 with attention_bias is not supported")
    return decoder_config(
        hf,
        source,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        sandwich_norm=True,
        input_norms=False,
        qk_norm=True,
        qk_norm_whole=True,
        mlp="swiglu",
        bias=False,
    )


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table, head = embedding_and_head(cfg)
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table += [
            Weight(h + "post_attention_layernorm.weight", b + "ln1_post.weight"),
            Weight(h + "post_feedforward_layernorm.weight", b + "ln2_post.weight"),
            Weight(h + "self_attn.q_norm.weight", b + "attn.q_norm.weight"),
            Weight(h + "self_attn.k_norm.weight", b + "attn.k_norm.weight"),
        ]
        table += llama_projections(h, b)
    return table + head


OLMO2 = decoder((MODEL_TYPE,), config_from_hf, weights, "OLMo 2")
