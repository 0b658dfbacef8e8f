"""GPT-NeoX (Black et al. 2022) and Pythia (Biderman et al. 2023) in Hugging Face format:
config.json fields and the weight-name table.

Design choices:
- GPT-NeoX is attnlab with RoPE, LayerNorm and a plain GELU MLP, plus two settings of ModelConfig:
  `parallel_residual` (use_parallel_residual, Pythia's default: attention and MLP both read
  resid_pre) and
  `rotary_fraction` (rotary_pct: Pythia rotates the first quarter of each head's dims, rotate-half
  convention within them, as attnlab.model.positions does). transformers computes rotary_ndims =
  int(d_head * pct); the fraction is stored as that count over d_head, so both sides rotate the same
  dims.
- q, k and v come out of one fused `query_key_value`, interleaved per head: transformers views its
  output as [head, 3 * d_head] and chunks the last dim into q, k, v. The table marks it
  `heads=n_heads`, and attnlab.formats.hf's one conversion splits and rebuilds it head by head.
- The head is `embed_out` (untied), outside the `gpt_neox.` prefix. transformers 5 renames it to
  lm_head when loading and back when saving; Pythia's files and transformers' both say embed_out.
- attention_bias covers query_key_value and dense; the MLP and the LayerNorms always have biases. A
  bias attnlab lacks is written as zeros (and read back as zeros), which computes the same function.
- Old checkpoints saved the causal-mask buffers (attention.bias, attention.masked_bias) and RoPE's
  inverse
  frequencies: not weights, listed as ignored.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelConfig
from .architecture import (
    Architecture,
    Weight,
    activation_from_hf,
    activation_to_hf,
    check_plain_heads,
    check_writable,
    rope_from_hf,
    rope_to_hf,
    sizes_from_hf,
    special_ids,
)


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    sizes = sizes_from_hf(hf, source)
    d_model, n_heads = sizes["d_model"], sizes["n_heads"]
    if d_model % n_heads:
        raise UserError(
            f"{source}: hidden_size ({d_model}) must be divisible by num_attention_heads "
            f"({n_heads})"
        )
    attention_bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        **sizes,
        mlp=activation_from_hf(hf.get("hidden_act", "gelu"), source),
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        parallel_residual=bool(hf.get("use_parallel_residual", True)),
        bias=True,  # the MLP and LayerNorms always have biases
        qkv_bias=attention_bias,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        extra=special_ids(hf),
        **rope_from_hf(hf, source, d_model // n_heads, partial_default=0.25),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    check_writable(
        cfg,
        "GPT-NeoX",
        positional="rope",
        norm="layernorm",
        norm_placement="pre",
        final_norm=True,
        embed_norm=False,
        n_token_types=0,
        attn_only=False,
        qk_norm=False,
        sliding_window=None,
        unembed_bias=False,
    )
    check_plain_heads(cfg, "GPT-NeoX")
    rope = rope_to_hf(cfg)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": cfg.d_vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_mlp,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "hidden_act": activation_to_hf(cfg.mlp),
        "max_position_embeddings": cfg.n_ctx,
        "layer_norm_eps": cfg.norm_eps,
        "use_parallel_residual": cfg.parallel_residual,
        "rope_parameters": {**rope, "partial_rotary_factor": cfg.rotary_dim / cfg.d_head},
        # where transformers 4.x looks
        "rotary_pct": cfg.rotary_dim / cfg.d_head,
        "rotary_emb_base": cfg.rope_theta,
        **({"rope_scaling": rope} if rope["rope_type"] != "default" else {}),
        "attention_bias": cfg.bias or cfg.use_qkv_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.dropout,
        "hidden_dropout": cfg.dropout,
        **special_ids(cfg.extra),
    }


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    attention_bias = bool(hf.get("attention_bias", True))
    table = [
        Weight("embed_in.weight", "embed.weight"),
        Weight("final_layer_norm.weight", "ln_final.weight"),
        Weight("final_layer_norm.bias", "ln_final.bias"),
    ]
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table += [
            Weight(h + "input_layernorm.weight", b + "ln1.weight"),
            Weight(h + "input_layernorm.bias", b + "ln1.bias"),
            Weight(h + "post_attention_layernorm.weight", b + "ln2.weight"),
            Weight(h + "post_attention_layernorm.bias", b + "ln2.bias"),
            Weight(
                h + "attention.query_key_value.weight",
                b + "attn.W_Q.weight",
                b + "attn.W_K.weight",
                b + "attn.W_V.weight",
                heads=cfg.n_heads,
            ),
            Weight(h + "attention.dense.weight", b + "attn.W_O.weight"),
            Weight(h + "mlp.dense_h_to_4h.weight", b + "mlp.W_in.weight"),
            Weight(h + "mlp.dense_h_to_4h.bias", b + "mlp.W_in.bias"),
            Weight(h + "mlp.dense_4h_to_h.weight", b + "mlp.W_out.weight"),
            Weight(h + "mlp.dense_4h_to_h.bias", b + "mlp.W_out.bias"),
        ]
        if attention_bias:
            table += [
                Weight(
                    h + "attention.query_key_value.bias",
                    b + "attn.W_Q.bias",
                    b + "attn.W_K.bias",
                    b + "attn.W_V.bias",
                    heads=cfg.n_heads,
                ),
                Weight(h + "attention.dense.bias", b + "attn.W_O.bias"),
            ]
    if not cfg.tie_embeddings:
        table.append(Weight("embed_out.weight", "unembed.weight"))
    return table


GPT_NEOX = Architecture(
    model_types=("gpt_neox",),
    read_prefixes=("gpt_neox.",),
    write_prefix="gpt_neox.",
    head_keys=("embed_out.weight",),
    # Saved buffers of old checkpoints (causal masks, RoPE frequencies); a tied head saved anyway.
    ignored=(
        r"layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",
        r"rotary_emb\.inv_freq",
        r"embed_out\.weight",
    ),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    weights=weights,
)
