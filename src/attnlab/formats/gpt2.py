"""GPT-2 (Radford et al. 2019) in Hugging Face format: config.json fields and the weight-name table.

Design choices:
- GPT-2 is attnlab's default setting: learned positions, pre-norm LayerNorm, GELU, biases, tied
  head.
- Its linear layers are `Conv1D`, which stores weights as (in, out): the transpose of nn.Linear. The
  table marks those weights `conv1d=True`, and the one conversion in attnlab.formats.hf transposes
  them.
- q, k and v come out of one fused `c_attn` of width 3 * d_model, in that order; the table lists the
  three attnlab weights it splits into.
- Writing: any bias attnlab does not have (nanoGPT's bias=False) is written as zeros, which computes
  the same function; `scale_attn_weights=false` is attnlab's attn_scale=1.
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
    hf_value,
    special_ids,
)


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(flag):
            raise UserError(
                f"{source}: {flag}=true is not supported by attnlab; only standard GPT-2 "
                "attention is"
            )
    return ModelConfig(
        d_vocab=hf_value(hf, "vocab_size", source),
        n_ctx=hf_value(hf, "n_positions", source, alias="max_position_embeddings"),
        d_model=hf_value(hf, "n_embd", source, alias="hidden_size"),
        n_layers=hf_value(hf, "n_layer", source, alias="num_hidden_layers"),
        n_heads=hf_value(hf, "n_head", source, alias="num_attention_heads"),
        d_mlp=hf.get("n_inner"),
        mlp=activation_from_hf(hf.get("activation_function", "gelu_new"), source),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        extra=special_ids(hf),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    check_writable(
        cfg,
        "GPT-2",
        positional="learned",
        norm="layernorm",
        norm_placement="pre",
        final_norm=True,
        embed_norm=False,
        n_token_types=0,
        attn_only=False,
        qk_norm=False,
        parallel_residual=False,
        sliding_window=None,
        unembed_bias=False,
    )
    check_plain_heads(cfg, "GPT-2", scales=(1.0,))
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.d_vocab,
        "n_positions": cfg.n_ctx,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_mlp,
        "activation_function": activation_to_hf(cfg.mlp),
        "layer_norm_epsilon": cfg.norm_eps,
        "scale_attn_weights": cfg.attn_scale != 1.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        **special_ids(cfg.extra),
    }


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table = [
        Weight("wte.weight", "embed.weight"),
        Weight("wpe.weight", "pos_embed.weight"),
        Weight("ln_f.weight", "ln_final.weight"),
        Weight("ln_f.bias", "ln_final.bias"),
    ]
    for i in range(cfg.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        table += [
            Weight(h + "ln_1.weight", b + "ln1.weight"),
            Weight(h + "ln_1.bias", b + "ln1.bias"),
            Weight(
                h + "attn.c_attn.weight",
                b + "attn.W_Q.weight",
                b + "attn.W_K.weight",
                b + "attn.W_V.weight",
                conv1d=True,
            ),
            Weight(
                h + "attn.c_attn.bias",
                b + "attn.W_Q.bias",
                b + "attn.W_K.bias",
                b + "attn.W_V.bias",
            ),
            Weight(h + "attn.c_proj.weight", b + "attn.W_O.weight", conv1d=True),
            Weight(h + "attn.c_proj.bias", b + "attn.W_O.bias"),
            Weight(h + "ln_2.weight", b + "ln2.weight"),
            Weight(h + "ln_2.bias", b + "ln2.bias"),
            Weight(h + "mlp.c_fc.weight", b + "mlp.W_in.weight", conv1d=True),
            Weight(h + "mlp.c_fc.bias", b + "mlp.W_in.bias"),
            Weight(h + "mlp.c_proj.weight", b + "mlp.W_out.weight", conv1d=True),
            Weight(h + "mlp.c_proj.bias", b + "mlp.W_out.bias"),
        ]
    if not cfg.tie_embeddings:
        table.append(Weight("lm_head.weight", "unembed.weight"))
    return table


GPT2 = Architecture(
    model_types=("gpt2",),
    read_prefixes=("transformer.",),
    write_prefix="transformer.",
    head_keys=("lm_head.weight",),
    # The causal-mask buffers older GPT-2 checkpoints saved (not weights), and a tied head saved
    # anyway.
    ignored=(r"h\.\d+\.attn\.(bias|masked_bias)", r"lm_head\.weight"),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    weights=weights,
)
