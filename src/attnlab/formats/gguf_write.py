"""attnlab models written as GGUF files that llama.cpp (and so ollama and LM Studio) runs:
`attnlab.save(model, "out.gguf", dtype="f32" | "f16" | "q8_0")`.

Design choices:
- The file is made by ggml's own `gguf` package (gguf-py, maintained with llama.cpp): its GGUFWriter
  lays out the header and tensors, its `quants.quantize` makes the Q8_0 blocks, its tensor-name map
  gives each tensor llama.cpp's name. attnlab writes no file format of its own.
- One table of weights per architecture, shared with the readers: a model is first taken as the
  Hugging Face checkpoint of the same model would hold it (attnlab.formats.hf.weight_parts over the
  llama and gpt2 tables that `save(format="hf")` writes by), then each tensor is renamed by gguf-
  py's map and laid out as llama.cpp's converter (convert_hf_to_gguf.py) lays it out: llama's q and
  k rows permuted for llama.cpp's interleaved RoPE (attnlab.formats.gguf un-permutes them on
  reading, so a round trip is exact), GPT-2's Conv1D matrices back to (out, in). The reader maps the
  same names back, so the two directions cannot drift.
- What llama.cpp can run, and nothing else: `llama` (RoPE, RMSNorm, SwiGLU, grouped-query heads, no
  biases), `qwen2` (the same with biases on q, k and v) and `qwen3` (with QK-norm), which rotate the
  halves of a head as attnlab does; `gpt2` (learned positions, LayerNorm, GELU in its tanh form,
  which is the only one llama.cpp's gpt2 computes). A model with anything else (ReLU², a logit soft-
  cap, QK-norm beside a GELU MLP, a sliding window, an encoder, ...) is refused in one line that
  names every part llama.cpp lacks, before anything is written.
- Tensor types as llama.cpp's converter chooses them: norms, biases and other 1-D tensors and
  GPT-2's position embeddings stay F32; the matrices (token embedding and LM head included) are F32,
  F16 or Q8_0 by `dtype`. A matrix whose rows do not divide into Q8_0's blocks of 32 is written F16,
  as the converter does, with a warning naming it.
- A tensor can also come as ready-made blocks (`Blocks`: the raw bytes and their ggml type, e.g. the
  Q8_0 or Q4_1 blocks a quantized model already holds); they are written as they are, whatever
  `dtype` says, moved only as whole rows (the q/k permutation and GPT-2's fused q, k, v are row
  operations). A model that holds blocks (`attnlab.quantize(model, "q4_0" | "q4_1" | "q8_0")`, or
  a GGUF file loaded with keep_blocks=True) gives its own (`own_blocks`), so it is written bit for
  bit and reads back with the same blocks and logits. quantize gives a tied LM head blocks of its
  own beside the float embedding: the file then holds that head as output.weight (an untied file,
  which computes what the model computes); a head on the embedding's own blocks stays tied.
- The tokenizer goes into tokenizer.ggml.* so that llama.cpp tokenizes text as attnlab does: byte-
  level BPE (attnlab's `--tokenizer bpe`, GPT-2's, and those read from GGUF files) as llama.cpp's
  "gpt2" vocabulary with its merges and the pre-tokenizer llama.cpp knows by name; attnlab's
  character tokenizer as llama.cpp's "rwkv" vocabulary (see attnlab.formats.gguf_tokenizer for why);
  no tokenizer as "none" (llama.cpp then takes token ids, as llama-bench does). llama.cpp's gpt2
  vocabulary ends generation at id 11 unless the file names an end-of-text token; a byte-level BPE
  without one gets the token of byte 0xFF, which no UTF-8 text contains, so generation ends only
  where attnlab's would produce bytes that are not text.
- The file appears whole or not at all: written to a temporary name beside it, fsynced and renamed
  (attnlab.files.atomic_write), after every check has passed.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..files import atomic_write
from ..model.config import ModelConfig
from .architecture import Architecture
from .gguf_tokenizer import PRE_TOKENIZERS, rwkv_escape
from .gpt2 import GPT2
from .hf import weight_parts
from .llama import LLAMA
from .native import state_dict_for_saving

# dtype -> (ggml type of the matrices, general.file_type: llama.cpp's LLAMA_FTYPE)
DTYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "q8_0": ("Q8_0", 7)}
# Hugging Face model_type (of the table the model is written by) -> general.architecture
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # llama_token_type
END_BYTE_TOKEN = "ÿ"  # byte 0xFF in byte-level BPE's alphabet (GPT-2's bytes_to_unicode)


@dataclass(frozen=True)
class Blocks:
    """One tensor as ready-made ggml blocks, written as they are: `data` holds the bytes, one row of
    the matrix per row of `data` (rows, bytes per row); `kind` is the ggml type's name ("Q8_0",
    "Q4_1", ...); `shape` the values' shape in torch's order (rows, columns)."""

    data: np.ndarray
    kind: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.kind not in GGMLQuantizationType.__members__:
            raise UserError(f"Blocks: {self.kind!r} is not a ggml tensor type")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        rows, columns = self.shape[0], int(np.prod(self.shape[1:], dtype=np.int64))
        if columns % block or self.data.dtype != np.uint8:
            raise UserError(
                f"Blocks: rows of {columns} values do not divide into {self.kind} blocks of {block}"
                if columns % block
                else f"Blocks: data must be bytes (uint8), got {self.data.dtype}"
            )
        if self.data.shape != (rows, columns // block * size):
            raise UserError(
                f"Blocks: {self.kind} data of shape {self.data.shape} does not hold values of "
                f"shape {self.shape} (expected {(rows, columns // block * size)})"
            )

    def rows(self, order) -> Blocks:
        return Blocks(self.data[np.asarray(order)], self.kind, self.shape)


def refuse_unrunnable(cfg: ModelConfig) -> tuple[str, Architecture]:
    """The llama.cpp architecture that computes what `cfg` computes (its general.architecture and
    the weight table it is written by), or a UserError naming every part llama.cpp lacks."""
    problems = []
    if not cfg.causal:
        problems.append("an encoder (BERT-style: llama.cpp runs decoders)")
    if cfg.logit_softcap is not None:
        problems.append(f"a logit soft-cap (logit_softcap={cfg.logit_softcap:g})")
    multipliers = ("embedding_multiplier", "residual_multiplier", "logit_scale")
    if any(getattr(cfg, name) != 1.0 for name in multipliers):  # granite files: not written here
        problems.append(
            "Granite's multipliers ("
            + ", ".join(
                f"{name}={getattr(cfg, name):g}"
                for name in multipliers
                if getattr(cfg, name) != 1.0
            )
            + ")"
        )
    if cfg.norm_placement != "pre" or not cfg.final_norm or cfg.embed_norm:
        problems.append("a norm placement other than pre-norm with a final norm")
    if cfg.parallel_residual:
        problems.append("parallel attention and MLP (parallel_residual)")
    if cfg.unembed_bias:
        problems.append("a bias on the LM head (unembed_bias)")
    if cfg.n_token_types:
        problems.append("token-type embeddings")
    if cfg.attn_only:
        problems.append("blocks without an MLP (attn_only)")
    if cfg.attn_scale not in (None, cfg.d_head**-0.5):
        problems.append(f"an attention scale other than 1/sqrt(d_head) ({cfg.attn_scale:g})")
    if cfg.sliding_window is not None:
        problems.append(f"a sliding window (sliding_window={cfg.sliding_window})")
    if cfg.positional == "rope":
        family = "llama, qwen2 and qwen3"
        if cfg.norm != "rmsnorm":
            problems.append(f"norm={cfg.norm!r} with RoPE ({family} use RMSNorm)")
        if cfg.mlp != "swiglu":
            problems.append(f"mlp={cfg.mlp!r} with RoPE ({family} have a SwiGLU MLP only)")
        if cfg.bias:
            problems.append(f"biases on every linear layer ({family} have none but qwen2's q/k/v)")
        if cfg.qk_norm and cfg.use_qkv_bias:
            problems.append("QK-norm together with q, k, v biases (qwen3 has no biases)")
        if cfg.rotary_fraction != 1.0:
            problems.append(f"partial RoPE (rotary_fraction={cfg.rotary_fraction:g})")
        if cfg.rope_scaling not in ("none", "linear"):
            problems.append(f"RoPE scaling {cfg.rope_scaling!r} (attnlab writes linear)")
    elif cfg.positional == "learned":
        if cfg.norm != "layernorm":
            problems.append(f"norm={cfg.norm!r} with learned positions (gpt2 uses LayerNorm)")
        if cfg.mlp != "gelu_tanh":
            problems.append(
                f"mlp={cfg.mlp!r} with learned positions (gpt2 computes GELU in its tanh form "
                "only: train with --mlp gelu_tanh)"
                if cfg.mlp == "gelu"
                else f"mlp={cfg.mlp!r} with learned positions (gpt2 has a GELU MLP only)"
            )
        if cfg.n_kv_heads != cfg.n_heads:
            problems.append("grouped-query attention with learned positions (gpt2 has none)")
        if cfg.d_head * cfg.n_heads != cfg.d_model:
            problems.append(f"d_head={cfg.d_head} other than d_model / n_heads (gpt2)")
        if cfg.qk_norm:
            problems.append("QK-norm with learned positions (gpt2 has none)")
    else:
        problems.append(
            f"positional={cfg.positional!r} (llama.cpp's decoders use RoPE or learned positions)"
        )
    if problems:
        raise UserError(
            "cannot write GGUF: llama.cpp has no architecture for "
            + "; ".join(problems)
            + ". Recipes it runs: attnlab train --preset cpu --mlp swiglu (llama), or --preset "
            "nano --mlp gelu_tanh (gpt2); save this model with format='attnlab' or 'hf' instead"
        )
    arch = GPT2 if cfg.positional == "learned" else LLAMA
    return ARCHITECTURES[arch.config_to_hf(cfg)["model_type"]], arch


def permute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order convert_hf_to_gguf.py's LlamaModel.permute gives q or k: each head's rows from
    [first half, second half] (rotate-half RoPE) to interleaved pairs (llama.cpp's RoPE); rows
    [h, 2, pair] -> [h, pair, 2]. attnlab.formats.gguf._unpermute is its inverse."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


def own_blocks(model) -> dict[str, Blocks]:
    """The blocks `model` holds (BlockLinear, BlockEmbedding), by the parameter each stands for
    ("blocks.0.attn.W_Q.weight", "embed.weight"); a tied LM head on the embedding's own tensor
    only once, as the embedding."""
    from ..quant.blocks import BLOCK_TYPES, BlockEmbedding, BlockLinear

    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, BlockLinear | BlockEmbedding):
            continue
        if name == "unembed" and module.blocks is getattr(model.embed, "blocks", None):
            continue
        columns = module.in_features if isinstance(module, BlockLinear) else module.embedding_dim
        blocks = module.file_blocks() if isinstance(module, BlockLinear) else module.blocks
        found[f"{name}.weight"] = Blocks(
            blocks.detach().cpu().numpy(),
            BLOCK_TYPES[module.kind].name,
            (module.blocks.shape[0], columns),
        )
    return found


def gguf_tensors(
    model,
    arch: Architecture,
    gguf_arch: str,
    blocks: Mapping[str, Blocks] | None = None,
    config: ModelConfig | None = None,
) -> dict[str, torch.Tensor | Blocks]:
    """llama.cpp's name -> each tensor of `model` laid out as llama.cpp reads it (module docstring);
    `blocks`: attnlab parameter name -> ready-made blocks that stand for that parameter (the model's
    own blocks are always written as they are); `config`: the model's, or the one to write it as."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    cfg = config or model.config
    own = own_blocks(model)
    unknown = sorted(set(blocks or {}) - set(model.state_dict()) - set(own))
    if unknown:
        raise UserError(f"Blocks given for {unknown[0]!r}, which is not a tensor of this model")
    # a block module's bytes ("x.blocks") are written as the parameter they stand for ("x.weight")
    state = {
        k: v
        for k, v in state_dict_for_saving(model).items()
        if not (k.endswith(".blocks") and isinstance(model.get_submodule(k[:-7]), _block_modules()))
    }
    state = {**state, **own, **(blocks or {})}
    hf = arch.config_to_hf(cfg)
    names = get_tensor_name_map(
        next(k for k, v in MODEL_ARCH_NAMES.items() if v == gguf_arch), cfg.n_layers
    )
    tensors: dict[str, torch.Tensor | Blocks] = {}
    for w, key, parts in weight_parts(arch, hf, state, model.dtype, model.device):
        base, suffix = key.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if any(isinstance(part, Blocks) for part in parts):
            if not all(isinstance(part, Blocks) and part.kind == parts[0].kind for part in parts):
                raise UserError(
                    f"{name} fuses {', '.join(w.ours)}: give Blocks of one type for all of them"
                )
            tensor: torch.Tensor | Blocks = Blocks(
                np.concatenate([part.data for part in parts]),
                parts[0].kind,
                (sum(part.shape[0] for part in parts), *parts[0].shape[1:]),
            )
        else:
            tensor = w.to_hf(parts)
            if w.conv1d and tensor.dim() == 2:
                tensor = tensor.t()  # GPT-2's Conv1D (in, out) back to (out, in), as llama.cpp's
        if gguf_arch == "llama" and suffix == "weight" and base.endswith(("q_proj", "k_proj")):
            heads = cfg.n_heads if base.endswith("q_proj") else cfg.n_kv_heads
            order = permute_rows(tensor.shape[0], heads)
            if isinstance(tensor, Blocks):
                tensor = tensor.rows(order)
            else:
                tensor = tensor[torch.from_numpy(order).to(tensor.device)]
        tensors[name] = tensor
    return tensors


def _block_modules() -> tuple[type, ...]:
    from ..quant.blocks import BlockEmbedding, BlockLinear

    return (BlockLinear, BlockEmbedding)


def tensor_type(name: str, tensor: torch.Tensor, dtype: str) -> str:
    """The ggml type llama.cpp's converter gives a float tensor (module docstring)."""
    if tensor.dim() <= 1 or name.endswith("_norm.weight") or name.startswith("position_embd."):
        return "F32"
    kind = DTYPES[dtype][0]
    if kind == "Q8_0" and tensor.shape[-1] % 32:
        return "F16"
    return kind


def encode(name: str, tensor: torch.Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """(the array GGUFWriter takes, its raw ggml type or None) for a float tensor as `kind`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
    if kind == "F32":
        return values, None
    if kind == "F16":
        half = values.astype(np.float16)
        if not np.isfinite(half).all() and np.isfinite(values).all():
            raise UserError(
                f"{name} has values beyond float16's range (largest |x| "
                f"{float(np.abs(values).max()):.4g} > 65504); write it with dtype='f32'"
            )
        return half, None
    return quantize(values, GGMLQuantizationType[kind]), GGMLQuantizationType[kind]


# The tokenizer as tokenizer.ggml.* ---------------------------------------------------------------


def _pre_tokenizer_name(data: dict, ignore_merges: bool) -> str | None:
    """The name llama.cpp knows a byte-level BPE's pre-tokenizer by (tokenizer.ggml.pre), from the
    tokenizer.json `data`: GPT-2's own ByteLevel split, or the split regexes attnlab.formats.
    gguf_tokenizer builds for one of PRE_TOKENIZERS; None when it is neither."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    pre = data.get("pre_tokenizer") or {}
    if (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and not ignore_merges
    ):
        return "gpt-2"
    for name, (regexes, ignores) in PRE_TOKENIZERS.items():
        probe = Backend(models.BPE())
        probe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        if json.loads(probe.to_str())["pre_tokenizer"] == pre and ignores == ignore_merges:
            return name
    return None


def tokenizer_metadata(tokenizer, cfg: ModelConfig) -> dict[str, Any]:
    """tokenizer.ggml.* (without the prefix) for `tokenizer`, as llama.cpp reads them; a tokenizer
    llama.cpp would tokenize differently is a UserError."""
    if tokenizer is None:
        return {"model": "none"}
    n = tokenizer.vocab_size
    if n > cfg.d_vocab:
        raise UserError(
            f"the tokenizer has {n} tokens but the embedding {cfg.d_vocab} rows; they do not "
            "belong together"
        )
    tokens = [tokenizer.id_to_token(i) for i in range(n)]
    if tokenizer.kind == "char":
        if n != cfg.d_vocab:
            raise UserError(
                f"the character tokenizer has {n} tokens but the embedding {cfg.d_vocab} rows; "
                "llama.cpp needs one token per row"
            )
        return {
            "model": "rwkv",
            "tokens": [rwkv_escape(token) for token in tokens],
            "token_type": [NORMAL] * n,
            "add_bos_token": False,
            "add_eos_token": False,
        }
    data = json.loads(tokenizer.backend.to_str())
    model = data.get("model") or {}
    ignore_merges = bool(model.get("ignore_merges", False))
    pre = _pre_tokenizer_name(data, ignore_merges)
    decoder = (data.get("decoder") or {}).get("type")
    if (
        model.get("type") != "BPE"
        or decoder != "ByteLevel"
        or data.get("normalizer") is not None
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or pre is None
    ):
        raise UserError(
            "cannot write GGUF: the tokenizer is not a byte-level BPE with a pre-tokenizer "
            "llama.cpp knows by name (GPT-2's, or one read from a GGUF file), so llama.cpp would "
            "tokenize text differently; attnlab writes its char and bpe tokenizers and those"
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    added = tokenizer.backend.get_added_tokens_decoder()
    types = [
        (CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL for i in range(n)
    ]
    # rows past the tokenizer (a vocabulary padded to a round size): placeholders, as the converter
    tokens += [f"[PAD{i}]" for i in range(n, cfg.d_vocab)]
    types += [UNUSED] * (cfg.d_vocab - n)
    keys: dict[str, Any] = {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "token_type": types,
        "merges": merges,
    }
    # what encode adds around a text: the post-processor's BOS / EOS
    plain, full = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a")
    start = full.index(plain[0]) if plain and plain[0] in full else 0
    keys["add_bos_token"], keys["add_eos_token"] = start > 0, len(full) > start + len(plain)
    ids = {"bos": cfg.extra.get("bos_token_id"), "eos": cfg.extra.get("eos_token_id")}
    ids["padding"] = cfg.extra.get("pad_token_id")
    if keys["add_bos_token"]:
        ids["bos"] = full[0]
    if keys["add_eos_token"]:
        ids["eos"] = full[-1]
    if not isinstance(ids["eos"], int) and END_BYTE_TOKEN in tokens:
        ids["eos"] = tokens.index(END_BYTE_TOKEN)  # see the module docstring
    for key, index in ids.items():
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < cfg.d_vocab:
            keys[f"{key}_token_id"] = index
    return keys


# Writing ----------------------------------------------------------------------------------------


def save_gguf(
    model,
    path: str | Path,
    dtype: str = "f32",
    blocks: Mapping[str, Blocks] | None = None,
) -> Path:
    """Write `model` to the GGUF file `path` for llama.cpp (module docstring): matrices in `dtype`
    ("f32", "f16" or "q8_0"), `blocks` written as they are."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.constants import GGML_QUANT_VERSION

    if dtype not in DTYPES:
        raise UserError(f"unknown GGUF dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give the GGUF file's name (for example model.gguf)")
    own = own_blocks(model)
    if getattr(model, "quantization", None) and not own:
        raise UserError(
            f"this model is quantized ({model.quantization}), which GGUF's block types do not "
            "hold; save the float model and choose dtype='q8_0'"
        )
    cfg = model.config
    gguf_arch, arch = refuse_unrunnable(cfg)
    vocab = tokenizer_metadata(model.tokenizer, cfg)
    # a tied head with blocks of its own (quantize's) is written as output.weight (docstring)
    untied = cfg.replace(tie_embeddings=False) if "unembed.weight" in own else cfg
    tensors = gguf_tensors(model, arch, gguf_arch, blocks, untied)

    writer = GGUFWriter(None, gguf_arch)
    writer.add_name(cfg.extra.get("name") or path.stem)
    writer.add_context_length(cfg.n_ctx)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_mlp)
    writer.add_head_count(cfg.n_heads)
    writer.add_vocab_size(cfg.d_vocab)
    if gguf_arch == "gpt2":
        writer.add_layer_norm_eps(cfg.norm_eps)
    else:
        writer.add_head_count_kv(cfg.n_kv_heads)
        writer.add_key_length(cfg.d_head)
        writer.add_value_length(cfg.d_head)
        writer.add_rope_dimension_count(cfg.d_head)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        if cfg.rope_scaling == "linear":
            from gguf import RopeScalingType

            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(cfg.rope_scaling_factor)
    for key, value in vocab.items():
        kind = {str: GGUFValueType.STRING, bool: GGUFValueType.BOOL}.get(type(value))
        if isinstance(value, list):
            writer.add_array(f"tokenizer.ggml.{key}", value)
        elif kind is not None:
            writer.add_key_value(f"tokenizer.ggml.{key}", value, kind)
        else:
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
    if isinstance(cfg.extra.get("chat_template"), str):
        writer.add_chat_template(cfg.extra["chat_template"])

    fallback, kinds = [], []
    for name, tensor in tensors.items():
        if isinstance(tensor, Blocks):
            kind = GGMLQuantizationType[tensor.kind]
            writer.add_tensor(name, tensor.data, raw_dtype=kind)
            kinds.append(tensor.kind)
            continue
        kind = tensor_type(name, tensor, dtype)
        if kind != DTYPES[dtype][0] and tensor.dim() == 2 and kind != "F32":
            fallback.append(name)
        array, raw = encode(name, tensor, kind)
        writer.add_tensor(name, array, raw_dtype=raw)
        kinds.append(kind)
    if fallback:
        warnings.warn(
            f"{len(fallback)} matrices have rows that do not divide into Q8_0's blocks of 32 "
            f"values ({fallback[0]}: {tensors[fallback[0]].shape[-1]}); they are written as F16, "
            "as llama.cpp's converter does",
            stacklevel=2,
        )
    writer.add_file_type(_file_type(dtype, kinds))
    if any(kind not in ("F32", "F16") for kind in kinds):
        writer.add_quantization_version(GGML_QUANT_VERSION)

    def write(tmp: str) -> None:
        writer.write_header_to_file(path=Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(path, write)
    return path


def _file_type(dtype: str, kinds: list[str]) -> int:
    """general.file_type: the dtype's, or with ready-made blocks the type most matrices have."""
    from gguf import LlamaFileType

    matrices = [kind for kind in kinds if kind != "F32"] or ["F32"]
    common = max(set(matrices), key=matrices.count)
    if common == DTYPES[dtype][0]:
        return DTYPES[dtype][1]
    name = "ALL_F32" if common == "F32" else f"MOSTLY_{common}"
    return int(LlamaFileType[name]) if name in LlamaFileType.__members__ else DTYPES[dtype][1]
