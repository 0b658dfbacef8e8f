"""Architectures as a user downloads them: random-weight Hugging Face models made by transformers,
written to GGUF by llama.cpp's own converter (convert_hf_to_gguf.py with its gguf-py), read by
attnlab and compared with transformers on the same model (logits, attention patterns) and with
llama.cpp's `llama-simple` on the same file (greedy tokens), and with llama.cpp's logits on
quantized copies of it (top-1 agreement, KL; benchmarks/_llama_logits.py).

.venv/bin/python benchmarks/gguf_architectures.py [--llama-cpp SOURCES] [--bin BUILD/bin]
    [--only NAME ...] [--results benchmarks/results]

--llama-cpp names llama.cpp's sources (the folder with convert_hf_to_gguf.py, conversion/, gguf-py/
and models/ggml-vocab-*.gguf; default: what `make venv-test` unpacks into
.venv/llama.cpp-vocabularies, else $ATTNLAB_LLAMA_CPP_SOURCES); --bin a folder with llama-simple
(and llama-quantize, llama-tokenize and libllama.so), built from the same sources
(benchmarks/README.md). Without --bin the greedy and quantized columns say so. llama.cpp is never a
dependency of attnlab.

Design choices:
- The models come from small configs written here (`CONFIGS`: a few layers, d_model 256, each
  architecture's distinctive settings switched on; every row a multiple of 256 wide, so that the
  quantized copies' K-quants are K-quants and not llama-quantize's fallbacks), made by
  transformers with a fixed seed and weights drawn wider than its init (std 0.1 where it draws
  0.02, norms around 1) so that every part of the computation moves the logits; no weights are
  committed.
- The converter needs a tokenizer and checks a BPE tokenizer by the hash of its ids on a fixed text
  (convert_hf_to_gguf.py, get_vocab_base_pre). Nothing is downloaded: the BPE tokenizer.json is
  rebuilt from the GPT-2 vocabulary and merges llama.cpp ships (models/ggml-vocab-gpt-2.gguf), so
  its hash is GPT-2's; a SentencePiece tokenizer.model (Llama 2's, for llama, Gemma and Phi-3
  files) is written from models/ggml-vocab-llama-spm.gguf's pieces, scores and types, as the
  protobuf sentencepiece reads (a few fields, encoded here).
- The converter runs as a user runs it (`python convert_hf_to_gguf.py DIR --outtype f32`), in a
  subprocess, with the sources' own gguf-py; attnlab reads the file with `attnlab.load`.
- Logits are compared relative to the largest |logit| of transformers' (max |a - b| / max |b|),
  patterns absolutely (they are probabilities), both in float32 on the same token ids; transformers
  runs with eager attention so that its patterns are the softmax it computes.
- Greedy: llama-simple decodes from a prompt of token text; attnlab decodes greedily from the ids
  llama.cpp's tokenizer gives (the file's), and the two continuations are compared as text.
- Quantized copies (Q8_0, Q4_0, Q4_K_M by llama-quantize from the f32 file): llama.cpp's logits at
  every position of a text (benchmarks/anchors/llama_logits.c) against attnlab's on the same ids,
  dequantized and with keep_blocks=True; bounds and design in benchmarks/_llama_logits.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCABULARIES = ROOT / ".venv" / "llama.cpp-vocabularies"
RESULTS = ROOT / "benchmarks" / "results"
SEED = 0
# logits: max |attnlab - transformers| / max |transformers|; patterns: max |difference|
LOGITS_BOUND, PATTERN_BOUND = 1e-4, 1e-5


@dataclass(frozen=True)
class Case:
    """One architecture: the Hugging Face model_type and config fields, the tokenizer the converter
    reads (bpe: GPT-2's tokenizer.json; qwen2: Qwen2's; spm: Llama 2's tokenizer.model), the GGUF
    architecture the converter writes."""

    name: str
    model_type: str
    settings: dict
    tokenizer: str
    gguf_architecture: str
    tokenizer_config: dict = field(default_factory=dict)
    # config.json keys as the architecture's published checkpoints have them, which transformers 5
    # no longer writes but the converter reads (Pythia's rotary_pct, GPT-2's n_ctx)
    config_json: dict = field(default_factory=dict)


# every width a multiple of 256 (d_model, d_mlp, heads x d_head), so that the K-quants' blocks of
# 256 fit each row and llama-quantize writes Q4_K_M as Q4_K and Q6_K rather than its fallbacks
SMALL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512)
SMALL_POSITIONS = dict(max_position_embeddings=256)

CONFIGS = [
    Case(
        "llama-spm",
        "llama",
        dict(**SMALL, **SMALL_POSITIONS, num_key_value_heads=2, vocab_size=32000),
        "spm",
        "llama",
    ),
    Case(
        "gptneox",
        "gpt_neox",
        dict(**SMALL, **SMALL_POSITIONS, vocab_size=50257, rotary_pct=0.25),
        "bpe",
        "gptneox",
        config_json=dict(rotary_pct=0.25, rotary_emb_base=10000),
    ),
    Case(
        "phi3",
        "phi3",
        # Phi-3-mini's vocabulary (Llama 2's and 64 more, padded by the converter) and window
        # (longer than the prompts: llama.cpp runs phi3 files without it)
        dict(
            **SMALL,
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            vocab_size=32064,
            sliding_window=2047,
        ),
        "spm",
        "phi3",
        # Phi-3-mini's added tokens (llama.cpp looks <|endoftext|> up in a Phi-3's vocabulary)
        tokenizer_config={
            "added_tokens_decoder": {
                str(i): {"content": text, "special": True}
                for i, text in (
                    (32000, "<|endoftext|>"),
                    (32001, "<|assistant|>"),
                    (32006, "<|system|>"),
                    (32007, "<|end|>"),
                    (32010, "<|user|>"),
                )
            }
        },
    ),
    Case(
        "gemma",
        "gemma",
        dict(**SMALL, **SMALL_POSITIONS, num_key_value_heads=1, head_dim=64, vocab_size=32000),
        "spm",
        "gemma",
    ),
    Case(
        "stablelm",
        "stablelm",
        dict(
            **SMALL, **SMALL_POSITIONS, num_key_value_heads=2, vocab_size=50257, use_qkv_bias=True
        ),
        "bpe",
        "stablelm",
    ),
    Case(
        "starcoder2",
        "starcoder2",
        # StarCoder2's window (longer than the prompts: llama.cpp runs the files without it)
        dict(
            **SMALL, **SMALL_POSITIONS, num_key_value_heads=2, vocab_size=50257, sliding_window=4096
        ),
        "bpe",
        "starcoder2",
    ),
    Case(
        "gemma2",
        "gemma2",
        # a window shorter than the prompt on blocks 0, 2, ...; caps low enough to bend the random
        # model's scores and logits (Gemma 2's own are 50 and 30); the query scalar llama.cpp
        # uses (1/sqrt(head_dim)), which transformers reads from query_pre_attn_scalar
        dict(
            **{**SMALL, "num_hidden_layers": 3},
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=32000,
            sliding_window=8,
            query_pre_attn_scalar=64,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        "spm",
        "gemma2",
    ),
    Case(
        "granite",
        "granite",
        dict(
            **SMALL,
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            vocab_size=50257,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0625,
            logits_scaling=8.0,
        ),
        "bpe",
        "granite",
    ),
    Case(
        "olmo2",
        "olmo2",
        dict(**SMALL, **SMALL_POSITIONS, num_key_value_heads=2, vocab_size=50257, pad_token_id=1),
        "bpe",
        "olmo2",
    ),
    Case(
        "phi2",
        "phi",
        # Phi-2's MLP width, 4 x d_model (the converter writes it so, and llama.cpp checks it)
        dict(
            **{**SMALL, "intermediate_size": 4 * SMALL["hidden_size"]},
            **SMALL_POSITIONS,
            vocab_size=50257,
            partial_rotary_factor=0.5,
        ),
        "bpe",
        "phi2",
    ),
    Case(
        "falcon",
        "falcon",
        dict(
            hidden_size=SMALL["hidden_size"],
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=50257,
            new_decoder_architecture=False,
            # Falcon-7B's one key/value head, said twice: transformers 5's config sets num_kv_heads
            # to the head count, which the converter reads as the key/value heads
            multi_query=True,
            num_kv_heads=1,
            parallel_attn=True,
            bias=False,
        ),
        "bpe",
        "falcon",
    ),
    Case(
        "command-r",
        "cohere",
        dict(
            **SMALL, **SMALL_POSITIONS, num_key_value_heads=2, vocab_size=50257, logit_scale=0.0625
        ),
        "bpe",
        "command-r",
    ),
    # the architectures read before this table: llama with a byte-level BPE vocabulary (Llama 3's
    # kind), Mistral (written as llama), Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 3 (a window
    # on some blocks, q/k norms, sandwich norms), GPT-2 (learned positions, fused q/k/v)
    Case(
        "llama-bpe",
        "llama",
        dict(**SMALL, **SMALL_POSITIONS, num_key_value_heads=2, vocab_size=50257),
        "bpe",
        "llama",
    ),
    Case(
        "mistral",
        "mistral",
        # Mistral 7B's window (longer than the prompts) and vocabulary (Llama 2's SentencePiece)
        dict(
            **SMALL, **SMALL_POSITIONS, num_key_value_heads=2, vocab_size=32000, sliding_window=4096
        ),
        "spm",
        "llama",
    ),
    Case(
        "qwen2",
        "qwen2",
        # Qwen2's own vocabulary (transformers reads a qwen2 directory's tokenizer as Qwen2's), its
        # embedding tied as Qwen2.5-0.5B's
        dict(
            **SMALL,
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        "qwen2",
        "qwen2",
    ),
    Case(
        "qwen3",
        "qwen3",
        dict(**SMALL, **SMALL_POSITIONS, num_key_value_heads=2, head_dim=64, vocab_size=50257),
        "bpe",
        "qwen3",
    ),
    Case(
        "gemma3",
        "gemma3_text",
        # a window shorter than the prompt on the sliding blocks; six blocks, Gemma 3's pattern
        # (five sliding, then one global: the converter does not write it, llama.cpp assumes it);
        # the query scalar llama.cpp uses (1/sqrt(head_dim))
        dict(
            **{**SMALL, "num_hidden_layers": 6},
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=32000,
            sliding_window=8,
            query_pre_attn_scalar=64,
        ),
        "spm",
        "gemma3",
    ),
    Case(
        "gpt2",
        "gpt2",
        dict(n_embd=256, n_layer=2, n_head=4, n_positions=256, vocab_size=50257),
        "bpe",
        "gpt2",
        config_json=dict(n_ctx=256),
    ),
    # mixtures of experts, 256 wide per expert; each token's two experts of several
    Case(
        "mixtral",
        "mixtral",
        dict(
            **{**SMALL, "intermediate_size": 256},
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            vocab_size=32000,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "spm",
        "llama",
    ),
    Case(
        "qwen2moe",
        "qwen2_moe",
        # Qwen1.5-MoE's shared expert (gated, beside the routed ones) and unrenormalised top-k
        dict(
            **SMALL,
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            vocab_size=50257,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=512,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        "bpe",
        "qwen2moe",
    ),
    Case(
        "qwen3moe",
        "qwen3_moe",
        dict(
            **SMALL,
            **SMALL_POSITIONS,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=50257,
            moe_intermediate_size=256,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        "bpe",
        "qwen3moe",
    ),
]
BY_NAME = {case.name: case for case in CONFIGS}


# Tokenizers ------------------------------------------------------------------------------------


def _vocabulary(sources: Sources, name: str) -> dict:
    """The metadata of llama.cpp's ggml-vocab-NAME.gguf, read by gguf-py (attnlab's dependency)."""
    from gguf import GGUFReader

    reader = GGUFReader(sources.vocabularies / f"ggml-vocab-{name}.gguf")
    return {key: field.contents() for key, field in reader.fields.items()}


# Qwen2's pre-tokenizer (its tokenizer.json's Split), before the byte-level mapping
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def write_bpe_tokenizer(sources: Sources, directory: Path, name: str = "gpt-2") -> None:
    """A byte-level BPE tokenizer as tokenizer.json, rebuilt from llama.cpp's copy of its
    vocabulary and merges (ggml-vocab-NAME.gguf), so that the converter's hash of it is the
    original's: GPT-2's (its <|endoftext|> one of the BPE's tokens, as GPT-2's tokenizer.json has
    it) or Qwen2's (its split before the bytes, its control tokens added as special tokens after
    the BPE's, llama.cpp's padding dropped: the converter pads to the model's vocabulary again).
    transformers loads a qwen2 directory's tokenizer as Qwen2Tokenizer whatever tokenizer.json
    says, so a Qwen2 model gets Qwen2's vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _vocabulary(sources, name)
    tokens, types = vocab["tokenizer.ggml.tokens"], vocab["tokenizer.ggml.token_type"]
    merges = [tuple(merge.split(" ")) for merge in vocab["tokenizer.ggml.merges"]]
    control = [t for t, kind in zip(tokens, types) if kind == 3] if name == "qwen2" else []
    pieces = [t for t, kind in zip(tokens, types) if kind == 1 or (kind == 3 and not control)]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(pieces)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=name != "qwen2")
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), byte_level]
        )
        if name == "qwen2"
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    end = tokens[vocab["tokenizer.ggml.eos_token_id"]]
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=end, eos_token=end)
    fast.add_special_tokens({"additional_special_tokens": control} if control else {})
    fast.save_pretrained(directory)


def _protobuf_field(number: int, wire: int, payload: bytes) -> bytes:
    key = _varint(number << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def write_spm_tokenizer(sources: Sources, directory: Path) -> None:
    """Llama 2's SentencePiece model as tokenizer.model, from llama.cpp's copy of its pieces,
    scores and types: sentencepiece's ModelProto (sentencepiece_model.proto) with the fields the
    converter reads: pieces (1: piece 1, score 2, type 3), trainer_spec (2: model_type 3 = BPE,
    vocab_size 4, byte_fallback 35, unk/bos/eos/pad ids 40-43) and normalizer_spec (3: name 1,
    add_dummy_prefix 3, remove_extra_whitespaces 4, escape_whitespaces 5)."""
    vocab = _vocabulary(sources, "llama-spm")
    pieces = b""
    for piece, score, kind in zip(
        vocab["tokenizer.ggml.tokens"],
        vocab["tokenizer.ggml.scores"],
        vocab["tokenizer.ggml.token_type"],
    ):
        body = (
            _protobuf_field(1, 2, piece.encode("utf-8"))
            + _protobuf_field(2, 5, struct.pack("<f", score))
            + _protobuf_field(3, 0, _varint(kind))
        )
        pieces += _protobuf_field(1, 2, body)
    ids = [vocab.get(f"tokenizer.ggml.{key}_token_id", -1) for key in ("unknown", "bos", "eos")]
    trainer = (
        _protobuf_field(3, 0, _varint(2))
        + _protobuf_field(4, 0, _varint(len(vocab["tokenizer.ggml.tokens"])))
        + _protobuf_field(35, 0, _varint(1))
        + b"".join(_protobuf_field(40 + i, 0, _varint(v)) for i, v in enumerate(ids))
        + _protobuf_field(43, 0, _varint(2**64 - 1))  # pad_id -1, as int32 varints are written
    )
    normalizer = (
        _protobuf_field(1, 2, b"identity")
        + _protobuf_field(3, 0, _varint(1))
        + _protobuf_field(4, 0, _varint(0))
        + _protobuf_field(5, 0, _varint(1))
    )
    model = pieces + _protobuf_field(2, 2, trainer) + _protobuf_field(3, 2, normalizer)
    (directory / "tokenizer.model").write_bytes(model)
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"add_bos_token": True, "add_eos_token": False, "tokenizer_class": "LlamaTokenizer"}
        ),
        encoding="utf-8",
    )


# Models, the converter, the comparisons ----------------------------------------------------------


@dataclass(frozen=True)
class Sources:
    """llama.cpp's converter (the folder of convert_hf_to_gguf.py, conversion/ and gguf-py/) and
    its tokenizer tests' vocabularies (ggml-vocab-*.gguf)."""

    converter: Path
    vocabularies: Path


def find_sources(given: str | None = None) -> Sources | None:
    """llama.cpp's sources: `given` or $ATTNLAB_LLAMA_CPP_SOURCES (a llama.cpp tree), else what
    `make venv-test` unpacks (.venv/llama.cpp-vocabularies and its converter/); None without a
    converter."""
    for tree in (given, os.environ.get("ATTNLAB_LLAMA_CPP_SOURCES")):
        if tree and (Path(tree) / "convert_hf_to_gguf.py").is_file():
            return Sources(Path(tree), Path(tree) / "models")
    if (VOCABULARIES / "converter" / "convert_hf_to_gguf.py").is_file():
        return Sources(VOCABULARIES / "converter", VOCABULARIES)
    return None


def make_model(case: Case, directory: Path):
    """The random-weight transformers model of `case`, saved with its tokenizer into `directory`
    (safetensors, as a Hub repository holds it); returns the model, in eval mode, eager
    attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(case.model_type, **case.settings)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # wider than transformers' init, so that every part moves the logits
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    if case.config_json:
        path = directory / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps({**config, **case.config_json}, indent=1), encoding="utf-8")
    return model


def write_tokenizer(case: Case, sources: Sources, directory: Path) -> None:
    if case.tokenizer == "bpe":
        write_bpe_tokenizer(sources, directory)
    elif case.tokenizer == "qwen2":
        write_bpe_tokenizer(sources, directory, "qwen2")
    else:
        write_spm_tokenizer(sources, directory)
    if case.tokenizer_config:
        path = directory / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps({**config, **case.tokenizer_config}), encoding="utf-8")


# Runs convert_hf_to_gguf.main() once per (model folder, output file) in one process (one import of
# torch and transformers for all of them), each with the argv a user gives it; a failure is printed
# as one line starting with FAILED and the next one runs. One change to the converter: its hparams
# (AutoConfig's dict) get back the config.json keys transformers 5 drops (GPT-NeoX's rotary_pct,
# which the converter reads: without it a Pythia checkpoint fails to convert under transformers 5).
_DRIVER = """
import json, sys, traceback
converter, outtype, *pairs = sys.argv[1:]
sys.path.insert(0, converter)
import convert_hf_to_gguf
from conversion.base import ModelBase
load_hparams = ModelBase.load_hparams
def with_file_keys(dir_model, is_mistral_format):
    hparams = load_hparams(dir_model, is_mistral_format)
    raw = json.loads((dir_model / "config.json").read_text(encoding="utf-8"))
    return {**raw, **hparams}
ModelBase.load_hparams = staticmethod(with_file_keys)
for directory, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", directory, "--outfile", out, "--outtype", outtype]
    try:
        convert_hf_to_gguf.main()
    except BaseException as exc:
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        print("FAILED", directory, line, flush=True)
"""


def convert(sources: Sources, jobs: list[tuple[Path, Path]], outtype: str = "f32") -> dict:
    """llama.cpp's converter on each (model folder, output file), as `python convert_hf_to_gguf.py
    DIR --outfile OUT --outtype OUTTYPE`; {folder: the converter's error} for those that failed."""
    pairs = [str(p) for job in jobs for p in job]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(sources.converter), outtype, *pairs],
        capture_output=True,
        text=True,
    )
    failed = {}
    for line in done.stdout.splitlines():
        if line.startswith("FAILED "):
            _, directory, error = line.split(" ", 2)
            failed[directory] = error
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py could not run:\n{done.stderr[-3000:]}")
    return failed


def prompt_ids(vocab_size: int, length: int = 24):
    import torch

    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(3, vocab_size, (1, length), generator=generator)


def compare_with_transformers(reference, path: Path) -> dict:
    """attnlab on the converted file against transformers on the model it came from: logits
    (relative to the largest) and every layer's pattern, on the same ids."""
    import torch

    import attnlab

    model = attnlab.load(str(path))
    ids = prompt_ids(reference.config.vocab_size)
    with torch.no_grad():
        theirs = reference(ids, output_attentions=True)
        logits, cache = model.run_with_cache(ids, names_filter=lambda name: "hook_pattern" in name)
    gguf_architecture = model.config.extra.get("gguf_architecture")
    logits_error = float((logits - theirs.logits).abs().max() / theirs.logits.abs().max())
    pattern_error = max(
        float((cache[f"blocks.{i}.attn.hook_pattern"] - pattern).abs().max())
        for i, pattern in enumerate(theirs.attentions)
    )
    return {
        "gguf_architecture": gguf_architecture,
        "logits_relative_error": logits_error,
        "pattern_max_error": pattern_error,
        "model": model,
    }


PROMPT, NEW_TOKENS = "The quick brown fox", 16


def prepare(case: Case, sources: Sources, work: Path):
    """The model of `case` saved with its tokenizer in work/NAME: (the transformers model, the
    folder, the GGUF file the converter is to write)."""
    directory = work / case.name
    directory.mkdir(parents=True, exist_ok=True)
    reference = make_model(case, directory)
    write_tokenizer(case, sources, directory)
    return reference, directory, work / f"{case.name}-f32.gguf"


def run_case(case: Case, reference, path: Path, failed: str | None, binaries: Path | None) -> dict:
    row: dict = {"architecture": case.name, "hf_model_type": case.model_type}
    if failed is not None:
        return {**row, "error": f"convert_hf_to_gguf.py: {failed}"}
    row["file"] = f"convert_hf_to_gguf.py --outtype f32 ({path.stat().st_size:,} bytes)"
    try:
        found = compare_with_transformers(reference, path)
    except Exception as exc:  # a refusal (UserError) or a failure: the row says which
        message = str(exc).splitlines()[0].replace(str(path), path.name)
        return {**row, "error": f"{type(exc).__name__}: {message}"}
    model = found.pop("model")
    row.update(found)
    row["within_bounds"] = (
        found["logits_relative_error"] <= LOGITS_BOUND
        and found["pattern_max_error"] <= PATTERN_BOUND
    )
    if binaries is not None and (binaries / "llama-simple").is_file():
        from gguf_write_llama_cpp import greedy_text, llama_simple

        ours = greedy_text(model, PROMPT, NEW_TOKENS)
        theirs = llama_simple(binaries, path, PROMPT, NEW_TOKENS)
        row["greedy_equal_llama_simple"] = ours == theirs
        row["greedy_text"] = ours
        if ours != theirs:
            row["greedy_note"] = f"attnlab {ours!r} vs llama-simple {theirs!r}"
            row["greedy_parting"] = greedy_parting(model, ours, theirs)
    else:
        row["greedy_equal_llama_simple"] = None
        row["greedy_note"] = "no llama-simple (--bin)"
    return row


def greedy_parting(model, ours: str, theirs: str) -> dict | None:
    """Where attnlab's greedy text parts from llama-simple's: the step, attnlab's float32 margin
    there (its top logit over the runner-up), and whether attnlab picks llama-simple's token
    with every key and value rounded to float16, as llama-simple's KV cache holds them (llama.cpp's
    default; the logits anchor keeps them in float32). A flip at a margin that rounding closes is
    the cache's, not a different model; None if the texts part inside a token."""
    import torch

    from attnlab.generate.loop import generate

    prompt = torch.tensor([model.tokenizer.encode(PROMPT)])
    ids = generate(model, prompt, max_new_tokens=NEW_TOKENS, temperature=0)[0].tolist()
    assert model.tokenizer.decode(ids) == ours  # the same greedy run as greedy_text's
    start = prompt.shape[1]
    for step in range(start, len(ids)):
        if not theirs.startswith(model.tokenizer.decode(ids[: step + 1])):
            break
    else:
        return None
    names = [f"blocks.{i}.attn.hook_{kv}" for i in range(model.config.n_layers) for kv in "kv"]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:step]]))[0, -1]
        rounded = model.run_with_hooks(
            torch.tensor([ids[:step]]),
            fwd_hooks=[(name, lambda x, hook: x.half().float()) for name in names],
        )[0, -1]
    top = logits.topk(2).values
    pick = int(rounded.argmax())
    return {
        "step": step - start,
        "margin_float32": float(top[0] - top[1]),
        "float16_kv_gives_llama_simple": theirs.startswith(
            model.tokenizer.decode(ids[:step] + [pick])
        ),
    }


def run_quantized(row: dict, path: Path, anchor, work: Path) -> None:
    """The quantized copies' comparisons with llama.cpp's logits into `row` (its "quantized" rows
    and whether all are within their bounds); `anchor` is (build, compiled program) or None."""
    if "error" in row:
        return
    if anchor is None:
        row["quantized_note"] = "no llama.cpp build (--bin)"
        return
    from _llama_logits import compare_formats

    row["quantized"] = compare_formats(*anchor, path, work)
    row["quantized_within_bounds"] = all(
        "error" not in q
        and all(q[p].get("within_bounds") for p in ("dequantized", "blocks") if p in q)
        for q in row["quantized"]
    )


def quantized_cell(row: dict) -> str:
    """The table's cell for the quantized copies: per format, top-1 agreement and mean KL of the
    dequantized load (of the blocks' decode step), the format's own KL from f32, and the tensor
    types llama-quantize wrote (`tensor_kinds`)."""
    if "quantized" not in row:
        return row.get("quantized_note", "")
    cells = []
    for q in row["quantized"]:
        if "error" in q:
            cells.append(f"{q['format']}: {q['error']}")
            continue
        text = f"{q['format']}: " + ", ".join(
            f"{name} {q[name]['top1']:.3f} / {q[name]['kl_mean']:.1e}"
            if "error" not in q[name]
            else f"{name} {q[name]['error']}"
            for name in ("dequantized", "blocks")
            if name in q
        )
        if "format_cost" in q:
            text += f" (format's own KL {q['format_cost']['kl_mean']:.1e})"
        if "tensor_types" in q:
            text += f" [{tensor_kinds(q)}]"
        cells.append(text)
    return "; ".join(cells)


def tensor_kinds(q: dict) -> str:
    """The tensor types a quantized copy holds, read back from the file by gguf-py's reader, with
    their counts ("Q4_K 13, Q6_K 3, F32 5"), the most frequent first."""
    counts = sorted(q["tensor_types"].items(), key=lambda kind: (-kind[1], kind[0]))
    return ", ".join(f"{kind} {count}" for kind, count in counts)


def versions(sources: Sources) -> dict:
    import torch
    import transformers

    import attnlab

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "attnlab": getattr(attnlab, "__version__", "?"),
        "attnlab_commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_converter": str(sources.converter),
        "python": platform.python_version(),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| architecture | file (llama.cpp's converter) | logits vs transformers (rel.) | "
        "patterns (max abs.) | greedy = llama-simple | "
        "top-1 / mean KL vs llama.cpp, quantized copies |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(
                f"| {row['architecture']} | {row.get('file', '-')} | {row['error']} | | | |"
            )
            continue
        greedy = {True: "yes", False: "no", None: "not run"}[row["greedy_equal_llama_simple"]]
        if row.get("greedy_parting"):
            parting = row["greedy_parting"]
            greedy += (
                f" (token {parting['step']}: a margin of {parting['margin_float32']:.1e}, "
                + ("which" if parting["float16_kv_gives_llama_simple"] else "not one")
                + " float16 keys and values, llama-simple's cache, flip)"
            )
        lines.append(
            f"| {row['architecture']} ({row['gguf_architecture']}) | {row['file']} | "
            f"{row['logits_relative_error']:.1e} | {row['pattern_max_error']:.1e} | {greedy} | "
            f"{quantized_cell(row)} |"
        )
    return "\n".join(lines)


def figures(rows: list[dict]) -> list[dict]:
    """The rows as the results record's figures (benchmarks/_common.py, write_result): for each
    architecture attnlab reads, its two errors and whether its greedy text is llama-simple's; an
    architecture refused stays in the record's details with its one-line reason."""
    out = []
    for row in rows:
        if "error" in row:
            continue
        name = row["architecture"]
        out += [
            {
                "name": f"{name}: logits vs transformers, relative",
                "unit": "",
                "attnlab": row["logits_relative_error"],
                "anchor": None,
                "ratio": None,
                "better": "lower",
            },
            {
                "name": f"{name}: patterns vs transformers",
                "unit": "",
                "attnlab": row["pattern_max_error"],
                "anchor": None,
                "ratio": None,
                "better": "lower",
            },
        ]
        if row.get("greedy_equal_llama_simple") is not None:
            out.append(
                {
                    "name": f"{name}: greedy text equal to llama-simple's",
                    "unit": "",
                    "attnlab": int(row["greedy_equal_llama_simple"]),
                    "anchor": None,
                    "ratio": None,
                    "better": "higher",
                }
            )
        out += quantized_figures(row)
    return out


def quantized_figures(row: dict) -> list[dict]:
    """Per quantized copy: top-1 agreement and mean KL of the dequantized load against llama.cpp
    (beside the KL: the format's own, llama.cpp's copy against its f32 file, as the anchor), and
    the mean KL of the blocks' decode step."""
    out = []
    for q in row.get("quantized", []):
        name = f"{row['architecture']} {q['format']}"
        deq, blocks = q.get("dequantized", {}), q.get("blocks", {})
        cost = q.get("format_cost", {}).get("kl_mean")
        # what llama-quantize wrote (none for the f32 file itself)
        held = f" (the copy's tensors: {tensor_kinds(q)})" if "tensor_types" in q else ""
        if "top1" in deq:
            out += [
                {
                    "name": f"{name}: top-1 agreement with llama.cpp, dequantized",
                    "unit": "",
                    "attnlab": deq["top1"],
                    "anchor": None,
                    "ratio": None,
                    "better": "higher",
                },
                {
                    "name": f"{name}: mean KL(llama.cpp || attnlab), dequantized; anchor: the "
                    "format's own KL from f32" + held,
                    "unit": "",
                    "attnlab": deq["kl_mean"],
                    "anchor": cost,
                    "ratio": None,
                    "better": "lower",
                },
            ]
        if "kl_mean" in blocks:
            out.append(
                {
                    "name": f"{name}: mean KL(llama.cpp || attnlab), blocks' decode step",
                    "unit": "",
                    "attnlab": blocks["kl_mean"],
                    "anchor": None,
                    "ratio": None,
                    "better": "lower",
                }
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", help="llama.cpp's sources (with convert_hf_to_gguf.py)")
    parser.add_argument(
        "--bin",
        help="a llama.cpp build's bin folder (llama-simple, llama-quantize, llama-tokenize, "
        "libllama.so) from those sources",
    )
    parser.add_argument("--only", nargs="*", choices=sorted(BY_NAME), help="run these only")
    parser.add_argument("--results", default=str(RESULTS), help="the folder of results records")
    args = parser.parse_args()
    sources = find_sources(args.llama_cpp)
    if sources is None:
        raise SystemExit(
            "no llama.cpp sources with convert_hf_to_gguf.py: run `make venv-test` or give "
            "--llama-cpp DIR"
        )
    binaries = Path(args.bin) if args.bin else None
    from _common import write_result
    from _llama_logits import BOUNDS, TOKENS, MissingBuild, compile_anchor, find_build

    anchor = None
    if binaries is not None:
        try:
            build = find_build(binaries, args.llama_cpp)
            anchor = (build, compile_anchor(build))
        except MissingBuild as exc:
            raise SystemExit(str(exc)) from None

    rows = []
    cases = [BY_NAME[name] for name in args.only] if args.only else CONFIGS
    with tempfile.TemporaryDirectory() as work:
        prepared = [prepare(case, sources, Path(work)) for case in cases]
        failed = convert(sources, [(directory, path) for _, directory, path in prepared])
        for case, (reference, directory, path) in zip(cases, prepared):
            row = run_case(case, reference, path, failed.get(str(directory)), binaries)
            run_quantized(row, path, anchor, Path(work))
            print(table([row]).splitlines()[-1], flush=True)
            rows.append(row)
    write_result(
        Path(args.results),
        "gguf_architectures",
        measures=(
            "Architectures as llama.cpp's converter writes them: a random-weight transformers "
            "model of each, written to GGUF (convert_hf_to_gguf.py --outtype f32), read by "
            "attnlab; its logits (max error relative to the largest) and attention patterns (max "
            "error) against transformers on the same model, and its greedy text against "
            "llama-simple's on the file "
            "(1 = equal); on quantized copies of the file made by llama-quantize, the share of "
            f"positions of a {TOKENS}-token text whose top-1 token is llama.cpp's and the mean "
            "over positions of KL(llama.cpp || attnlab), beside the format's own KL (llama.cpp "
            "on the copy against llama.cpp on the f32 file). "
            f"Bounds: logits {LOGITS_BOUND:g}, patterns {PATTERN_BOUND:g}; the f32 file top-1 >= "
            f"{BOUNDS['F32'][0]:g}, mean KL <= {BOUNDS['F32'][1]:g}; quantized copies top-1 >= "
            f"{BOUNDS['quantized'][0]:g}, mean KL <= {BOUNDS['quantized'][1]:g} x the format's "
            f"own and <= {BOUNDS['quantized'][2]:g} x the Q8_0 copy's own."
        ),
        anchor="transformers, llama.cpp's llama-simple and logits (libllama)",
        anchor_version=", ".join(f"{k} {v}" for k, v in versions(sources).items()),
        figures=figures(rows),
        details={
            "rows": rows,
            "bounds": {
                "logits_relative": LOGITS_BOUND,
                "pattern_abs": PATTERN_BOUND,
                # F32: (top-1 at least, mean KL at most); quantized: (top-1 at least, mean KL
                # at most as a multiple of the format's own, of the Q8_0 copy's own)
                "llama_cpp_logits": {k: list(v) for k, v in BOUNDS.items()},
            },
        },
    )
    print(table(rows))
    return (
        0
        if all(
            row.get("within_bounds") and row.get("quantized_within_bounds", True) for row in rows
        )
        else 1
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
