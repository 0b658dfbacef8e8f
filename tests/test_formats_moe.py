"""Mixtures of experts (attnlab.model.moe) against transformers: Mixtral, Qwen2-MoE (a gated
shared expert, top-k weights not renormalised) and Qwen3-MoE (qk-norm, renormalised), random tiny
models saved with save_pretrained and loaded with attnlab.load. Logits within 1e-4 relative and
patterns within 1e-5, as every other architecture (tests/test_formats_hf.py); the router's choices
through run_with_cache's hook names, as TransformerLens names them.

GGUF: files in llama.cpp's layout (tests/gguf_files.py, the experts stacked into 3-D tensors as
the converter stacks them) put each expert's matrices where they belong, as floats or as blocks
per expert; with llama.cpp's converter as `make venv-test` unpacks it (the anchor, never a
dependency), files written by its own converter from the transformers models match transformers.
Generation: the C decode step's experts (one program, greedy generation in C) are
tests/test_moe_step.py's, under every kernel build.

The routers' weights are scaled up so that no token's k-th and (k+1)-th experts are within
rounding of each other: a near tie would let the two implementations pick different experts for
reasons that are not a mistake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf_files import smollm2_path, write_model
from hf_models import save_random

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.errors import UserError  # noqa: E402
from attnlab.formats.compare import compare  # noqa: E402
from attnlab.model.config import ModelConfig  # noqa: E402
from attnlab.model.moe import MoE  # noqa: E402
from attnlab.quant.blocks import BlockLinear  # noqa: E402

OUTPUT_RTOL = 1e-4
PATTERN_ATOL = 1e-5
SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
SIZES = dict(
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    **SPECIAL,
)
CASES = {  # (model class, config class, config) of transformers
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(vocab_size=91, intermediate_size=40, num_local_experts=5, num_experts_per_tok=2),
    ),
    "qwen2_moe-shared-expert": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            vocab_size=83,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe-qk-norm": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            vocab_size=77,
            intermediate_size=64,
            moe_intermediate_size=20,
            num_experts=7,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=16,
        ),
    ),
}


def build_hf(case: str, directory, **changes):
    """A random model of `case` (its config with `changes`), its norms perturbed and its routers
    sharpened, saved."""
    model_class, config_class, config = CASES[case]
    config = getattr(transformers, config_class)(**{**SIZES, **config, **changes})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):  # the router (Mixtral's and Qwen's)
                p.mul_(100.0)
    return save_random(model, directory)


@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_transformers(case, seed, tmp_path):
    build_hf(case, tmp_path)
    model = attnlab.load(tmp_path)
    assert model.config.n_experts > 0 and isinstance(model.blocks[0].mlp, MoE)
    result = compare(tmp_path, ids=torch.randint(0, model.config.d_vocab, (1, 11)))
    assert result.output_relative <= OUTPUT_RTOL, result.table()
    assert max(result.pattern) <= PATTERN_ATOL, result.table()


def test_router_choices_are_in_the_cache(seed, tmp_path):
    """hook_expert_weights is the router's softmax over every expert, hook_expert_indices each
    token's top-k of it; a hook that changes the indices changes the output."""
    build_hf("qwen3_moe-qk-norm", tmp_path)
    model = attnlab.load(tmp_path)
    ids = torch.randint(0, model.config.d_vocab, (2, 9))
    logits, cache = model.run_with_cache(ids)
    scores = cache["blocks.1.mlp.hook_expert_weights"]
    chosen = cache["blocks.1.mlp.hook_expert_indices"]
    assert scores.shape == (2, 9, 7) and chosen.shape == (2, 9, 2)
    torch.testing.assert_close(scores.sum(-1), torch.ones(2, 9))
    assert torch.equal(chosen, scores.topk(2).indices)
    router = model.blocks[1].mlp.W_gate.weight
    resid = cache["blocks.1.hook_resid_mid"]
    normed = model.blocks[1].ln2(resid)
    torch.testing.assert_close(scores, torch.softmax(normed @ router.T, -1))
    expert_in = cache["blocks.1.mlp.experts.0.hook_pre"]  # [tokens routed to expert 0, d_mlp]
    assert expert_in.shape == (int((chosen == 0).sum()), 20)

    def other_experts(indices, hook):
        return (indices + 1) % 7

    with torch.no_grad():
        edited = model.run_with_hooks(
            ids, fwd_hooks=[("blocks.1.mlp.hook_expert_indices", other_experts)]
        )
    assert not torch.allclose(edited, logits)
    # the lens's views take a mixture of experts: no output bias of its own
    assert not model.accumulated_bias(2).any()


def test_moe_config_errors():
    base = dict(positional="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_experts=4)
    with pytest.raises(UserError, match="experts_per_token must be 1 to n_experts"):
        ModelConfig(**base, experts_per_token=5)
    with pytest.raises(UserError, match="SwiGLU experts without biases"):
        ModelConfig(**{**base, "mlp": "gelu"}, experts_per_token=2)
    with pytest.raises(UserError, match="set n_experts too"):
        ModelConfig(d_shared_expert=8)


def test_dense_layers_among_experts_and_writing_are_refused(tmp_path):
    model = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=50,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            **SIZES,
        )
    )
    model.save_pretrained(tmp_path)
    build_hf("mixtral", tmp_path / "moe")
    with pytest.raises(UserError, match=r"mlp_only_layers \[1\]\) are not supported"):
        attnlab.load(tmp_path)
    with pytest.raises(UserError, match="cannot save a mixture of experts as Hugging Face"):
        attnlab.save(attnlab.load(tmp_path / "moe"), tmp_path / "out", format="hf")


# GGUF ---------------------------------------------------------------------------------------------

# llama.cpp's converter as `make venv-test` unpacks it from the llama-cpp-python sdist (or a
# llama.cpp tree in $ATTNLAB_LLAMA_CPP_SOURCES, as benchmarks/gguf_architectures.py reads it)
LLAMA_CPP = Path(
    os.environ.get("ATTNLAB_LLAMA_CPP_SOURCES")
    or Path(__file__).resolve().parents[1] / ".venv" / "llama.cpp-vocabularies" / "converter"
)
GGUF_CASES = {  # GGUF architecture: (n_experts, experts_per_token, expert width, shared width)
    "llama": (4, 2, 64, 0),
    "qwen2moe": (6, 3, 32, 64),
    "qwen3moe": (5, 2, 32, 0),
}


def moe_file(
    path: Path,
    arch: str,
    matrix=GGMLQuantizationType.F32,
    d_model: int = 64,
    width: int | None = None,
    flat_shared_gate: bool = False,
) -> Path:
    """A random mixture of experts in llama.cpp's layout: tests/gguf_files.py's model with its
    dense MLPs replaced by the converter's tensors (ffn_gate_inp [n_experts, d_model], the experts
    stacked [n_experts, rows, cols], Qwen2-MoE's shared expert and its one-row gate). `width`: the
    experts' and the shared expert's (GGUF_CASES' by default; the K-quants need 256 of each and of
    d_model). `flat_shared_gate`: the shared expert's gate written [d_model] as llama-quantize
    writes it again (ggml drops a trailing dimension of 1); the converter writes [1, d_model]."""
    n_experts, k, case_width, shared = GGUF_CASES[arch]
    width, shared = (case_width, shared) if width is None else (width, width if shared else 0)
    rng = np.random.default_rng(0)
    d_head = d_model // 4  # write_model's 4 heads, 2 of keys and values

    def edit(tensors):
        for i in range(2):
            b = f"blk.{i}."
            for part in ("gate", "up", "down"):
                del tensors[b + f"ffn_{part}.weight"]
            random = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
            tensors[b + "ffn_gate_inp.weight"] = (3 * random(n_experts, d_model), 0)
            tensors[b + "ffn_gate_exps.weight"] = (random(n_experts, width, d_model), matrix)
            tensors[b + "ffn_up_exps.weight"] = (random(n_experts, width, d_model), matrix)
            tensors[b + "ffn_down_exps.weight"] = (random(n_experts, d_model, width), matrix)
            if shared:
                gate = random(1, d_model)
                tensors[b + "ffn_gate_inp_shexp.weight"] = (
                    gate[0] if flat_shared_gate else gate,
                    0,
                )
                tensors[b + "ffn_gate_shexp.weight"] = (random(shared, d_model), matrix)
                tensors[b + "ffn_up_shexp.weight"] = (random(shared, d_model), matrix)
                tensors[b + "ffn_down_shexp.weight"] = (random(d_model, shared), matrix)
            if arch == "qwen2moe":
                for part, rows in (("q", d_model), ("k", d_model // 2), ("v", d_model // 2)):
                    tensors[b + f"attn_{part}.bias"] = (random(rows), 0)
            if arch == "qwen3moe":
                tensors[b + "attn_q_norm.weight"] = (1 + random(d_head), 0)
                tensors[b + "attn_k_norm.weight"] = (1 + random(d_head), 0)

    u32 = GGUFValueType.UINT32
    metadata = {f"{arch}.expert_count": (n_experts, u32), f"{arch}.expert_used_count": (k, u32)}
    if arch != "llama":
        metadata[f"{arch}.expert_feed_forward_length"] = (width, u32)
    if shared:
        metadata[f"{arch}.expert_shared_feed_forward_length"] = (shared, u32)
    return write_model(
        path,
        arch,
        d_model=d_model,
        # llama's experts are feed_forward_length wide; the dense MLP's tensors, replaced, must
        # be made of whole blocks
        d_mlp=width if arch == "llama" or width != case_width else 96,
        matrix=matrix,
        extra_metadata=metadata,
        tensor_edit=edit,
    )


@pytest.mark.parametrize("arch", list(GGUF_CASES))
def test_gguf_experts_land_where_they_belong(arch, tmp_path):
    """Each expert's W_gate, W_in and W_out are its slice of the file's stacked tensors; the
    router is ffn_gate_inp; renormalisation is llama.cpp's (llama and qwen3moe, not qwen2moe)."""
    path = moe_file(tmp_path / f"{arch}.gguf", arch)
    model = attnlab.load(path)
    n_experts, k, width, shared = GGUF_CASES[arch]
    cfg = model.config
    assert (cfg.n_experts, cfg.experts_per_token, cfg.d_mlp, cfg.d_shared_expert) == (
        n_experts,
        k,
        width,
        shared,
    )
    assert cfg.norm_topk_prob == (arch != "qwen2moe")
    tensors = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
    for i, block in enumerate(model.blocks):
        mlp = block.mlp
        torch.testing.assert_close(
            mlp.W_gate.weight, torch.from_numpy(tensors[f"blk.{i}.ffn_gate_inp.weight"])
        )
        for e, expert in enumerate(mlp.experts):
            for ours, theirs in (("W_gate", "gate"), ("W_in", "up"), ("W_out", "down")):
                stacked = torch.from_numpy(tensors[f"blk.{i}.ffn_{theirs}_exps.weight"])
                torch.testing.assert_close(getattr(expert, ours).weight, stacked[e])
        if shared:
            torch.testing.assert_close(
                mlp.shared_expert.W_out.weight,
                torch.from_numpy(tensors[f"blk.{i}.ffn_down_shexp.weight"]),
            )
            gate = torch.from_numpy(tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"])
            torch.testing.assert_close(mlp.shared_expert_gate.weight, gate.view(1, -1))


def test_a_shared_experts_gate_written_flat_is_read(tmp_path):
    """llama-quantize writes Qwen2-MoE's [1, d_model] shared-expert gate as [d_model] (ggml counts
    no trailing dimension of 1): the file is the same model, as llama.cpp reads it."""
    path = moe_file(tmp_path / "2d.gguf", "qwen2moe")
    flat = moe_file(tmp_path / "1d.gguf", "qwen2moe", flat_shared_gate=True)
    shapes = {t.name: tuple(t.shape) for t in GGUFReader(flat).tensors}
    assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (64,)
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(attnlab.load(flat)(ids), attnlab.load(path)(ids))


def test_gguf_expert_blocks_are_kept_per_expert(tmp_path):
    """keep_blocks: each expert's matrices are its own rows of the file's Q8_0 blocks, and the
    logits are the float load's."""
    path = moe_file(tmp_path / "qwen2moe.gguf", "qwen2moe", GGMLQuantizationType.Q8_0)
    floats, blocks = attnlab.load(path), attnlab.load(path, keep_blocks=True)
    experts = blocks.blocks[1].mlp.experts
    assert all(isinstance(e.W_in, BlockLinear) for e in experts)
    assert isinstance(blocks.blocks[1].mlp.shared_expert.W_out, BlockLinear)
    ids = torch.randint(0, floats.config.d_vocab, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(blocks(ids), floats(ids), rtol=1e-5, atol=1e-5)


def _converter_missing() -> str | None:
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        return (
            f"no llama.cpp converter at {LLAMA_CPP}: `make venv-test` unpacks it from PyPI's "
            "llama-cpp-python sdist (or set ATTNLAB_LLAMA_CPP_SOURCES to a llama.cpp tree)"
        )
    try:
        import sentencepiece  # noqa: F401  (the converter imports it for llama's vocabulary)
    except ImportError:
        return "llama.cpp's converter needs sentencepiece for llama files"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_converter_missing() is not None, reason=str(_converter_missing()))
@pytest.mark.parametrize("case", list(CASES))
def test_gguf_from_llama_cpp_converter_matches_transformers(case, seed, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py, float32, from the random transformers model (with
    SmolLM2's tokenizer.json, whose pre-tokenizer the converter knows): attnlab's logits on the
    file within 1e-4 of transformers' on the directory."""
    tokenizer = attnlab.load(smollm2_path()).tokenizer
    reference = build_hf(case, tmp_path / "hf", vocab_size=tokenizer.vocab_size)
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    out = tmp_path / "model.gguf"
    subprocess.run(
        [sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(tmp_path / "hf")]
        + ["--outtype", "f32", "--outfile", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")},
    )
    model = attnlab.load(out)
    ids = torch.randint(0, reference.config.vocab_size, (1, 11))
    with torch.no_grad():
        theirs, ours = reference(ids).logits, model(ids)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= OUTPUT_RTOL
