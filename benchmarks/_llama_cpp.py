"""llama.cpp as the anchor of the generation benchmark: attnlab's LLaMA-style weights written as
GGUF, then `llama-bench -p 0 -n N -t THREADS` on them in float32 and in Q8_0 (made by
`llama-quantize`).

llama.cpp is never a dependency: point `--llama-cpp DIR` (or $ATTNLAB_LLAMA_CPP) at a folder holding
the `llama-bench` and `llama-quantize` binaries, built from the sources inside the PyPI sdist of
llama-cpp-python (benchmarks/README.md, "Generation at llama.cpp's speed", has the commands). The
GGUF writer is llama.cpp's own `gguf` Python package (gguf-py in the same sources; `--gguf-py DIR`
or $ATTNLAB_GGUF_PY, or an installed `gguf`).

Design choices:
- The GGUF holds the very tensors of the attnlab model, float32, under llama.cpp's names
  (token_embd, blk.N.attn_q, ...). llama.cpp rotates interleaved pairs where attnlab (and Hugging
  Face) rotate the two halves of each head, so W_Q and W_K rows are permuted the way llama.cpp's
  convert_hf_to_gguf.py permutes them: the same model, as the converter would have written it.
- No tokenizer: `tokenizer.ggml.model = "none"` with the vocabulary size; llama-bench feeds token
  ids.
- llama-bench's JSON output gives the mean of tokens/s over its repetitions.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch


def find_tools(directory: str | None) -> dict[str, Path] | None:
    """{"bench": llama-bench, "quantize": llama-quantize} in `directory` (or $ATTNLAB_LLAMA_CPP), or
    None."""
    directory = directory or os.environ.get("ATTNLAB_LLAMA_CPP")
    if not directory:
        return None
    tools = {
        "bench": Path(directory) / "llama-bench",
        "quantize": Path(directory) / "llama-quantize",
    }
    missing = [str(p) for p in tools.values() if not p.is_file()]
    if missing:
        raise SystemExit(
            f"--llama-cpp {directory}: no {', '.join(missing)}; build llama-bench and "
            "llama-quantize there"
        )
    return tools


def import_gguf(gguf_py: str | None):
    path = gguf_py or os.environ.get("ATTNLAB_GGUF_PY")
    if path:
        sys.path.insert(0, str(path))
    try:
        return importlib.import_module("gguf")
    except ImportError:
        raise SystemExit(
            "writing GGUF needs llama.cpp's gguf package: --gguf-py <llama.cpp>/gguf-py "
            "(or $ATTNLAB_GGUF_PY, or pip install gguf)"
        ) from None


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of W_Q / W_K from rotate-half order to llama.cpp's interleaved pairs (as
    convert_hf_to_gguf.py does)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(model, path: Path, gguf) -> Path:
    """The LLaMA-style attnlab `model` (RoPE, RMSNorm, SwiGLU, no biases) as a float32 GGUF file."""
    cfg = model.config
    if not (
        cfg.positional == "rope"
        and cfg.norm == "rmsnorm"
        and cfg.mlp == "swiglu"
        and not cfg.use_qkv_bias
    ):
        raise ValueError("write_gguf writes LLaMA-style models (rope, rmsnorm, swiglu, no biases)")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.n_ctx)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_mlp)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.d_head)
    writer.add_value_length(cfg.d_head)
    writer.add_rope_dimension_count(cfg.rotary_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.d_vocab)
    writer.add_tokenizer_model("none")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    def add(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, tensor.detach().float().contiguous().numpy())

    add("token_embd.weight", model.embed.weight)
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        add(f"blk.{i}.attn_norm.weight", block.ln1.weight)
        add(f"blk.{i}.attn_q.weight", rope_permute(attn.W_Q.weight, cfg.n_heads))
        add(f"blk.{i}.attn_k.weight", rope_permute(attn.W_K.weight, cfg.n_kv_heads))
        add(f"blk.{i}.attn_v.weight", attn.W_V.weight)
        add(f"blk.{i}.attn_output.weight", attn.W_O.weight)
        add(f"blk.{i}.ffn_norm.weight", block.ln2.weight)
        add(f"blk.{i}.ffn_gate.weight", mlp.W_gate.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.W_in.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.W_out.weight)
    add("output_norm.weight", model.ln_final.weight)
    if not cfg.tie_embeddings:
        add("output.weight", model.unembed.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_q8_0(tools: dict[str, Path], source: Path, target: Path) -> Path:
    subprocess.run(
        [str(tools["quantize"]), str(source), str(target), "Q8_0"], check=True, capture_output=True
    )
    return target


def bench(
    tools: dict[str, Path],
    model_file: Path,
    new_tokens: int,
    threads: int,
    repetitions: int = 3,
    clock: str = "wall",
) -> float:
    """llama-bench's generation figure, tokens/s (its mean over `repetitions`).

    clock "cpu": the CPU time llama-bench used for the tokens (with one thread, what an idle core
    would take),
    from getrusage of the child: an N-token run less a 1-token one (both load the model and warm up
    once). The 1-token run is repeated with every N-token one, not measured once: on a shared
    machine the load, and so the cost of loading, changes from round to round."""

    def run(n: int) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(
            [
                str(tools["bench"]),
                "-m",
                str(model_file),
                "-p",
                "0",
                "-n",
                str(n),
                "-t",
                str(threads),
                "-r",
                str(repetitions),
                "-o",
                "json",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        (row,) = json.loads(result.stdout)
        return row["avg_ts"], (after.ru_utime + after.ru_stime) - (
            before.ru_utime + before.ru_stime
        )

    rate, seconds = run(new_tokens)
    if clock == "cpu":
        _, one = run(1)
        rate = repetitions * (new_tokens - 1) / (seconds - one)
    return rate
