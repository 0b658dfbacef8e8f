"""The tiny architecture styles the tests build, each declared once (as transformers keeps one model
tester per architecture): `build("llama-gqa")` is a small random Llama-style model.

Design choices:
- A style is the ModelConfig fields that make an architecture what it is (positions, norm, MLP,
  biases, grouped key/value heads, windows, ...), never its sizes: SIZES is the default tiny size,
  and a test that needs other sizes (or one more part) says so at the call,
  `build("llama-gqa", d_model=64)`, so every number a test reads stands in that test.
- `build` draws every parameter from N(0, std) with torch's global generator, after the model is
  cast to `dtype`: the `seed` fixture (conftest.py) or the test seeds it. Larger than the init's
  0.02, so patterns are far from uniform and greedy choices are not near-ties.
- A test that keeps its own init (trained-size weights, only the matrices) takes the fields with
  `fields(name, **changes)` or `config(name, **changes)` and builds the model itself.
"""

from __future__ import annotations

import torch

import attnlab
from attnlab.model.config import ModelConfig

SIZES = dict(d_vocab=29, n_ctx=64, d_model=32, n_layers=2, n_heads=4, d_mlp=48)  # d_head 8

# Llama's parts: RoPE, RMSNorm, SwiGLU, no biases
LLAMA = dict(positional="rope", norm="rmsnorm", mlp="swiglu", bias=False)
# Pythia (GPT-NeoX): attention and MLP in parallel, a quarter of each head rotated
PYTHIA = dict(parallel_residual=True, positional="rope", rotary_fraction=0.25)
STYLES = {
    # GPT-2 as ModelConfig's defaults: learned positions, pre-norm LayerNorm, GELU, biases, tied
    "gpt": dict(),
    "gpt2": dict(mlp="gelu_tanh"),
    # the original Transformer's post-norm blocks
    "gpt-post-norm": dict(norm_placement="post"),
    # Llama: its parts, grouped key/value heads, an untied head
    "llama-gqa": dict(LLAMA, n_kv_heads=2, tie_embeddings=False),
    # Mistral: Llama's parts with a window of 4 keys, the head tied
    "mistral-window": dict(LLAMA, n_kv_heads=2, sliding_window=4),
    # Qwen2: biases on q, k and v (and the other linears), a window of 8 keys
    "qwen-qkv-bias-window": dict(
        positional="rope", qkv_bias=True, norm="rmsnorm", mlp="swiglu", sliding_window=8
    ),
    # Qwen3's QK-norm with partial RoPE, q/k/v biases only, one key/value head
    "qwen-qk-norm-partial-rope": dict(
        positional="rope",
        rotary_fraction=0.5,
        qk_norm=True,
        norm="rmsnorm",
        qkv_bias=True,
        bias=False,
        n_kv_heads=1,
    ),
    "sinusoidal-attn-only": dict(positional="sinusoidal", attn_only=True),
    "pythia-parallel": PYTHIA,
    # ... with Llama 3's RoPE scaling
    "pythia-parallel-llama3-rope": dict(
        PYTHIA,
        mlp="gelu",
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_original_n_ctx=16,
    ),
    # the speedrun's parts (modded-nanogpt): ReLU², no biases, logit soft-cap
    "speedrun-relu2-softcap": dict(
        positional="rope", norm="rmsnorm", mlp="relu2", bias=False, logit_softcap=3.0
    ),
    # Gemma 3's shape: GeGLU, sandwich norms, √d_model on the embedding, QK-norm, one key-value
    # head of its own size, block 0 windowed with its own RoPE base and block 1 global
    "gemma3": dict(
        positional="rope",
        norm="rmsnorm",
        mlp="geglu_tanh",
        bias=False,
        sandwich_norm=True,
        scale_embed=True,
        qk_norm=True,
        n_kv_heads=1,
        d_head=16,
        attn_scale=0.2,
        sliding_window=4,
        sliding_window_pattern=2,
        rope_theta=1_000_000.0,
        rope_theta_local=10_000.0,
    ),
    # Gemma 2's shape: Gemma 3's without QK-norm or a RoPE base of its own, its attention scores and
    # logits soft-capped (caps low enough to bend N(0, 0.3) weights' scores)
    "gemma2": dict(
        positional="rope",
        norm="rmsnorm",
        mlp="geglu_tanh",
        bias=False,
        sandwich_norm=True,
        scale_embed=True,
        n_kv_heads=2,
        sliding_window=4,
        sliding_window_pattern=2,
        attn_softcap=1.5,
        logit_softcap=3.0,
    ),
    # OLMo 2's shape: Llama's parts, norms only after attention and the MLP, an RMSNorm over the
    # whole of q and of k, an untied head
    "olmo2": dict(
        **LLAMA,
        sandwich_norm=True,
        input_norms=False,
        qk_norm=True,
        qk_norm_whole=True,
        n_kv_heads=2,
        tie_embeddings=False,
    ),
}


def fields(name: str, **changes) -> dict:
    """The style's ModelConfig fields with `changes` (sizes or parts) over them; no sizes."""
    return {**STYLES[name], **changes}


def config(name: str, **changes) -> ModelConfig:
    """The style at SIZES, with `changes` over both."""
    return ModelConfig(**{**SIZES, **STYLES[name], **changes})


def build(
    name: str, *, dtype: torch.dtype = torch.float32, std: float = 0.3, **changes
) -> attnlab.Transformer:
    """A model of the style at SIZES (with `changes`), in eval mode, cast to `dtype`, every
    parameter drawn from N(0, std) by torch's global generator."""
    return randomize(attnlab.Transformer(config(name, **changes)).to(dtype).eval(), std)


def randomize(model: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    """`model` with every parameter drawn from N(0, std), in order, by torch's global generator."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model
