"""GGUF files (the format of llama.cpp, ollama and LM Studio) opened as attnlab models.

Design choices:
- The file format is ggml's own `gguf` package (gguf-py, maintained with llama.cpp): its GGUFReader
  walks the header, its `quants.dequantize` turns each block type into floats, and its tensor-name
  map (the table llama.cpp's converter writes names by) takes a Hugging Face name to a GGUF one.
  attnlab keeps no parser of its own; it wraps the reader with the untrusted-file rules below.
- Untrusted files: every read the reader makes is checked to lie inside the file (a truncated file
  or a length that points past the end is one line, never a short read or a loop over a lying
  count); the magic, the version and the byte order are checked before the reader starts; every
  tensor's type, dimensions (at most 4, each positive, a product that fits in 63 bits, rows a whole
  number of blocks), alignment and byte range are checked against the file before anything is read
  or allocated; a duplicate tensor or key name is refused by name. The config the metadata implies
  is checked against the file's size (check_fits) and each tensor's shape against the config before
  the model is built.
- The reader reads an array of numbers as one view of the file rather than one small array per
  element (gguf-py's way), walks an array of strings in one loop (gguf-py makes two numpy views,
  an enum and a recursive call per string), and reads with Python's garbage collector off (its
  passes over the growing lists of parts took two thirds of what was left). gguf-py still lays out
  every other part of the header; the cost was measured (benchmarks/README.md, "GGUF header").
- One model for every reader: a GGUF file is turned into what a Hugging Face checkpoint of the same
  model holds (its config.json as a dict, its tensors by their Hugging Face names), and from there
  the weight tables of attnlab.formats.llama and .gpt2 (the ones `load` uses for Hugging Face
  directories) fill the model. Two things the converter changed are undone on the way: llama's q and
  k rows, which llama.cpp's convert_hf_to_gguf.py permuted for its interleaved RoPE (attnlab rotates
  halves, as transformers does), and GPT-2's Conv1D matrices, which the converter transposed to
  (out, in).
- The model computes with exactly the file's values: every tensor is dequantized to float32
  (gguf-py's numpy code, checked in the tests against a block-by-block transcription of ggml's C
  reference).
- Memory is checked before anything is allocated (`plan_memory`): what the model will hold (float32
  copies, or the file's blocks plus its float tensors) and the largest transient on the way, against
  what the machine reports (attnlab.memory.available: MemAvailable, the cgroup's limit). By default
  (`keep_blocks=None`) a file whose float32 copy does not fit keeps its blocks, and says so in one
  line (attnlab.slower); an explicit keep_blocks=False that does not fit, or blocks that do not,
  are refused in one line with the figures and the fix, never left to the out-of-memory killer.
- A tensor's bytes are read from the file into the memory that keeps them (os.preadv), not through
  the reader's mapping: pages of a mapping count in the process's resident set for as long as the
  reader lives, which held a second copy of the file during the load.
- `keep_blocks=True` keeps each matrix in blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) as
  the file's blocks instead (attnlab.quant.blocks.BlockLinear: the bytes as they are, no float
  copy; llama's q and k rows are put back in their order as whole rows of blocks). Its forward
  dequantizes, so the model's logits are the default's; generation multiplies the blocks in C with
  8-bit activations, as llama.cpp does. A token embedding in blocks stays blocks too
  (BlockEmbedding: a lookup dequantizes only its rows), and a tied LM head is a BlockLinear on the
  same tensor. Float tensors (F32, F16, BF16) are read as by default.
- Architectures: llama (SmolLM, TinyLlama, Llama 2/3 without rope_freqs, and Mistral 7B files, which
  llama.cpp writes as llama and runs without a sliding window), mistral and mistral3 (llama's
  tensors under their own key prefix: _mistral_settings), qwen2, qwen3, gpt2, gemma3 and gemma
  (their table and settings in attnlab.formats.gemma3: the file's norms already hold 1 + w),
  gptneox (attnlab.formats.gpt_neox's table; the converter wrote its fused q/k/v as all q rows,
  then k, then v, where Pythia's checkpoint interleaves them per head: FUSED_BY_PART), phi3
  (attnlab.formats.phi3) and stablelm (attnlab.formats.stablelm), the last two with RoPE on part of
  each head where rope.dimension_count says so, starcoder2 (attnlab.formats.starcoder2), granite
  (llama's table and rows, with Granite's multipliers), falcon and command-r (attnlab.formats.
  parallel: one norm shared by a parallel block's two branches, read into both of attnlab's; a
  tensor the table lists twice is read once and copied), and the mixtures of experts
  (attnlab.formats.moe): llama with experts (Mixtral), qwen2moe and qwen3moe. Any other is refused
  by name, with the list of these. Each is tested on a file llama.cpp's converter wrote from a
  transformers model (tests/test_formats_gguf_architectures.py, tests/test_formats_moe.py,
  benchmarks/gguf_architectures.py).
- Experts: the converter stacks each block's experts into one 3-D tensor (ffn_gate_exps,
  ffn_up_exps, ffn_down_exps: [n_experts, rows, cols] in numpy's order), which gguf-py's name
  map does not place; `_expert_weights` reads each as one Weight fused over the experts along
  dim 0, so the float path and keep_blocks (one row of blocks per row: each expert its own
  BlockLinear) take them as they take any fused matrix.
"""

from __future__ import annotations

import gc
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import memory, slower
from ..errors import UserError, first_line
from ..model.transformer import Transformer
from .architecture import Weight
from .gemma3 import GEMMA, GEMMA2, GEMMA3
from .gemma3 import MODEL_TYPE as GEMMA3_TYPE
from .gguf_tokenizer import tokenizer_from_gguf
from .hf import architecture_for
from .native import empty_model
from .olmo2 import OLMO2
from .parallel import COHERE, FALCON, PHI2
from .phi3 import PHI3
from .stablelm import STABLELM
from .starcoder2 import STARCODER2
from .untrusted import check_fits, warn_non_finite

MAGIC = b"GGUF"
# what gguf-py reads; version 1 files (before August 2023) were never loadable by llama.cpp since
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
# general.architecture -> the model_type of the Hugging Face config the metadata becomes
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",  # "mistral" with a window (_mistral_settings)
    "mistral3": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gpt2": "gpt2",
    "gemma3": GEMMA3_TYPE,
    "qwen2moe": "qwen2_moe",  # and llama with experts: mixtral (_expert_settings)
    "qwen3moe": "qwen3_moe",
    "gptneox": "gpt_neox",
    "phi3": "phi3",
    "gemma": "gemma",
    "stablelm": "stablelm",
    "starcoder2": "starcoder2",
    "granite": "llama",  # with Granite's multipliers (hf_config)
    "falcon": "falcon",
    "command-r": "cohere",
    "phi2": "phi",
    "gemma2": "gemma2",
    "olmo2": "olmo2",
}
# the tables of the model_types above that attnlab.formats.hf does not read from directories
GGUF_TABLES = {
    GEMMA3_TYPE: GEMMA3,
    "phi3": PHI3,
    "gemma": GEMMA,
    "stablelm": STABLELM,
    "starcoder2": STARCODER2,
    "falcon": FALCON,
    "cohere": COHERE,
    "phi": PHI2,
    "gemma2": GEMMA2,
    "olmo2": OLMO2,
}
# the architectures whose RoPE may rotate part of each head (rope.dimension_count < head size)
PARTIAL_ROTARY = ("phi3", "stablelm", "phi2")
# the architectures whose q and k rows llama.cpp's converter permuted (LLAMA_ROPE_TYPE_NORM)
# (command-r: the converter keeps the checkpoint's rows, and transformers' Cohere and llama.cpp
# both rotate interleaved pairs, which the same reordering turns into attnlab's halves)
PERMUTED = ("llama", "mistral", "mistral3", "granite", "command-r")
# the tensor-name map each one is written by (gguf-py has no "mistral": llama's names)
NAME_MAPS = {"mistral": "llama"}
# the architectures whose fused q/k/v the converter wrote as all of q, then k, then v, where the
# Hugging Face checkpoint interleaves them per head (convert_hf_to_gguf.py, GPTNeoXModel.
# modify_tensors): their table's per-head split is read as a plain one
FUSED_BY_PART = ("gptneox",)
# the tensor types read here
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")


class _OutsideFile(Exception):
    """A read the header asked for that ends past the file's last byte."""


def _reader_class():
    """gguf.GGUFReader with every read checked against the file's size (module docstring)."""
    from gguf import GGUFReader, GGUFValueType

    class CheckedReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # slicing a plain view is far cheaper than slicing the np.memmap
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count, offset = np.dtype(dtype), int(count), int(offset)
            end = offset + dtype.itemsize * count
            if offset < 0 or count < 0 or end > plain.size:
                raise _OutsideFile(
                    f"a read of {count:,} x {dtype.itemsize} bytes at byte {offset:,} ends past "
                    f"the end of the file ({plain.size:,} bytes)"
                )
            # little-endian only (checked before the reader starts)
            return plain[offset:end].view(dtype)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == GGUFValueType.ARRAY:
                item_type, length = (
                    self._get(orig_offs, np.uint32),
                    self._get(orig_offs + 4, np.uint64),
                )
                item = GGUFValueType(int(item_type[0]))
                scalar = self.gguf_scalar_to_np.get(item)
                # one view for the whole array (gguf-py makes one per element)
                if scalar is not None:
                    values = self._get(orig_offs + 12, scalar, int(length[0]))
                    return 12 + values.nbytes, [item_type, length, values], [2], [raw_type, item]
                # each string or array takes at least its 8-byte length
                if int(length[0]) * 8 > self._plain.size - orig_offs:
                    raise _OutsideFile(
                        f"an array at byte {orig_offs:,} claims {int(length[0]):,} entries, more "
                        "than the rest of the file holds"
                    )
                if item == GGUFValueType.STRING:
                    return self._string_array(orig_offs, item_type, length, [raw_type, item])
            return super()._get_field_parts(orig_offs, raw_type)

        def _string_array(self, orig_offs, item_type, length, types):
            """An array of strings (Gemma 3's vocabulary: 262,144) as gguf-py's parts (each
            string's length and bytes, `data` pointing at the bytes), walked in one loop over the
            file's bytes: gguf-py's own walk makes two numpy views, a GGUFValueType and a recursive
            call per string (measured in benchmarks/README.md, "GGUF header"). The parts are
            memoryviews of the file, which have what ReaderField.contents() uses of a part
            (.tobytes(), .nbytes). Every length is checked against the file before it is used."""
            count, size = int(length[0]), self._plain.size
            view = self.__dict__.get("_view")
            if view is None:
                view = self._view = memoryview(self._plain)
            unpack, offset = struct.Struct("<Q").unpack_from, int(orig_offs) + 12
            parts, data = [item_type, length], []
            append, point = parts.append, data.append
            for _ in range(count):
                start = offset + 8
                if start > size:
                    break
                end = start + unpack(view, offset)[0]
                if end > size:
                    break
                append(view[offset:start])
                append(view[start:end])
                point(len(parts) - 1)
                offset = end
            else:
                return offset - orig_offs, parts, data, types
            raise _OutsideFile(
                f"string {len(data):,} of the array at byte {orig_offs:,} ends past the end of "
                f"the file ({size:,} bytes)"
            )

        def _build_tensors(self, start_offs, fields):
            check_tensor_infos(self, start_offs, fields)
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def check_tensor_infos(reader, start: int, fields) -> None:
    """Each tensor's name, type, dimensions and byte range, checked against the file before gguf-py
    makes views of them (it would make a short view of a range past the end, or wrap a product of
    dimensions that overflows)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size, seen = reader.data.size, set()
    for field in fields:
        _, name_bytes, n_dims, dims, raw_type, offset = field.parts
        name = bytes(name_bytes).decode("utf-8")
        if name in seen:
            raise UserError(f"the tensor name {name!r} appears twice")
        seen.add(name)
        dims = [int(d) for d in dims]
        if not 1 <= int(n_dims[0]) <= MAX_DIMS or any(d <= 0 for d in dims):
            raise UserError(
                f"tensor {name!r} has dimensions {dims}; GGUF allows 1 to {MAX_DIMS}, each positive"
            )
        count = 1
        for d in dims:
            count *= d
        if count >= 2**62:
            raise UserError(f"tensor {name!r}: dimensions {dims} overflow ({count:,} elements)")
        try:
            kind = GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise UserError(
                f"tensor {name!r} has type {int(raw_type[0])}, which GGUF does not define"
            ) from None
        if kind.name not in TYPES:
            raise UserError(
                f"tensor {name!r} has type {kind.name}, which attnlab cannot dequantize; it reads "
                f"{', '.join(TYPES)} (requantize the model with llama-quantize)"
            )
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise UserError(
                f"tensor {name!r}: its rows of {dims[0]} values do not divide into {kind.name} "
                f"blocks of {block}"
            )
        begin = int(offset[0])
        if begin % reader.alignment:
            raise UserError(
                f"tensor {name!r} starts at offset {begin}, not a multiple of the file's alignment "
                f"({reader.alignment})"
            )
        end = start + begin + count // block * block_bytes
        if end > size:
            raise UserError(
                f"tensor {name!r} ends at byte {end:,}, past the end of the file ({size:,} "
                "bytes); the file is truncated or its tensor table is damaged"
            )


@dataclass
class GGUFFile:
    """A checked GGUF file: its metadata as plain Python values and its tensors (gguf-py's
    ReaderTensor: views of the file, nothing read yet)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def check_start(path: Path) -> None:
    """Magic, version and byte order, from the first 8 bytes, before gguf-py reads anything."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24:
        raise UserError(
            f"{path}: {len(head)} bytes, too short for a GGUF header (24); the file is truncated"
        )
    if head[:4] != MAGIC:
        raise UserError(f"{path}: not a GGUF file (it starts with {head[:4]!r}, not {MAGIC!r})")
    version = int.from_bytes(head[4:8], "little")
    if version not in VERSIONS and int.from_bytes(head[4:8], "big") in VERSIONS:
        raise UserError(
            f"{path}: a big-endian GGUF file, which attnlab does not read; convert it on a "
            "little-endian machine"
        )
    if version not in VERSIONS:
        raise UserError(
            f"{path}: GGUF version {version}, which attnlab does not read (it reads versions "
            f"{', '.join(map(str, VERSIONS))}); convert the model again with a current llama.cpp"
        )


def read_gguf(path: str | Path) -> GGUFFile:
    """Open and check a GGUF file (see the module docstring); a lie in it is a UserError naming the
    problem."""
    path = Path(path)
    try:
        check_start(path)
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({first_line(exc)})") from None
    collecting = gc.isenabled()
    # the header's objects hold no cycles, and the collector's passes over a growing list of
    # 524k parts (a 262k vocabulary) took two thirds of the time (benchmarks/README.md)
    gc.disable()
    try:
        reader = _reader_class()(path)
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.")
        }
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    except _OutsideFile as exc:
        raise UserError(f"{path}: {exc}; the file is truncated or its header is damaged") from None
    except KeyError as exc:  # gguf-py: a metadata key that appears twice
        raise UserError(
            f"{path}: {first_line(exc).strip(chr(34) + chr(39))}; the header is damaged"
        ) from None
    # unknown value types, bad UTF-8, alignment
    except (ValueError, OverflowError, IndexError, TypeError) as exc:
        raise UserError(f"{path}: not a readable GGUF file ({first_line(exc)})") from None
    finally:
        if collecting:
            gc.enable()
    return GGUFFile(path, metadata, {tensor.name: tensor for tensor in reader.tensors})


def read_bytes(path: Path, tensor) -> np.ndarray:
    """A tensor's bytes read from the file into new memory, shaped and typed as gguf-py's view of
    them (tensor.data), without touching the reader's mapping (module docstring)."""
    out = np.empty(tensor.data.shape, dtype=tensor.data.dtype)
    view, at, done = memoryview(out.reshape(-1).view(np.uint8)), int(tensor.data_offset), 0
    with open(path, "rb", buffering=0) as f:
        while done < len(view):
            n = os.preadv(f.fileno(), [view[done:]], at + done)
            if n <= 0:
                raise UserError(f"{path}: tensor {tensor.name!r} ends past the end of the file")
            done += n
    return out


def dequantize(tensor, path: Path | None = None) -> np.ndarray:
    """A tensor's values as float32, in numpy's order (rows last-dimension-fastest, as torch's):
    gguf-py's dequantization of the file's blocks (read from `path`, else through the mapping)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    data = np.asarray(tensor.data) if path is None else read_bytes(path, tensor)
    values = np.asarray(gguf_dequantize(data, GGMLQuantizationType(tensor.tensor_type)), np.float32)
    if path is None:
        values = values.copy()  # gguf-py may return the file's read-only mapping itself
    return values.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))


def is_gguf(path: str | Path) -> bool:
    """A file named *.gguf, or one that starts with GGUF's magic number."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


# The metadata as a Hugging Face config ----------------------------------------------------------


def hf_config(file: GGUFFile) -> dict:
    """The config.json a Hugging Face checkpoint of this model would have, from the GGUF metadata
    (llama.cpp's keys: {arch}.block_count, {arch}.attention.head_count, ...)."""
    arch = file.value("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(
            f"{file.path}: architecture {arch!r}, which attnlab cannot run; it runs "
            f"{', '.join(ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in file.tensors:
        raise UserError(
            f"{file.path}: the file scales RoPE by a rope_freqs tensor (Llama 3.1-style), which "
            "attnlab does not read"
        )

    def get(key: str, default: Any = None) -> Any:
        return file.value(f"{arch}.{key}", default)

    embed = file.tensors.get("token_embd.weight")
    d_vocab = get("vocab_size") or (
        int(embed.shape[1]) if embed is not None and len(embed.shape) == 2 else None
    )
    special = {
        f"{name}_token_id": file.value(f"tokenizer.ggml.{key}_token_id")
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
    }
    tied = "output.weight" not in file.tensors
    if arch == "gpt2":
        return {
            "model_type": "gpt2",
            "vocab_size": d_vocab,
            "n_positions": get("context_length"),
            "n_embd": get("embedding_length"),
            "n_layer": get("block_count"),
            "n_head": get("attention.head_count"),
            "n_inner": get("feed_forward_length"),
            "layer_norm_epsilon": get("attention.layer_norm_epsilon", 1e-5),
            "activation_function": "gelu_new",
            "tie_word_embeddings": tied,
            **special,
        }
    if arch == "gptneox":
        return _gptneox_config(file, get, d_vocab, tied, special)
    d_model, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length")
    if head_dim is None and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads > 0:
        head_dim = d_model // n_heads
    if get("attention.value_length", head_dim) != head_dim:
        raise UserError(
            f"{file.path}: key length {head_dim} and value length {get('attention.value_length')} "
            "differ; attnlab's heads have one size"
        )
    rotated = get("rope.dimension_count", head_dim)
    if arch in PARTIAL_ROTARY and isinstance(rotated, int) and isinstance(head_dim, int):
        partial = {"partial_rotary_factor": rotated / head_dim}
    elif rotated != head_dim:
        raise UserError(
            f"{file.path}: RoPE rotates {get('rope.dimension_count')} of {head_dim} dims per head; "
            f"{arch} rotates all of them in attnlab (as in transformers)"
        )
    else:
        partial = {}
    hf = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": d_vocab,
        "max_position_embeddings": get("context_length"),
        "hidden_size": d_model,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "intermediate_size": get("feed_forward_length"),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": tied,
        **partial,
        **special,
    }
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling != "none":
        raise UserError(
            f"{file.path}: RoPE scaling {scaling!r}, which attnlab does not implement (it has "
            "linear)"
        )
    if arch == "qwen2" and "blk.0.attn_q.bias" not in file.tensors:
        # a qwen2 without biases computes as llama
        hf["model_type"], hf["attention_bias"] = "llama", False
    if arch in ("gemma3", "gemma2"):
        hf.update(_gemma_settings(file, hf, arch))
    if arch == "gemma":  # llama.cpp's Gemma: the tanh GELU, 1/sqrt(head size), tied
        hf["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "granite":
        # convert_hf_to_gguf.py's GraniteModel: {arch}.attention.scale, .embedding_scale,
        # .residual_scale, .logit_scale from config.json's *_multiplier and logits_scaling
        for key, name in (
            ("attention.scale", "attention_multiplier"),
            ("embedding_scale", "embedding_multiplier"),
            ("residual_scale", "residual_multiplier"),
            ("logit_scale", "logits_scaling"),
        ):
            if get(key) is not None:
                hf[name] = get(key)
    if arch == "falcon":  # Falcon-7B's layout: one norm per block, parallel, multi-query
        n_kv = get("attention.head_count_kv", 1)
        hf.update(
            layer_norm_epsilon=get("attention.layer_norm_epsilon", 1e-5),
            multi_query=n_kv == 1,
            new_decoder_architecture=n_kv != 1 or "blk.0.attn_norm_2.weight" in file.tensors,
            bias="blk.0.attn_qkv.bias" in file.tensors,
        )
    if arch == "phi2":
        up = file.tensors.get("blk.0.ffn_up.weight")
        hf.update(
            layer_norm_eps=get("attention.layer_norm_epsilon", 1e-5),
            hidden_act="gelu_new",
            qk_layernorm="blk.0.attn_q_norm.weight" in file.tensors,
            # the converter writes 4 * d_model as feed_forward_length, whatever the checkpoint's:
            # the MLP's width is its tensor's
            intermediate_size=int(up.shape[1]) if up is not None else hf["intermediate_size"],
        )
    if arch == "command-r":
        hf.update(
            layer_norm_eps=get("attention.layer_norm_epsilon", 1e-5),
            logit_scale=get("logit_scale", 1.0),
            use_qk_norm="blk.0.attn_q_norm.weight" in file.tensors,
        )
    if arch == "starcoder2":  # LayerNorm, the tanh GELU, biases where the file has them
        hf.update(
            norm_epsilon=get("attention.layer_norm_epsilon", 1e-5),
            hidden_act="gelu_pytorch_tanh",
            use_bias="blk.0.attn_q.bias" in file.tensors,
        )
    if arch == "stablelm":  # LayerNorm, biases on q/k/v where the file has them
        hf.update(
            layer_norm_eps=get("attention.layer_norm_epsilon", 1e-5),
            use_qkv_bias="blk.0.attn_q.bias" in file.tensors,
            use_parallel_residual=bool(get("use_parallel_residual", False)),
            qk_layernorm="blk.0.attn_q_norm.weight" in file.tensors,
        )
    if arch in ("mistral", "mistral3"):
        hf.update(_mistral_settings(file, arch))
    if arch == "phi3":
        # llama.cpp reads phi3.attention.sliding_window and runs without it (src/models/phi3.cpp:
        # "Phi SWA is currently disabled", ggml-org/llama.cpp#13676): as it computes the file
        hf["sliding_window"] = None
    if arch == "olmo2" and get("attention.sliding_window"):
        raise UserError(
            f"{file.path}: olmo2.attention.sliding_window {get('attention.sliding_window')} (OLMo "
            "3's windowed blocks), which attnlab does not read; it reads OLMo 2 files (no window)"
        )
    if arch in ("llama", "qwen2moe", "qwen3moe"):
        hf.update(_expert_settings(file, arch))
    return hf


def _squeezed(shape: tuple) -> tuple:
    """A shape without its leading 1s: ggml counts a tensor's dimensions up to the last one that
    is not 1 (ggml_n_dims), so a [1, n] matrix written again by llama-quantize is n (Qwen2-MoE's
    ffn_gate_inp_shexp); llama.cpp's loader compares shapes padded with 1s, and so do we."""
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _expert_settings(file: GGUFFile, arch: str) -> dict:
    """A mixture of experts as its config.json holds it (attnlab.formats.moe): a llama file with
    experts is a Mixtral (the converter writes Mixtral as llama plus expert_count); qwen2moe and
    qwen3moe give the experts' width apart from the dense one, and qwen2moe a shared expert's.
    llama.cpp renormalises the chosen experts' weights for llama and qwen3moe and never for
    qwen2moe (src/models/*.cpp, build_moe_ffn's norm_w), whatever config.json said: so do we.
    {} for a dense llama."""
    get = lambda key, default=None: file.value(f"{arch}.{key}", default)  # noqa: E731
    n_experts = get("expert_count")
    if arch == "llama":
        if not n_experts:
            return {}
        return {
            "model_type": "mixtral",
            "num_local_experts": n_experts,
            "num_experts_per_tok": get("expert_used_count"),
        }
    return {
        "num_experts": n_experts,
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": arch == "qwen3moe",
        "qkv_bias": "blk.0.attn_q.bias" in file.tensors,
    }


def _expert_weights(table: list, config) -> tuple[list, dict]:
    """The weight table without its per-expert rows, and the file's 3-D expert tensors, each as
    one Weight that fuses every expert of a block along dim 0 (the converter stacked the
    experts' matrices, [n_experts, rows, cols] in numpy's order): {GGUF name: Weight}. The
    router and the shared expert are 2-D tensors that gguf-py's name map places."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    if not config.n_experts:
        return table, {}
    table = [w for w in table if ".mlp.experts." not in w.ours[0]]
    fused = {}
    parts = {
        "W_gate": MODEL_TENSOR.FFN_GATE_EXP,
        "W_in": MODEL_TENSOR.FFN_UP_EXP,
        "W_out": MODEL_TENSOR.FFN_DOWN_EXP,
    }
    for i in range(config.n_layers):
        for ours, kind in parts.items():
            name = TENSOR_NAMES[kind].format(bid=i) + ".weight"
            experts = [f"blocks.{i}.mlp.experts.{e}.{ours}.weight" for e in range(config.n_experts)]
            fused[name] = Weight(name, *experts)
    return table, fused


def _gptneox_config(file: GGUFFile, get, d_vocab, tied: bool, special: dict) -> dict:
    """GPT-NeoX's config.json from llama.cpp's keys (convert_hf_to_gguf.py, GPTNeoXModel): the
    rotary fraction is rope.dimension_count over the head size; the converter writes no RoPE base
    (llama.cpp's default, 10,000, as Pythia's) and no activation (llama.cpp's GELU; Pythia's
    config says the exact one, which transformers computes); biases on q/k/v and the output
    projection where the file has them."""
    d_model, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = d_model // n_heads if isinstance(d_model, int) and isinstance(n_heads, int) else None
    rotated = get("rope.dimension_count", head_dim)
    return {
        "model_type": "gpt_neox",
        "vocab_size": d_vocab,
        "max_position_embeddings": get("context_length"),
        "hidden_size": d_model,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "intermediate_size": get("feed_forward_length"),
        "rotary_pct": rotated / head_dim if isinstance(rotated, int) and head_dim else rotated,
        "rotary_emb_base": get("rope.freq_base", 10000.0),
        "use_parallel_residual": bool(get("use_parallel_residual", True)),
        "layer_norm_eps": get("attention.layer_norm_epsilon", 1e-5),
        "hidden_act": "gelu",
        "attention_bias": "blk.0.attn_qkv.bias" in file.tensors,
        "tie_word_embeddings": tied,
        **special,
    }


def _mistral_settings(file: GGUFFile, arch: str) -> dict:
    """Mistral's files are llama's (the same tensors, names and permuted q/k rows) under their own
    key prefix. `mistral3` is what llama.cpp's converter names Mistral Small 3.x, Devstral and
    Ministral 3 (src/models/mistral3.cpp: llama's graph, no window, plus a Llama-4-style query
    temperature, refused here); `mistral` is what transformers' GGUF reader calls a Mistral (its
    keys `mistral.*`) but llama.cpp has no such architecture (its converter writes Mistral 7B as
    llama): its `attention.sliding_window`, when the file has one, is Mistral's window."""
    if file.value(f"{arch}.attention.temperature_scale"):
        raise UserError(
            f"{file.path}: {arch}.attention.temperature_scale "
            f"{file.value(f'{arch}.attention.temperature_scale')} (Llama 4's query temperature, as "
            "in Ministral 3), which attnlab does not implement"
        )
    window = file.value(f"{arch}.attention.sliding_window") if arch == "mistral" else None
    return {"model_type": "mistral", "sliding_window": window} if window else {}


def _gemma_settings(file: GGUFFile, hf: dict, arch: str) -> dict:
    """What Gemma 3's and Gemma 2's config.json hold beyond LLaMA's, as llama.cpp reads them from
    the metadata (src/models/gemma3.cpp, gemma2.cpp): the window (Gemma 2's default 4096), which
    blocks have it (`sliding_window_pattern`: an array of one flag per block or a period N, default
    6 for Gemma 3 and 2 for Gemma 2, block i global when i % N == N - 1; 0: every block windowed),
    the windowed blocks' RoPE base (rope.freq_base_swa: Gemma 3's default 10,000, Gemma 2's the
    global one), the query scale (1/sqrt(head_dim), but d_model / n_heads for Gemma 3's 62-block
    27B and Gemma 2's 46-block 27B, whatever query_pre_attn_scalar the checkpoint had), the final
    logit soft-cap and Gemma 2's attention soft-cap."""
    get = lambda key, default=None: file.value(f"{arch}.{key}", default)  # noqa: E731
    gemma2 = arch == "gemma2"
    n_layers = hf["num_hidden_layers"]
    window = get("attention.sliding_window", 4096 if gemma2 else None)
    pattern = get("attention.sliding_window_pattern", 2 if gemma2 else 6)
    if isinstance(pattern, list) and isinstance(n_layers, int):
        windowed = [bool(flag) for flag in pattern]
        period = next(
            (
                n
                for n in range(2, n_layers + 1)
                if windowed == [i % n != n - 1 for i in range(n_layers)]
            ),
            None,
        )
        if all(windowed) and len(windowed) == n_layers:
            pattern = 0
        elif not any(windowed):
            pattern = 1
        elif period is None:
            raise UserError(
                f"{file.path}: sliding_window_pattern {pattern} windows blocks in an order attnlab "
                "cannot express (it has every Nth block global)"
            )
        else:
            pattern = period
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise UserError(
            f"{file.path}: {arch}.attention.sliding_window_pattern must be a whole number or one "
            f"flag per block, got {pattern!r}"
        )
    if not window or pattern == 1:  # llama.cpp: no window, or a period of 1 (no block windowed)
        window = None
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    scalar = hf["head_dim"]
    large = 46 if gemma2 else 62  # the 27B, whose queries are scaled by d_model / n_heads
    if n_layers == large and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads > 0:
        scalar = d_model // n_heads
    settings = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window,
        "sliding_window_pattern": pattern or None,
        "rope_local_base_freq": get("rope.freq_base_swa", None if gemma2 else 10000.0),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": get("final_logit_softcapping") or None,
    }
    if gemma2:
        settings["attn_logit_softcapping"] = get("attn_logit_softcapping") or None
    return settings


# Loading ----------------------------------------------------------------------------------------


# what a loaded model holds beyond its weights (the tokenizer's tables, RoPE's, the buffers), and
# the dequantization's own arrays: gguf-py's K-quant code keeps up to three float32 arrays of a
# tensor's size at once
HEADROOM = 512 << 20
DEQUANTIZE_COPIES = 3


@dataclass(frozen=True)
class MemoryPlan:
    """What loading a file needs, in bytes, each way: weights held plus the largest transient."""

    float32: int  # every tensor dequantized
    blocks: int  # the matrices in blocks as the file's, the rest float32
    blocks_bytes: int  # of which the blocks themselves
    kinds: tuple[str, ...]  # the block types kept


def plan_memory(tensors: list) -> MemoryPlan:
    """The memory `load_gguf` will need for `tensors` (gguf-py's ReaderTensors), each way."""
    from gguf import GGMLQuantizationType

    from ..quant.blocks import BY_GGML_NAME

    float32 = blocks = kept = 0
    largest_float = largest_bytes = largest_rest = 0
    kinds = set()
    for tensor in tensors:
        floats = int(tensor.n_elements) * 4
        name = GGMLQuantizationType(tensor.tensor_type).name
        float32 += floats
        largest_float = max(largest_float, floats)
        if name in BY_GGML_NAME and len(tensor.shape) == 2:
            blocks += int(tensor.n_bytes)
            kept += int(tensor.n_bytes)
            kinds.add(name)
            # read, then its rows put in order (llama's q and k): two copies at once
            largest_bytes = max(largest_bytes, 2 * int(tensor.n_bytes))
        else:
            blocks += floats
            largest_rest = max(largest_rest, floats)
    return MemoryPlan(
        float32=float32 + DEQUANTIZE_COPIES * largest_float + HEADROOM,
        blocks=blocks + max(largest_bytes, DEQUANTIZE_COPIES * largest_rest) + HEADROOM,
        blocks_bytes=kept,
        kinds=tuple(sorted(kinds)),
    )


def choose_keep_blocks(plan: MemoryPlan, keep_blocks: bool | None, source: str) -> bool:
    """keep_blocks as asked, or (None) float32 where it fits and the file's blocks where not, said
    in one line; a way that cannot fit is refused in one line (module docstring)."""
    found = memory.available()
    if found is None:  # the machine reports nothing to check against
        return bool(keep_blocks)
    free, where = found
    gb = memory.gigabytes
    has = f"{gb(free)} is available ({where})"
    blocks_help = plan.blocks < plan.float32
    if keep_blocks is None:
        if plan.float32 <= free or not blocks_help:
            keep_blocks = False
        elif plan.blocks <= free:
            slower.say(
                f"{source}: the file's {', '.join(plan.kinds)} blocks kept as they are "
                f"({gb(plan.blocks_bytes)})",
                "dequantized to float32",
                f"float32 needs {gb(plan.float32)} and {has}; keep_blocks=True chooses this itself",
            )
            return True
        else:
            keep_blocks = True
    need = plan.blocks if keep_blocks else plan.float32
    if need <= free:
        return keep_blocks
    if not keep_blocks and blocks_help:
        raise UserError(
            f"{source}: dequantized to float32 this model needs {gb(need)} and {has}; load it "
            f"with keep_blocks=True (--keep-blocks: the file's blocks, {gb(plan.blocks)} in all), "
            "or free memory"
        )
    raise UserError(
        f"{source}: this model needs {gb(need)}"
        + (" even with the file's blocks kept" if blocks_help else "")
        + f" and {has}; free memory, or take a smaller quantization of the model"
    )


def _unpermute(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute: it reordered each head's rows from [first
    half, second half] (rotate-half RoPE) to interleaved pairs (llama.cpp's RoPE); rows [h, pair, 2]
    -> [h, 2, pair]."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
    )


def load_gguf(
    path: str | Path, device: str | torch.device = "cpu", keep_blocks: bool | None = None
):
    """A Transformer from a GGUF file, in eval mode, computing with the file's values dequantized to
    float32, with .config and .tokenizer (from the file's tokenizer.ggml.* keys). keep_blocks: the
    matrices and the embedding in blocks stay the file's blocks; None: where float32 would not fit
    in the memory available (module docstring)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    from ..quant.blocks import BlockEmbedding, BlockLinear

    file = read_gguf(path)
    source = str(file.path)
    hf = hf_config(file)
    arch = GGUF_TABLES.get(hf["model_type"]) or architecture_for(hf, source)
    try:
        config = arch.config_from_hf(hf, source)
    except UserError as exc:
        raise UserError(str(exc).replace("config.json", "metadata")) from None
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as exc:
        raise UserError(
            f"{source}: a metadata value has the wrong type ({first_line(exc)})"
        ) from None
    gguf_arch = file.value("general.architecture")
    extra = {**config.extra, "hf_model_type": hf["model_type"], "gguf_architecture": gguf_arch}
    if isinstance(file.value("tokenizer.chat_template"), str):
        # see attnlab.formats.gguf_tokenizer
        extra["chat_template"] = file.value("tokenizer.chat_template")
    config = config.replace(extra=extra)
    if config.n_layers > len(file.tensors):
        raise UserError(
            f"{source}: block_count {config.n_layers} but only {len(file.tensors)} tensors; the "
            "metadata does not match the tensors"
        )
    check_fits(config, [file.path], source)

    # Which GGUF tensor holds each Hugging Face tensor: gguf-py's own name map (the converter's
    # table).
    map_name = NAME_MAPS.get(gguf_arch, gguf_arch)
    names = get_tensor_name_map(
        next(k for k, v in MODEL_ARCH_NAMES.items() if v == map_name), config.n_layers
    )
    shapes = {
        name: tuple(t.shape) for name, t in Transformer(config, device="meta").state_dict().items()
    }
    table, experts = _expert_weights(arch.weights(hf, config), config)
    if gguf_arch in FUSED_BY_PART:
        table = [type(w)(w.hf, *w.ours, conv1d=w.conv1d) for w in table]
    found, copies = {}, {}  # copies: attnlab name -> the one it is a copy of
    for w in table + list(experts.values()):
        full = w.hf if w.hf in arch.head_keys else arch.write_prefix + w.hf
        base, suffix = full.rsplit(".", 1)
        name = w.hf if w.hf in experts else f"{names.get_name(base)}.{suffix}"
        tensor = file.tensors.get(name)
        if tensor is None:
            raise UserError(
                f"{source}: missing tensor {name!r}, which the metadata implies; the file is "
                "incomplete"
            )
        expected = w.hf_shape(shapes)[::-1] if w.conv1d else w.hf_shape(shapes)
        actual = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if name in experts and len(actual) == 3:  # [n_experts, rows, cols]: experts' rows
            actual = (actual[0] * actual[1], actual[2])
        if _squeezed(actual) != _squeezed(expected):
            raise UserError(
                f"{source}: tensor {name!r} has shape {actual} but the metadata implies "
                f"{expected}; the metadata does not match the tensors"
            )
        if name in found:  # a shared norm read into two (attnlab.formats.parallel)
            copies[w.ours[0]] = found[name].ours[0]
            continue
        found[name] = w
    extra = sorted(set(file.tensors) - set(found))
    if extra:
        raise UserError(
            f"{source}: tensor {extra[0]!r}"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            + f" has no place in a {gguf_arch} model with this metadata"
        )

    if torch.device(device).type == "cpu":
        keep_blocks = choose_keep_blocks(
            plan_memory([file.tensors[name] for name in found]), keep_blocks, source
        )
    kept = {}  # module name -> (its blocks, their kind): the matrices that stay blocks
    if keep_blocks:
        meta = Transformer(config, device="meta")
        for name, w in found.items():
            kept.update(_blocks_of(file.tensors[name], name, w, meta, gguf_arch, shapes, file.path))
    on_device = {id(b): b.to(device) for b, _ in kept.values()}  # a tied head: the same tensor
    modules = {}
    for module_name, (blocks, kind) in kept.items():
        blocks = on_device[id(blocks)]
        if module_name == "embed":
            modules[module_name] = BlockEmbedding(blocks, kind, config.d_model)
        else:
            old = meta.get_submodule(module_name)
            modules[module_name] = BlockLinear.from_blocks(blocks, kind, old.in_features, old.bias)
    # the kept matrices go in before the model gets memory: their float weights never exist
    model = empty_model(config, device, modules)
    params, covered, non_finite = model.state_dict(), set(), {}
    with torch.no_grad():
        for name, w in found.items():
            if all(ours.removesuffix(".weight") in kept for ours in w.ours):
                covered.update(w.ours)  # its blocks only: never dequantized here
                continue
            values = dequantize(file.tensors[name], file.path)
            tensor = torch.from_numpy(values)
            if tensor.dim() != len(w.hf_shape(shapes)):  # experts' [n_experts, rows, cols]
                tensor = tensor.reshape(w.hf_shape(shapes))
            if not np.isfinite(values).all():  # numpy's check: faster here than torch.isfinite
                non_finite[name] = tensor
            if gguf_arch in PERMUTED and ".attn_q." in name:
                tensor = _unpermute(tensor, config.n_heads)
            elif gguf_arch in PERMUTED and ".attn_k." in name:
                tensor = _unpermute(tensor, config.n_kv_heads)
            if w.conv1d and tensor.dim() == 2:
                tensor = tensor.t()  # back to the Hugging Face checkpoint's Conv1D (in, out)
            for ours, part in zip(w.ours, w.to_ours(tensor, shapes)):
                if ours.removesuffix(".weight") not in kept:  # else: its blocks, not a float copy
                    params[ours].copy_(part)
                covered.add(ours)
        for ours, source in copies.items():
            params[ours].copy_(params[source])
            covered.add(ours)
        for name, tensor in params.items():
            if name not in covered and not (name == "unembed.weight" and config.tie_embeddings):
                if name.endswith(".blocks"):
                    continue
                assert name.endswith(".bias"), (
                    f"{name} has no entry in the {hf['model_type']} table"
                )
                # a bias attnlab's config has and this architecture lacks (as in load_hf)
                tensor.zero_()
    if non_finite:
        warn_non_finite(non_finite, source)
    if kept:
        # one kind for every matrix and a float embedding: what attnlab.quantize(model, kind) makes
        # (and saves as); else a mix that attnlab's own format cannot record
        kinds = sorted({kind for _, kind in kept.values()})
        every = not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        mixed = len(kinds) > 1 or not every or "embed" in kept
        model.quantization = "gguf:" + "+".join(kinds) if mixed else kinds[0]
    model.tokenizer = tokenizer_from_gguf(file)
    if model.tokenizer is not None and model.tokenizer.vocab_size > config.d_vocab:
        raise UserError(
            f"{source}: the tokenizer has {model.tokenizer.vocab_size} tokens but the embedding "
            f"{config.d_vocab} rows; the tokenizer does not belong to this model"
        )
    return model.eval()


def _blocks_of(tensor, name: str, w, model, gguf_arch: str, shapes: dict, path: Path) -> dict:
    """{module name: (blocks, kind)} for the Linear modules (and the token embedding) the GGUF
    tensor `name` fills, when it holds blocks attnlab multiplies; {} otherwise. The file's rows
    of blocks go through what the float path does to rows (llama's q/k unpermute, the split of a
    fused matrix); GPT-2's two transposes cancel. A tied token embedding's blocks are also the
    LM head's (one tensor)."""
    from gguf import GGMLQuantizationType

    from ..quant.blocks import BY_GGML_NAME

    kind = BY_GGML_NAME.get(GGMLQuantizationType(tensor.tensor_type).name)
    if kind is None or len(tensor.shape) not in (2, 3):
        return {}
    rows = int(np.prod(tensor.shape[1:]))  # experts' [n_experts, rows]: one row of blocks each
    # a copy of the file's bytes, one row of blocks per output feature: [rows, bytes per row]
    blocks = torch.from_numpy(read_bytes(path, tensor).reshape(rows, -1))
    if gguf_arch in PERMUTED and ".attn_q." in name:
        blocks = _unpermute(blocks, model.config.n_heads)
    elif gguf_arch in PERMUTED and ".attn_k." in name:
        blocks = _unpermute(blocks, model.config.n_kv_heads)
    plain = type(w)(w.hf, *w.ours, heads=w.heads)  # the same split of rows, without a transpose
    kept = {}
    for ours, part in zip(w.ours, plain.to_ours(blocks, shapes)):
        module_name = ours.removesuffix(".weight")
        if ours.endswith(".weight") and isinstance(
            model.get_submodule(module_name), torch.nn.Linear
        ):
            kept[module_name] = (_not_a_view(part.contiguous()), kind)
        elif ours == "embed.weight":  # looked up row by row (BlockEmbedding)
            kept["embed"] = (_not_a_view(part.contiguous()), kind)
            if model.config.tie_embeddings and model.unembed is not None:
                kept["unembed"] = kept["embed"]  # the LM head reads the same tensor
    return kept


def _not_a_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the same memory as a tensor of its own, not a view: a view keeps its base alive
    (`_base`) after its data is replaced, as generation's move of the weights into 2 MB pages does,
    which held every matrix twice."""
    if tensor._base is None:
        return tensor
    own = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return own.set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )
