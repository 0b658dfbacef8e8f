"""Gemma 3 (Gemma Team 2025) as a GGUF file holds it: the metadata as a Hugging Face
Gemma3TextConfig-style dict (attnlab.formats.gguf.hf_config makes it) onto ModelConfig, and the
weight-name table.

Design choices:
- Every part of Gemma 3 is a ModelConfig setting, named for what it does: sandwich norms
  (`sandwich_norm`: post_attention_layernorm and post_feedforward_layernorm norm each sublayer's
  output before the residual add; pre_feedforward_layernorm is the MLP's pre-norm, ln2), the
  embedding times √d_model (`scale_embed`), QK-norm (`qk_norm`: an RMSNorm over each head's d_head,
  as Qwen3's), sliding-window blocks interleaved with global ones (`sliding_window`,
  `sliding_window_pattern`: five of six windowed), each kind with its own RoPE base
  (`rope_theta_local` on the windowed blocks, unscaled; `rope_theta` and any scaling on the global
  ones), the gated MLP with the tanh GELU (`mlp="geglu_tanh"`), queries scaled by
  query_pre_attn_scalar^(-1/2) (`attn_scale`), the final logit soft-cap where the file has one
  (`logit_softcap`) and the tied embedding.
- Gemma's RMSNorm multiplies by (1 + w) and its Hugging Face checkpoints store w; llama.cpp's
  converter adds the 1 to every norm weight (convert_hf_to_gguf.py, Gemma3Model.norm_shift), and
  llama.cpp's graph multiplies by the stored value. So a GGUF file holds the multiplier itself,
  which is what attnlab's RMSNorm multiplies by: the file's values load as they are (transformers'
  reader subtracts the 1 and its model adds it back). A Hugging Face Gemma 3 directory, whose
  norms lack the 1, is not read through this table (attnlab.formats.hf does not list it), and
  attnlab writes no Gemma 3 directory.
- Gemma (the first, `gemma`: GemmaModel in convert_hf_to_gguf.py, which adds the 1 as well) is the
  same table without the sandwich norms, the QK-norm, the windows and the soft-cap: LLaMA's two
  norms per block (input_layernorm, post_attention_layernorm), the GeGLU MLP, √d_model on the
  embedding, 1/sqrt(head_dim) on the queries, the tied embedding (`GEMMA`).
- Gemma 2 (`gemma2`: Gemma2Model in convert_hf_to_gguf.py, the 1 added too) is Gemma 3's table
  without the QK-norm, with an attention soft-cap (`attn_softcap`: the scores c·tanh(s / c), c =
  attn_logit_softcapping, before the mask) and the final logit soft-cap, its window on every other
  block (sliding_window_pattern 2: blocks 0, 2, ... windowed) and one RoPE base for all blocks
  (`GEMMA2`). Where llama.cpp's runtime (src/models/gemma2.cpp) and transformers' modeling_gemma2.py
  differ, attnlab computes the file as llama.cpp does, as the file's users run it
  (attnlab.formats.gguf._gemma_settings): the query scale is 1/sqrt(head_dim), or
  1/sqrt(d_model / n_heads) for the 46-block 27B, whatever query_pre_attn_scalar was (the
  converter does not write it; transformers reads it: the same values for the published
  checkpoints); the window is the file's sliding_window, default 4096, and the pattern the
  file's, default 2.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelConfig
from .architecture import (
    Weight,
    decoder,
    embedding_and_head,
    hf_value,
    llama_projections,
    rope_from_hf,
    sizes_from_hf,
    special_ids,
)

MODEL_TYPE = "gemma3_text"
GEMMA_TYPE = "gemma"
GEMMA2_TYPE = "gemma2"


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UserError(
            f"{source}: hidden_activation {hf['hidden_activation']!r} is not supported for Gemma "
            "3; expected 'gelu_pytorch_tanh' (GeGLU with the tanh GELU)"
        )
    sizes = sizes_from_hf(hf, source)
    d_head = hf_value(hf, "head_dim", source)
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise UserError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    model_type = hf.get("model_type")
    if model_type == GEMMA_TYPE:  # Gemma: none of Gemma 3's additions
        window = None
    # the windowed blocks' own RoPE base: Gemma 3's (10,000 unless said); Gemma 2's only if said
    local = hf.get("rope_local_base_freq", 10000.0 if model_type == MODEL_TYPE else None)
    scalar = hf.get("query_pre_attn_scalar", d_head)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not scalar > 0:
        raise UserError(f"{source}: query_pre_attn_scalar must be positive, got {scalar!r}")
    return ModelConfig(
        **sizes,
        n_kv_heads=hf.get("num_key_value_heads") or sizes["n_heads"],
        d_head=d_head,
        **rope_from_hf(hf, source, d_head),
        rope_theta_local=float(local) if window and local is not None else None,
        sliding_window=window,
        sliding_window_pattern=hf.get("sliding_window_pattern") if window else None,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        sandwich_norm=model_type != GEMMA_TYPE,
        scale_embed=True,
        mlp="geglu_tanh",
        bias=False,
        qk_norm=model_type == MODEL_TYPE,
        attn_scale=None if scalar == d_head else float(scalar) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping") if model_type == GEMMA2_TYPE else None,
        logit_softcap=hf.get("final_logit_softcapping"),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        extra=special_ids(hf),
    )


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table, head = embedding_and_head(cfg)
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table.append(Weight(h + "input_layernorm.weight", b + "ln1.weight"))
        if cfg.sandwich_norm:
            table += [
                Weight(h + "post_attention_layernorm.weight", b + "ln1_post.weight"),
                Weight(h + "pre_feedforward_layernorm.weight", b + "ln2.weight"),
                Weight(h + "post_feedforward_layernorm.weight", b + "ln2_post.weight"),
            ]
        else:  # Gemma: LLaMA's second norm
            table.append(Weight(h + "post_attention_layernorm.weight", b + "ln2.weight"))
        if cfg.qk_norm:
            table += [
                Weight(h + "self_attn.q_norm.weight", b + "attn.q_norm.weight"),
                Weight(h + "self_attn.k_norm.weight", b + "attn.k_norm.weight"),
            ]
        table += llama_projections(h, b)
    return table + head


# Hugging Face Gemma directories store w, not 1 + w: neither is written (module docstring)
GEMMA = decoder((GEMMA_TYPE,), config_from_hf, weights, "Gemma")
GEMMA2 = decoder((GEMMA2_TYPE,), config_from_hf, weights, "Gemma 2")
GEMMA3 = decoder((MODEL_TYPE,), config_from_hf, weights, "Gemma 3")
