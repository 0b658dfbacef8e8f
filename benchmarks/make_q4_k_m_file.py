"""A GGUF file of Llama 3.1 8B's shape with random weights in Q4_K_M's mix of block types, written
tensor by tensor (never the whole model in memory): the file a 7-8B download is, without the
download (issue 43, "7-8B files on a 24 GB machine").

Design choices:
- The config is Llama 3.1 8B's (32 blocks, d_model 4096, 32 heads, 8 KV heads, d_mlp 14336,
  128,256 tokens, RoPE base 500,000); `--layers` makes a shallower file of the same widths for a
  quick check.
- The types are llama-quantize's Q4_K_M (llama-quant.cpp, llama_tensor_get_type): Q6_K for the LM
  head, and for attn_v and ffn_down in the blocks where `use_more_bits` holds (the first and last
  eighth, and every third between); Q4_K for every other matrix and the token embedding; the norms
  float32. So the file's size and layout are a real Q4_K_M's.
- The blocks are random bytes with their float16 scales set: each K-quant block's d (and Q4_K's
  dmin) drawn so that the weights' spread is about 0.02, as a freshly initialised model's; every
  byte of quants and 6-bit scales is uniform. Valid blocks, as llama.cpp and attnlab read them.
- The tokenizer is llama.cpp's Llama 3 vocabulary (models/ggml-vocab-llama-bpe.gguf, from the
  llama.cpp sources: `--vocab`), so llama-bench and attnlab read the file as they read a real one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

LLAMA_3_1_8B = {
    "n_layers": 32,
    "d_model": 4096,
    "n_heads": 32,
    "n_kv_heads": 8,
    "d_mlp": 14336,
    "d_vocab": 128256,
    "rope_base": 500000.0,
    "n_ctx": 131072,
}
QK_K = 256
BYTES = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q6_K: 210}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the blocks whose attn_v and ffn_down Q4_K_M makes Q6_K."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensors(cfg: dict) -> list[tuple[str, tuple[int, int] | tuple[int], GGMLQuantizationType]]:
    """(name, (d_out, d_in) or (d,), type) of every tensor, in llama.cpp's converter's order."""
    d, L, f = cfg["d_model"], cfg["n_layers"], cfg["d_mlp"]
    kv = cfg["n_kv_heads"] * d // cfg["n_heads"]
    Q4, Q6, F32 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32
    out = [("token_embd.weight", (cfg["d_vocab"], d), Q4)]
    for i in range(L):
        more = Q6 if use_more_bits(i, L) else Q4
        out += [
            (f"blk.{i}.attn_norm.weight", (d,), F32),
            (f"blk.{i}.attn_q.weight", (d, d), Q4),
            (f"blk.{i}.attn_k.weight", (kv, d), Q4),
            (f"blk.{i}.attn_v.weight", (kv, d), more),
            (f"blk.{i}.attn_output.weight", (d, d), Q4),
            (f"blk.{i}.ffn_norm.weight", (d,), F32),
            (f"blk.{i}.ffn_gate.weight", (f, d), Q4),
            (f"blk.{i}.ffn_up.weight", (f, d), Q4),
            (f"blk.{i}.ffn_down.weight", (d, f), more),
        ]
    return out + [("output_norm.weight", (d,), F32), ("output.weight", (cfg["d_vocab"], d), Q6)]


def random_blocks(
    shape: tuple[int, int], kind: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """Random valid blocks of `kind` for a (d_out, d_in) matrix: uint8 (d_out, row bytes)."""
    d_out, d_in = shape
    n = d_out * d_in // QK_K
    b = np.frombuffer(bytearray(rng.bytes(n * BYTES[kind])), dtype=np.uint8).reshape(n, -1)
    if kind == GGMLQuantizationType.Q4_K:
        # w = d sc n - dmin m, sc and m up to 63, n up to 15: d ~ 0.02 / (32 * 8)
        d = rng.uniform(0.5e-4, 1.5e-4, size=(n, 2)).astype(np.float16)
        d[:, 1] *= 8  # dmin: the mins centre the nibbles
        b[:, 0:4] = d.view(np.uint8)
    else:  # Q6_K: w = d sc (n - 32), sc int8, n up to 63; d last
        b[:, 208:210] = rng.uniform(0.5e-5, 1.5e-5, size=(n, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(d_out, -1)


def copy_vocabulary(writer: GGUFWriter, vocab: Path) -> None:
    """Every tokenizer.* key of llama.cpp's vocabulary file, as it holds it."""
    reader = GGUFReader(vocab)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, kind)


def write(path: Path, cfg: dict, vocab: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    writer.add_name("random Llama-3.1-8B-shaped")
    writer.add_block_count(cfg["n_layers"])
    writer.add_context_length(cfg["n_ctx"])
    writer.add_embedding_length(cfg["d_model"])
    writer.add_feed_forward_length(cfg["d_mlp"])
    writer.add_head_count(cfg["n_heads"])
    writer.add_head_count_kv(cfg["n_kv_heads"])
    writer.add_rope_freq_base(cfg["rope_base"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(cfg["d_model"] // cfg["n_heads"])
    writer.add_vocab_size(cfg["d_vocab"])
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    writer.add_quantization_version(2)
    copy_vocabulary(writer, vocab)
    plan = tensors(cfg)
    for name, shape, kind in plan:
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            nbytes = shape[0] * shape[1] // QK_K * BYTES[kind]
            # gguf-py takes a quantized tensor's shape in bytes per row
            byte_shape = (shape[0], shape[1] // QK_K * BYTES[kind])
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, kind in plan:
        if kind == GGMLQuantizationType.F32:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(shape, kind, rng))
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument(
        "--vocab", type=Path, required=True, help="llama.cpp's ggml-vocab-llama-bpe.gguf"
    )
    p.add_argument("--layers", type=int, default=LLAMA_3_1_8B["n_layers"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args.out, {**LLAMA_3_1_8B, "n_layers": args.layers}, args.vocab, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
