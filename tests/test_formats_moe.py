"""Mixtures of experts (attnlab.model.moe) against transformers: Mixtral, Qwen2-MoE (a gated
shared expert, top-k weights not renormalised) and Qwen3-MoE (qk-norm, renormalised), random tiny
models saved with save_pretrained and loaded with attnlab.load. Logits within 1e-4 relative and
patterns within 1e-5, as every other architecture (tests/test_formats_hf.py); the router's choices
through run_with_cache's hook names, as TransformerLens names them.

The routers' weights are scaled up so that no token's k-th and (k+1)-th experts are within
rounding of each other: a near tie would let the two implementations pick different experts for
reasons that are not a mistake.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.errors import UserError  # noqa: E402
from attnlab.formats.compare import compare  # noqa: E402
from attnlab.model.config import ModelConfig  # noqa: E402
from attnlab.model.moe import MoE  # noqa: E402

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
CASES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=91, intermediate_size=40, num_local_experts=5, num_experts_per_tok=2, **SIZES
        )
    ),
    "qwen2_moe-shared-expert": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            vocab_size=83,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            **SIZES,
        )
    ),
    "qwen3_moe-qk-norm": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=77,
            intermediate_size=64,
            moe_intermediate_size=20,
            num_experts=7,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=16,
            **SIZES,
        )
    ),
}


def build_hf(case: str, directory):
    """A random model of `case`, its norms perturbed and its routers sharpened, saved."""
    model = CASES[case]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith(".gate.weight"):  # the router (Mixtral's and Qwen's)
                p.mul_(100.0)
    model.eval().save_pretrained(directory)
    return model


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


def test_moe_config_errors():
    base = dict(positional="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_experts=4)
    with pytest.raises(UserError, match="experts_per_token must be 1 to n_experts"):
        ModelConfig(**base, experts_per_token=5)
    with pytest.raises(UserError, match="SwiGLU experts without biases"):
        ModelConfig(**{**base, "mlp": "gelu"}, experts_per_token=2)
    with pytest.raises(UserError, match="set n_experts too"):
        ModelConfig(d_shared_expert=8)


def test_dense_layers_among_experts_are_refused(tmp_path):
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
    with pytest.raises(UserError, match=r"mlp_only_layers \[1\]\) are not supported"):
        attnlab.load(tmp_path)
