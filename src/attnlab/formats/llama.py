"""LLaMA (Touvron et al. 2023), Qwen2, Qwen3 and Mistral in Hugging Face format: config.json fields
and the weight-name table.

Design choices:
- One table for all four; they differ in settings of ModelConfig. Qwen2 is LLaMA with biases on q, k
  and v
  only (attnlab: bias=False, qkv_bias=True). Qwen3 adds an RMSNorm on each head's q and k before
  RoPE (qk_norm, weights self_attn.q_norm / k_norm) and states head_dim explicitly. Mistral is LLaMA
  without biases and with a sliding window (ModelConfig.sliding_window; transformers' window W: a
  query sees itself and the W − 1 keys before it). TinyLlama-, SmolLM- and Llama-3.2-style
  checkpoints are plain `llama`.
- Qwen2/3 choose a window per layer (layer_types, or use_sliding_window with max_window_layers);
  attnlab has one window for every layer, so a config that windows some layers only is refused by
  name.
- RoPE: transformers' llama rotates every dim of a head in the rotate-half convention, exactly as
  attnlab.model.positions does. rope_type default, linear and llama3 (Llama 3.1/3.2's context
  extension) are read into ModelConfig.rope_scaling and written back; others (yarn, dynamic, ...)
  are refused by name. transformers' default RoPE ignores partial_rotary_factor for llama, so
  attnlab does too, to compute the same function.
- LLaMA's attention_bias (q, k, v, o) and mlp_bias are separate switches; attnlab has `bias` (all
  linear layers) and `qkv_bias`. A combination attnlab cannot name is read with the missing biases
  as zeros, which computes the same function.
- Granite (GGUF `granite` files: llama's tensors and permuted q/k rows) is LLaMA with four
  multipliers (ModelConfig.embedding_multiplier, residual_multiplier, attn_scale and logit_scale,
  from embedding_multiplier, residual_multiplier, attention_multiplier and 1 / logits_scaling);
  a model with them is not written as LLaMA.
- Writing: qk-norm makes `qwen3`; q, k, v biases and no others `qwen2`; a sliding window `mistral`;
  every other model `llama` (biases attnlab lacks are written as zeros).
"""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelConfig
from .architecture import (
    Architecture,
    Weight,
    check_writable,
    rope_from_hf,
    rope_to_hf,
    sizes_from_hf,
    special_ids,
)


def _biases(hf: dict) -> tuple[bool, bool, bool]:
    """(q/k/v, o, MLP): which linear layers have biases in this checkpoint."""
    model_type = hf.get("model_type")
    if model_type == "qwen2":
        return True, False, False
    if model_type == "mistral":
        return False, False, False
    attention = bool(hf.get("attention_bias", False))
    return attention, attention, model_type == "llama" and bool(hf.get("mlp_bias", False))


def _sliding_window(hf: dict, source: str) -> int | None:
    """Mistral windows every layer (sliding_window null: none); Qwen2/3 the layers layer_types marks
    (or, in older configs, those from max_window_layers on when use_sliding_window is set)."""
    model_type, window = hf.get("model_type"), hf.get("sliding_window")
    if model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3"):
        n_layers = hf.get("num_hidden_layers", 0)
        windowed = bool(hf.get("use_sliding_window")) and window is not None
        first = hf.get("max_window_layers", n_layers)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if windowed and i >= first else "full_attention"
            for i in range(n_layers)
        ]
        if "sliding_attention" not in layer_types:
            return None
        if set(layer_types) != {"sliding_attention"}:
            raise UserError(
                f"{source}: sliding-window attention on some layers only (layer_types "
                f"{layer_types}) is not "
                "supported; attnlab has one window for every layer"
            )
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window <= 0
    ):
        raise UserError(
            f"{source}: 'sliding_window' must be a positive integer or null, got {window!r}"
        )
    return window


def config_from_hf(hf: dict, source: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(
            f"{source}: hidden_act {hf['hidden_act']!r} is not supported for {model_type}; "
            "expected 'silu' (SwiGLU)"
        )
    qkv, o, mlp = _biases(hf)
    bias = o or mlp
    sizes = sizes_from_hf(hf, source)
    d_model, n_heads = sizes["d_model"], sizes["n_heads"]
    d_head = hf.get("head_dim") or d_model // n_heads
    return ModelConfig(
        **sizes,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=None if d_head * n_heads == d_model else d_head,
        **rope_from_hf(hf, source, d_head),
        sliding_window=_sliding_window(hf, source),
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        bias=bias,
        qkv_bias=None if qkv == bias else qkv,
        qk_norm=model_type == "qwen3",
        tie_embeddings=hf.get("tie_word_embeddings", False),
        extra=special_ids(hf),
        **_granite_multipliers(hf, source),
    )


def _granite_multipliers(hf: dict, source: str) -> dict:
    """Granite's config.json multipliers (a GGUF granite file's metadata, as attnlab.formats.gguf
    reads it): the embedding's, each sublayer output's, the attention scale (in place of
    1/sqrt(d_head)) and the logits' divisor. Absent: none."""
    fields = {}
    for key, name in (
        ("embedding_multiplier", "embedding_multiplier"),
        ("residual_multiplier", "residual_multiplier"),
        ("attention_multiplier", "attn_scale"),
        ("logits_scaling", "logit_scale"),
    ):
        value = hf.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise UserError(f"{source}: {key} must be a positive number, got {value!r}")
        fields[name] = 1.0 / value if key == "logits_scaling" else float(value)
    return fields


def config_to_hf(cfg: ModelConfig) -> dict:
    check_writable(
        cfg,
        "LLaMA",
        positional="rope",
        norm="rmsnorm",
        norm_placement="pre",
        final_norm=True,
        embed_norm=False,
        mlp="swiglu",
        n_token_types=0,
        attn_only=False,
        rotary_fraction=1.0,
        parallel_residual=False,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        logit_scale=1.0,
        unembed_bias=False,
    )
    if cfg.attn_scale not in (None, cfg.d_head**-0.5):
        raise UserError(
            f"cannot save as Hugging Face LLaMA: attn_scale={cfg.attn_scale} (LLaMA uses "
            "1/sqrt(d_head)); "
            "use format='attnlab'"
        )
    if cfg.qk_norm:
        model_type, name = "qwen3", "Qwen3"
        check_writable(
            cfg, "Qwen3 (the LLaMA style with qk_norm; its MLP has no biases)", bias=False
        )
    elif cfg.use_qkv_bias and not cfg.bias:
        model_type, name = "qwen2", "Qwen2"
    elif cfg.sliding_window is not None:
        model_type, name = "mistral", "Mistral"
        check_writable(
            cfg, "Mistral (the LLaMA style with a sliding window; it has no biases)", bias=False
        )
    else:
        model_type, name = "llama", "Llama"
    hf = {
        "architectures": [f"{name}ForCausalLM"],
        "model_type": model_type,
        "vocab_size": cfg.d_vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_mlp,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_to_hf(cfg),
        # where transformers 4.x looks (and for its scaling, rope_scaling below)
        "rope_theta": cfg.rope_theta,
        **({"rope_scaling": rope_to_hf(cfg)} if cfg.rope_scaling != "none" else {}),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.dropout,
        **special_ids(cfg.extra),
    }
    if model_type in ("qwen2", "qwen3"):
        windowed = cfg.sliding_window is not None
        hf.update(
            use_sliding_window=windowed,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if windowed else cfg.n_layers,
            layer_types=[("sliding_attention" if windowed else "full_attention")] * cfg.n_layers,
        )
    if model_type == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    if model_type in ("llama", "qwen3"):
        hf["attention_bias"] = cfg.use_qkv_bias or cfg.bias
    if model_type == "llama":
        hf["mlp_bias"] = cfg.bias
    return hf


def weights(hf: dict, cfg: ModelConfig) -> list[Weight]:
    qkv_bias, o_bias, mlp_bias = _biases(hf)
    table = [
        Weight("embed_tokens.weight", "embed.weight"),
        Weight("norm.weight", "ln_final.weight"),
    ]
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        table += [
            Weight(h + "input_layernorm.weight", b + "ln1.weight"),
            Weight(h + "post_attention_layernorm.weight", b + "ln2.weight"),
        ]
        if hf.get("model_type") == "qwen3":
            table += [
                Weight(h + "self_attn.q_norm.weight", b + "attn.q_norm.weight"),
                Weight(h + "self_attn.k_norm.weight", b + "attn.k_norm.weight"),
            ]
        linears = [
            ("self_attn.q_proj", "attn.W_Q", qkv_bias),
            ("self_attn.k_proj", "attn.W_K", qkv_bias),
            ("self_attn.v_proj", "attn.W_V", qkv_bias),
            ("self_attn.o_proj", "attn.W_O", o_bias),
            ("mlp.gate_proj", "mlp.W_gate", mlp_bias),
            ("mlp.up_proj", "mlp.W_in", mlp_bias),
            ("mlp.down_proj", "mlp.W_out", mlp_bias),
        ]
        for theirs, ours, has_bias in linears:
            table.append(Weight(h + theirs + ".weight", b + ours + ".weight"))
            if has_bias:
                table.append(Weight(h + theirs + ".bias", b + ours + ".bias"))
    if not cfg.tie_embeddings:
        table.append(Weight("lm_head.weight", "unembed.weight"))
    return table


LLAMA = Architecture(
    model_types=("llama", "qwen2", "qwen3", "mistral"),
    read_prefixes=("model.",),
    write_prefix="model.",
    head_keys=("lm_head.weight",),
    # Old checkpoints saved RoPE's inverse frequencies (recomputed here); tied models sometimes save
    # the head anyway.
    ignored=(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight"),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    weights=weights,
)
