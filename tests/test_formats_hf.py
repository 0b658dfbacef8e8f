"""Hugging Face checkpoints against transformers itself (a test-only dependency, nothing
downloaded).

Random tiny models (odd sizes, GQA, perturbed norms and biases, tied and untied heads) are built
with transformers, saved with save_pretrained and loaded with attnlab.load; the outputs must match
to 1e-4 relative, every attention pattern to 1e-5 (eager attention, float32), and greedy
continuations token for
token. The other direction: models built and trained with attnlab, saved with format="hf", must give
the same logits in transformers.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import perturb, save_random
from styles import fields

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.errors import UserError  # noqa: E402
from attnlab.formats.compare import compare  # noqa: E402
from attnlab.tokenizer import Tokenizer  # noqa: E402

OUTPUT_RTOL = 1e-4
PATTERN_ATOL = 1e-5

# Tiny configs with odd sizes; eos/bos None so that greedy generation never stops early on either
# side.
SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
CASES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=97, n_embd=36, n_layer=2, n_head=3, n_positions=40, n_inner=50, **SPECIAL
        )
    ),
    "gpt2-untied-gelu": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=83,
            n_embd=40,
            n_layer=2,
            n_head=5,
            n_positions=33,
            activation_function="gelu",
            tie_word_embeddings=False,
            **SPECIAL,
        )
    ),
    "llama-gqa-untied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=70,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_theta=500.0,
            **SPECIAL,
        )
    ),
    "llama-tied-attention-bias": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=89,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            max_position_embeddings=48,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=False,
            **SPECIAL,
        )
    ),
    "qwen2-gqa-tied": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=91,
            hidden_size=48,
            intermediate_size=66,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **SPECIAL,
        )
    ),
    # Llama 3.2's RoPE scaling (its config at toy size): with original_max_position_embeddings 2048
    # the 8 frequencies of a 16-dim head fall in all three bands (kept, blended, divided by the
    # factor).
    "llama3.2-style-rope-scaling-tied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=95,
            hidden_size=64,
            intermediate_size=90,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16384,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 2048,
            },
            **SPECIAL,
        )
    ),
    # SmolLM2's layout (tied head, grouped-query, rope_theta 1e5), here with linear position
    # interpolation.
    "smollm2-style-linear-rope": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=81,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 100000.0, "factor": 4.0},
            **SPECIAL,
        )
    ),
    # Qwen3: RMSNorm on each head's q and k, head_dim stated apart from hidden_size / heads.
    "qwen3-qk-norm-head-dim": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=85,
            hidden_size=40,
            intermediate_size=60,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            **SPECIAL,
        )
    ),
    # Mistral with a window of 5, shorter than every text below (11 tokens compared, 5 + 15
    # generated).
    "mistral-sliding-window": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=93,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=5,
            **SPECIAL,
        )
    ),
    # Qwen3 with every layer windowed (use_sliding_window, max_window_layers=0) and attention
    # biases.
    "qwen3-sliding-window-attention-bias": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=77,
            hidden_size=32,
            intermediate_size=44,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=64,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=0,
            attention_bias=True,
            tie_word_embeddings=True,
            **SPECIAL,
        )
    ),
    # Pythia's layout: parallel attention and MLP, a quarter of each head rotated, fused per-head
    # QKV, untied head.
    "gpt_neox-parallel-partial-rotary": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=87,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=3,
            intermediate_size=70,
            max_position_embeddings=40,
            rotary_pct=0.25,
            rotary_emb_base=500,
            use_parallel_residual=True,
            **SPECIAL,
        )
    ),
    "gpt_neox-sequential-no-attention-bias": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=73,
            hidden_size=40,
            num_hidden_layers=2,
            num_attention_heads=5,
            intermediate_size=52,
            max_position_embeddings=36,
            rotary_pct=0.5,
            use_parallel_residual=False,
            attention_bias=False,
            hidden_act="gelu_new",
            **SPECIAL,
        )
    ),
    "bert": lambda: transformers.BertModel(
        transformers.BertConfig(
            vocab_size=79,
            hidden_size=36,
            num_hidden_layers=2,
            num_attention_heads=3,
            intermediate_size=52,
            max_position_embeddings=40,
            type_vocab_size=2,
        ),
        add_pooling_layer=True,
    ),
}


def build_hf(case: str, directory, **save_kwargs):
    return save_random(CASES[case](), directory, **save_kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_loaded_model_matches_transformers(case, seed, tmp_path):
    build_hf(case, tmp_path)
    model = attnlab.load(tmp_path)
    ids = torch.randint(0, model.config.d_vocab, (1, 11))
    result = compare(tmp_path, ids=ids)
    assert result.output_relative <= OUTPUT_RTOL, result.table()
    assert max(result.pattern) <= PATTERN_ATOL, result.table()
    assert len(result.pattern) == model.config.n_layers
    assert max(result.resid) <= 1e-4 * max(1.0, result.output_scale), result.table()


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "bert"])
def test_greedy_continuation_matches_transformers_generate(case, seed, tmp_path):
    reference = build_hf(case, tmp_path)
    model = attnlab.load(tmp_path)
    prompt = torch.randint(0, model.config.d_vocab, (1, 5))
    theirs = reference.generate(
        prompt, max_new_tokens=15, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    ours = model.generate(prompt, 15, temperature=0)
    assert ours.tolist() == theirs.tolist()


def test_batch_with_padding_matches_transformers(seed, tmp_path):
    """Right-padded batch through the encoder: BERT's attention mask hides padded keys from every
    query."""
    reference = build_hf("bert", tmp_path)
    model = attnlab.load(tmp_path)
    ids = torch.randint(0, 79, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    with torch.no_grad():
        theirs = reference(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        ours = model(ids, attention_mask=mask, token_type_ids=types)
    torch.testing.assert_close(
        ours, theirs, rtol=OUTPUT_RTOL, atol=OUTPUT_RTOL * float(theirs.abs().max())
    )


def test_sharded_checkpoint_loads_like_a_single_file(seed, tmp_path):
    build_hf("llama-gqa-untied", tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    result = compare(tmp_path / "sharded", ids=torch.randint(0, 101, (1, 7)))
    assert result.output_relative <= OUTPUT_RTOL and max(result.pattern) <= PATTERN_ATOL, (
        result.table()
    )


@pytest.mark.parametrize(
    "case",
    [
        "gpt2",
        "llama-gqa-untied",
        "qwen2-gqa-tied",
        "gpt_neox-parallel-partial-rotary",
        "qwen3-qk-norm-head-dim",
        "bert",
    ],
)
def test_run_with_cache_has_the_standard_hook_names(case, seed, tmp_path):
    build_hf(case, tmp_path)
    model = attnlab.load(tmp_path)
    ids = torch.randint(0, model.config.d_vocab, (1, 6))
    _, cache = model.run_with_cache(ids)
    for layer in range(model.config.n_layers):
        for name in (
            "hook_resid_pre",
            "hook_attn_out",
            "hook_mlp_out",
            "hook_resid_post",
            "attn.hook_q",
            "attn.hook_k",
            "attn.hook_v",
            "attn.hook_pattern",
            "attn.hook_z",
            "mlp.hook_pre",
            "mlp.hook_post",
        ):
            assert f"blocks.{layer}.{name}" in cache
        # as in TransformerLens, a parallel block (Pythia) has no stream between attention and MLP
        assert (f"blocks.{layer}.hook_resid_mid" in cache) == (not model.config.parallel_residual)
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert pattern.shape == (1, model.config.n_heads, 6, 6)  # [batch, head, query_pos, key_pos]
    assert "hook_embed" in cache
    assert model.tokenizer is None  # save_pretrained wrote no tokenizer.json
    if model.config.positional == "rope":
        assert "blocks.0.attn.hook_rot_q" in cache


def test_loaded_config_keeps_what_writing_back_needs(tmp_path):
    build_hf("llama-gqa-untied", tmp_path)
    config = attnlab.load(tmp_path).config
    assert (config.n_heads, config.n_kv_heads, config.rope_theta, config.tie_embeddings) == (
        6,
        2,
        500.0,
        False,
    )
    assert config.extra["hf_model_type"] == "llama" and config.extra["eos_token_id"] is None
    # save_pretrained wrote one; it is written back as it was
    assert "generation_config" in config.extra


# attnlab -> Hugging Face
# -------------------------------------------------------------------------------

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 4


def train_briefly(model, ids, steps=15):
    """A few AdamW steps, so that the round trip is checked on trained (not just initial)
    weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


ATTNLAB_MODELS = {
    "nano-char": dict(n_layers=2, n_heads=3, d_model=48, n_ctx=32),
    "gpt2-no-bias-exact-gelu-untied": dict(
        n_layers=2, n_heads=3, d_model=36, n_ctx=32, bias=False, mlp="gelu", tie_embeddings=False
    ),
    "gpt2-relu-qkv-bias-only": dict(
        n_layers=2,
        n_heads=4,
        d_model=32,
        n_ctx=32,
        bias=False,
        qkv_bias=True,
        mlp="relu",
        attn_scale=1.0,
    ),
    "gpt2-relu2-untied": dict(
        n_layers=2, n_heads=4, d_model=32, n_ctx=32, mlp="relu2", tie_embeddings=False
    ),
    "llama-gqa-tied": fields(
        "llama-gqa",
        n_layers=2,
        n_heads=6,
        d_model=48,
        d_mlp=70,
        n_ctx=32,
        tie_embeddings=True,
        rope_theta=300.0,
    ),
    "qwen2-style": fields(
        "llama-gqa",
        qkv_bias=True,
        n_layers=2,
        n_heads=4,
        d_model=40,
        d_head=12,
        d_mlp=50,
        n_ctx=32,
    ),
    "llama3-rope-scaling": fields(
        "llama-gqa",
        n_layers=2,
        n_heads=4,
        d_model=64,
        d_mlp=80,
        n_ctx=16384,
        tie_embeddings=True,
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_original_n_ctx=2048,
    ),
    "qwen3-style": fields(
        "llama-gqa",
        qk_norm=True,
        n_layers=2,
        n_heads=4,
        d_model=40,
        d_head=10,
        d_mlp=50,
        n_ctx=32,
    ),
    "mistral-style-window": fields(
        "mistral-window",
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        d_model=32,
        d_mlp=48,
        n_ctx=32,
        sliding_window=6,
        tie_embeddings=False,
    ),
    "qwen2-style-window": fields(
        "qwen-qkv-bias-window",
        bias=False,
        n_layers=2,
        n_heads=2,
        d_model=32,
        d_mlp=40,
        n_ctx=32,
        sliding_window=3,
    ),
    "gpt_neox-parallel": fields(
        "pythia-parallel",
        n_layers=2,
        n_heads=3,
        d_model=48,
        d_mlp=60,
        n_ctx=32,
        tie_embeddings=False,
        rope_theta=700.0,
    ),
    "gpt_neox-linear-rope-scaling": fields(
        "pythia-parallel",
        n_layers=2,
        n_heads=2,
        d_model=32,
        n_ctx=64,
        rotary_fraction=0.5,
        rope_scaling="linear",
        rope_scaling_factor=3.0,
        rope_theta=50.0,
    ),
    "gpt_neox-sequential-no-bias-tied": dict(
        n_layers=2, n_heads=2, d_model=32, n_ctx=32, positional="rope", bias=False, mlp="gelu_tanh"
    ),
    "llama-all-biases-but-qkv": dict(
        n_layers=2,
        n_heads=4,
        d_model=32,
        n_ctx=32,
        positional="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=True,
        qkv_bias=False,
        tie_embeddings=False,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTNLAB_MODELS))
def test_attnlab_model_saved_as_hf_gives_the_same_logits_in_transformers(name, seed, tmp_path):
    tokenizer = Tokenizer.train_char(TEXT)
    config = attnlab.ModelConfig(d_vocab=tokenizer.vocab_size, **ATTNLAB_MODELS[name])
    model = attnlab.Transformer(config)
    model.tokenizer = tokenizer
    ids = torch.tensor([tokenizer.encode(TEXT[:33])])
    train_briefly(model, ids)
    attnlab.save(model, tmp_path, format="hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert not (tmp_path / "generation_config.json").exists()  # nothing to say beyond config.json

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    probe = ids[:, :20]
    with torch.no_grad():
        theirs = reference(probe).logits
        ours = model(probe)
    torch.testing.assert_close(
        ours, theirs, rtol=OUTPUT_RTOL, atol=OUTPUT_RTOL * float(theirs.abs().max())
    )
    result = compare(tmp_path, ids=probe)  # the full per-layer comparison, patterns included
    assert max(result.pattern) <= PATTERN_ATOL, result.table()

    # Back into attnlab: the same function, the same tokenizer.
    again = attnlab.load(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(probe), ours, rtol=1e-5, atol=1e-6)
    assert again.tokenizer.encode("Speak, speak.") == tokenizer.encode("Speak, speak.")


def test_attnlab_checkpoint_compares_through_a_temporary_hf_copy(seed, tmp_path):
    model = attnlab.Transformer(
        attnlab.ModelConfig(d_vocab=50, n_layers=2, n_heads=2, d_model=32, n_ctx=16)
    )
    attnlab.save(model, tmp_path)
    result = compare(tmp_path)
    assert result.output_relative <= OUTPUT_RTOL and max(result.pattern) <= PATTERN_ATOL, (
        result.table()
    )


def test_encoder_saved_as_hf_loads_in_bert_model(seed, tmp_path):
    config = attnlab.preset(
        "bert-mini",
        d_vocab=61,
        n_layers=2,
        n_heads=3,
        d_model=36,
        d_mlp=44,
        n_ctx=24,
        n_token_types=0,
    )
    model = attnlab.Transformer(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    attnlab.save(model, tmp_path, format="hf")
    reference = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids), reference(ids).last_hidden_state, rtol=OUTPUT_RTOL, atol=1e-4
        )


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (dict(positional="sinusoidal"), "positional='sinusoidal'"),
        (dict(positional="rope", norm="layernorm", mlp="swiglu"), "norm='layernorm'"),
        (
            dict(positional="rope", norm="rmsnorm", mlp="swiglu", rotary_fraction=0.5),
            "rotary_fraction=0.5",
        ),
        (dict(qk_norm=True), "qk_norm=True"),
        (dict(attn_only=True), "attn_only=True"),
        (dict(norm_placement="post"), "norm_placement='post'"),
        (dict(n_kv_heads=1), "n_kv_heads=1"),
        (dict(sliding_window=4), "sliding_window=4"),
        (dict(positional="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, bias=True), "Qwen3"),
        (
            dict(positional="rope", norm="rmsnorm", mlp="swiglu", sliding_window=4, bias=True),
            "Mistral",
        ),
        (
            dict(positional="rope", parallel_residual=True, norm="rmsnorm", mlp="swiglu"),
            "parallel_residual=True",
        ),
        (dict(logit_softcap=30.0), "logit_softcap=30.0"),
    ],
)
def test_models_hf_cannot_express_say_which_setting(overrides, setting, tmp_path):
    model = attnlab.Transformer(
        attnlab.ModelConfig(d_vocab=20, n_layers=1, n_heads=2, d_model=16, n_ctx=8, **overrides)
    )
    with pytest.raises(UserError, match="format='attnlab'") as info:
        attnlab.save(model, tmp_path, format="hf")
    assert setting in str(info.value)
    assert not (tmp_path / "model.safetensors").exists()


def test_written_config_sets_special_ids_explicitly(tmp_path):
    """LlamaConfig defaults eos to 2: a model trained here must say it has none, or generate would
    stop on id 2."""
    model = attnlab.Transformer(attnlab.preset("llama-tiny", d_vocab=30, n_layers=1))
    attnlab.save(model, tmp_path, format="hf")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "llama" and written["eos_token_id"] is None
    assert transformers.AutoConfig.from_pretrained(tmp_path).eos_token_id is None


@pytest.mark.parametrize(
    "case",
    [
        "gpt2-untied-gelu",
        "llama-tied-attention-bias",
        "qwen2-gqa-tied",
        "llama3.2-style-rope-scaling-tied",
        "smollm2-style-linear-rope",
        "qwen3-qk-norm-head-dim",
        "mistral-sliding-window",
        "gpt_neox-parallel-partial-rotary",
        "gpt_neox-sequential-no-attention-bias",
        "bert",
    ],
)
def test_loaded_checkpoint_written_back_is_the_same_model_for_transformers(case, seed, tmp_path):
    original = build_hf(case, tmp_path / "original")
    attnlab.save(attnlab.load(tmp_path / "original"), tmp_path / "again", format="hf")
    cls = transformers.AutoModel if case == "bert" else transformers.AutoModelForCausalLM
    again = cls.from_pretrained(tmp_path / "again", attn_implementation="eager").eval()
    assert type(again) is type(original)
    ids = torch.randint(0, original.config.vocab_size, (2, 8))
    with torch.no_grad():
        theirs, ours = original(ids), again(ids)
    key = "last_hidden_state" if case == "bert" else "logits"
    torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["llama-tied-attention-bias", "gpt2-untied-gelu"])
def test_big_model_path_without_random_init_loads_the_same_model(case, seed, tmp_path, monkeypatch):
    """Large checkpoints are built on the meta device (no random init); the tied head and RoPE
    buffer survive."""
    from attnlab.formats import native

    build_hf(case, tmp_path)
    expected = attnlab.load(tmp_path)
    monkeypatch.setattr(native, "META_BUILD_ABOVE", 0)
    model = attnlab.load(tmp_path)
    assert (model.unembed.weight is model.embed.weight) == model.config.tie_embeddings
    ids = torch.randint(0, model.config.d_vocab, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), expected(ids))
    assert (
        model.generate(ids, 5, temperature=0).tolist()
        == expected.generate(ids, 5, temperature=0).tolist()
    )


def test_half_precision_checkpoint_loads_into_float32(seed, tmp_path):
    reference = perturb(CASES["qwen2-gqa-tied"]()).to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    model = attnlab.load(tmp_path)
    assert model.dtype == torch.float32
    # the same bf16-rounded weights, computed in float32 on both sides
    reference = reference.float()
    ids = torch.randint(0, 91, (1, 8))
    with torch.no_grad():
        theirs = reference(ids).logits
        torch.testing.assert_close(
            model(ids), theirs, rtol=OUTPUT_RTOL, atol=OUTPUT_RTOL * float(theirs.abs().max())
        )
