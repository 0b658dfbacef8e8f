"""BERT (Devlin et al. 2019) and MiniLM in Hugging Face format: config.json fields and the
weight-name table.

Design choices:
- BERT is attnlab's encoder setting: bidirectional attention, post-norm blocks (the original
  Transformer's Add & Norm), a LayerNorm right after the embeddings, token-type (segment) embeddings
  and learned absolute positions counted from 0, no final norm and no LM head: `model(ids)` returns
  the last hidden states, as transformers' BertModel does.
- The heads on top of the encoder (the pooler, the masked-LM and next-sentence heads of
  BertForPreTraining) are not part of attnlab's encoder; they are skipped by name, as AutoModel
  skips them.
- Writing produces a BertModel directory (no pooler); a model without token types gets one all-zero
  token-type row, since BERT always adds one.
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
    sizes_from_hf,
    special_ids,
)


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise UserError(
            f"{source}: BERT as a decoder (is_decoder / add_cross_attention) is not supported; "
            "attnlab reads BERT as an encoder"
        )
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(
            f"{source}: position_embedding_type {hf['position_embedding_type']!r} is not "
            "supported; "
            "attnlab reads absolute positions only"
        )
    return ModelConfig(
        **sizes_from_hf(hf, source),
        causal=False,
        mlp=activation_from_hf(hf.get("hidden_act", "gelu"), source),
        norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_placement="post",
        final_norm=False,
        embed_norm=True,
        n_token_types=hf.get("type_vocab_size", 2),
        tie_embeddings=False,
        extra=special_ids(hf),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    check_writable(
        cfg,
        "BERT",
        positional="learned",
        norm="layernorm",
        norm_placement="post",
        final_norm=False,
        embed_norm=True,
        attn_only=False,
        qk_norm=False,
        parallel_residual=False,
        unembed_bias=False,
    )
    check_plain_heads(cfg, "BERT")
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": cfg.d_vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_mlp,
        "hidden_act": activation_to_hf(cfg.mlp),
        "max_position_embeddings": cfg.n_ctx,
        "type_vocab_size": max(cfg.n_token_types, 1),
        "layer_norm_eps": cfg.norm_eps,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        **special_ids(cfg.extra, pad_default=0),
    }


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    table = [
        Weight("embeddings.word_embeddings.weight", "embed.weight"),
        Weight("embeddings.position_embeddings.weight", "pos_embed.weight"),
        Weight("embeddings.token_type_embeddings.weight", "token_type_embed.weight"),
        Weight("embeddings.LayerNorm.weight", "ln_embed.weight"),
        Weight("embeddings.LayerNorm.bias", "ln_embed.bias"),
    ]
    for i in range(cfg.n_layers):
        h, b = f"encoder.layer.{i}.", f"blocks.{i}."
        for theirs, ours in (
            ("attention.self.query", "attn.W_Q"),
            ("attention.self.key", "attn.W_K"),
            ("attention.self.value", "attn.W_V"),
            ("attention.output.dense", "attn.W_O"),
            ("attention.output.LayerNorm", "ln1"),  # Add & Norm after attention
            ("intermediate.dense", "mlp.W_in"),
            ("output.dense", "mlp.W_out"),
            ("output.LayerNorm", "ln2"),  # Add & Norm after the MLP
        ):
            table += [
                Weight(h + theirs + ".weight", b + ours + ".weight"),
                Weight(h + theirs + ".bias", b + ours + ".bias"),
            ]
    return table


BERT = Architecture(
    model_types=("bert",),
    read_prefixes=("bert.",),
    write_prefix="",
    head_keys=(),
    # Buffers saved by older versions, and the heads on top of the encoder (see the module
    # docstring).
    ignored=(r"embeddings\.(position_ids|token_type_ids)", r"pooler\..*", r"cls\..*"),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    weights=weights,
)
