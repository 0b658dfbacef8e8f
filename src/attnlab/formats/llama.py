"""LLaMA (Touvron et al. 2023) and Qwen2 in Hugging Face format: config.json fields and the weight-name table.

Design choices:
- One table for both: Qwen2 is LLaMA with biases on q, k and v only (attnlab: bias=False, qkv_bias=True).
  TinyLlama- and SmolLM-style checkpoints are plain `llama`.
- RoPE: transformers' llama rotates every dim of a head in the rotate-half convention, exactly as
  attnlab.positions does. rope_type default, linear and llama3 (Llama 3.1/3.2's context extension) are read
  into ModelConfig.rope_scaling and written back; others (yarn, dynamic, ...) are refused by name.
  transformers' default RoPE ignores partial_rotary_factor for llama, so attnlab does too, to compute the
  same function.
- LLaMA's attention_bias (q, k, v, o) and mlp_bias are separate switches; attnlab has `bias` (all linear
  layers) and `qkv_bias`. A combination attnlab cannot name is read with the missing biases as zeros,
  which computes the same function.
- Writing: a model with qkv biases and no others becomes `qwen2`, every other bias pattern `llama`
  (biases attnlab lacks are written as zeros).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import UserError
from .hf import Architecture, Weight, check_writable, rope_from_hf, rope_to_hf, sizes_from_hf, special_ids


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported for {model_type}; expected 'silu' (SwiGLU)")
    if model_type == "qwen2":
        layer_types = hf.get("layer_types") or []
        if "sliding_attention" in layer_types or (hf.get("use_sliding_window") and hf.get("max_window_layers", 0) < hf.get("num_hidden_layers", 0)):
            raise UserError(f"{source}: sliding-window attention is not supported; set use_sliding_window=false")
        bias, qkv_bias = False, True
    else:
        attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        bias = attention_bias or mlp_bias
        qkv_bias = attention_bias if bias else None
    sizes = sizes_from_hf(hf, source)
    d_model, n_heads = sizes["d_model"], sizes["n_heads"]
    head_dim = hf.get("head_dim") or d_model // n_heads
    return ModelConfig(
        **sizes,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=None if head_dim * n_heads == d_model else head_dim,
        **rope_from_hf(hf, source, head_dim),
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        bias=bias,
        qkv_bias=qkv_bias,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        extra=special_ids(hf),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    check_writable(cfg, "LLaMA", positional="rope", norm="rmsnorm", norm_placement="pre", final_norm=True,
                   embed_norm=False, mlp="swiglu", n_token_types=0, attn_only=False, qk_norm=False, rotary_fraction=1.0,
                   parallel_residual=False)
    if cfg.attn_scale not in (None, cfg.head_dim**-0.5):
        raise UserError(f"cannot save as Hugging Face LLaMA: attn_scale={cfg.attn_scale} (LLaMA uses 1/sqrt(d_head)); "
                        "use format='attnlab'")
    qwen2 = cfg.use_qkv_bias and not cfg.bias
    hf = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.d_vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_to_hf(cfg),
        "rope_theta": cfg.rope_theta,  # where transformers 4.x looks (and for its scaling, rope_scaling below)
        **({"rope_scaling": rope_to_hf(cfg)} if cfg.rope_scaling != "none" else {}),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.dropout,
        **special_ids(cfg.extra),
    }
    if qwen2:
        hf["use_sliding_window"] = False
    else:
        hf["attention_bias"] = hf["mlp_bias"] = cfg.bias
    return hf


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    if hf.get("model_type") == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    table = [Weight("embed_tokens.weight", "embed.weight"), Weight("norm.weight", "ln_final.weight")]
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table += [
            Weight(h + "input_layernorm.weight", b + "ln1.weight"),
            Weight(h + "post_attention_layernorm.weight", b + "ln2.weight"),
        ]
        linears = [("self_attn.q_proj", "attn.W_Q", qkv_bias), ("self_attn.k_proj", "attn.W_K", qkv_bias),
                   ("self_attn.v_proj", "attn.W_V", qkv_bias), ("self_attn.o_proj", "attn.W_O", o_bias),
                   ("mlp.gate_proj", "mlp.W_gate", mlp_bias), ("mlp.up_proj", "mlp.W_in", mlp_bias),
                   ("mlp.down_proj", "mlp.W_out", mlp_bias)]
        for theirs, ours, has_bias in linears:
            table.append(Weight(h + theirs + ".weight", b + ours + ".weight"))
            if has_bias:
                table.append(Weight(h + theirs + ".bias", b + ours + ".bias"))
    if not cfg.tie_embeddings:
        table.append(Weight("lm_head.weight", "unembed.weight"))
    return table


LLAMA = Architecture(
    model_types=("llama", "qwen2"),
    read_prefixes=("model.",),
    write_prefix="model.",
    head_keys=("lm_head.weight",),
    # Old checkpoints saved RoPE's inverse frequencies (recomputed here); tied models sometimes save the head anyway.
    ignored=(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight"),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    weights=weights,
)
