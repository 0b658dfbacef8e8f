"""TransformerLens's definitions on attnlab models: hook meanings, cache keys, residual-stream
views, direct logit attribution, stacked weights, factored circuits, composition scores and tokens.

Every expected value is computed here from the cached tensors and the raw parameters with the
formulas of
TransformerLens's documentation (ActivationCache, FactoredMatrix, utils), in float64, so "equal"
means equal to 1e-9 relative, not "close to what the code happens to do".
"""

from __future__ import annotations

import pytest
import torch
from styles import config, randomize

from attnlab import Transformer
from attnlab.errors import UserError
from attnlab.lens.factored_matrix import FactoredMatrix, composition_scores
from attnlab.lens.names import apply_slice, get_act_name, test_prompt
from attnlab.model.config import ModelConfig
from attnlab.tokenizer import Tokenizer

B, T = 2, 6
BASE = dict(d_vocab=13, n_ctx=16, d_model=16, n_layers=3, n_heads=4, d_mlp=24)
STYLES = {
    "gpt2": config("gpt2", **BASE),
    "llama": config("llama-gqa", **BASE),
    # Pythia (GPT-NeoX) with half of each head rotated, untied
    "pythia": config("pythia-parallel", **BASE, rotary_fraction=0.5, tie_embeddings=False),
    "attn-only": ModelConfig(**BASE, attn_only=True),
}
TOL = dict(rtol=1e-9, atol=1e-9)


def build(config: ModelConfig) -> Transformer:
    """A float64 model with N(0, 0.3) parameters (norm gains and biases too, so none is an
    identity)."""
    torch.manual_seed(0)
    model = Transformer(config).double().eval()
    randomize(model)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "hook_scale"):
                module.weight.add_(1.0)
    return model


def run(config: ModelConfig, **kwargs):
    model = build(config)
    ids = torch.randint(0, config.d_vocab, (B, T), generator=torch.Generator().manual_seed(1))
    logits, cache = model.run_with_cache(ids, **kwargs)
    return model, ids, logits, cache


def centre(x: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True) if config.norm == "layernorm" else x


# Hook meanings
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_norm_hooks_mean_what_transformer_lens_means(style):
    """hook_scale = √(mean(x̃²) + ε), hook_normalized = x̃ / scale (before weight and bias), for
    ln1, ln2, ln_final."""
    config = STYLES[style]
    model, _, logits, cache = run(config)
    inputs = {f"blocks.{l}.ln1": cache["resid_pre", l] for l in range(config.n_layers)}
    inputs |= {f"blocks.{l}.ln2": cache["resid_mid", l] for l in range(config.n_layers)}
    inputs["ln_final"] = cache["resid_post", -1]
    for name, x in inputs.items():
        norm = model.get_submodule(name)
        x = centre(x, config)
        scale = (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
        torch.testing.assert_close(cache[f"{name}.hook_scale"], scale, **TOL)
        torch.testing.assert_close(cache[f"{name}.hook_normalized"], x / scale, **TOL)
    # ... and what the next layer reads is the normalized input times the weight (plus the bias)
    ln = model.ln_final
    out = cache["ln_final.hook_normalized"] * ln.weight + (
        ln.bias if getattr(ln, "bias", None) is not None else 0
    )
    torch.testing.assert_close(model.unembed(out), logits, **TOL)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_norm_hooks_read_without_changing_a_bit_and_edits_take_effect(style):
    """Reading a norm's hooks keeps the fused kernel's exact numbers; a hook that returns a new
    tensor drives the output through the equation (x̃ / scale · w + b), which equals the fused
    kernel."""
    model = build(STYLES[style]).float()
    ids = torch.randint(0, 13, (B, T))
    plain = model(ids)
    is_norm_hook = lambda n: n.endswith(("hook_scale", "hook_normalized"))  # noqa: E731
    read = model.run_with_hooks(ids, fwd_hooks=[(is_norm_hook, lambda t, hook: None)])
    assert torch.equal(read, plain)
    copied = model.run_with_hooks(ids, fwd_hooks=[(is_norm_hook, lambda t, hook: t.clone())])
    torch.testing.assert_close(copied, plain, rtol=1e-5, atol=1e-5)
    doubled = model.run_with_hooks(ids, fwd_hooks=[("ln_final.hook_scale", lambda t, hook: t * 2)])
    ln = model.ln_final
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=["ln_final.hook_normalized"])
    normalized = cache["ln_final.hook_normalized"] / 2
    bias = ln.bias if getattr(ln, "bias", None) is not None else 0
    torch.testing.assert_close(
        doubled, model.unembed(normalized * ln.weight + bias), rtol=1e-5, atol=1e-5
    )


def test_head_results_only_when_asked():
    """hook_result [batch, pos, head, d_model] sums over heads (+ b_O) to attn_out; not cached by
    default."""
    config = STYLES["gpt2"]
    model, ids, _, cache = run(config)
    assert not any(name.endswith("hook_result") for name in cache)
    _, asked = model.run_with_cache(
        ids, names_filter=lambda n: n.endswith(("hook_result", "hook_attn_out"))
    )
    for l in range(config.n_layers):
        result = asked["result", l]
        assert result.shape == (B, T, config.n_heads, config.d_model)
        torch.testing.assert_close(result.sum(2) + model.b_O[l], asked["attn_out", l], **TOL)
    model.set_use_attn_result(True)
    _, everything = model.run_with_cache(ids)
    assert "blocks.0.attn.hook_result" in everything
    model.set_use_attn_result(False)
    cache.compute_head_results()  # from z and W_O, as TransformerLens's compute_head_results
    torch.testing.assert_close(cache["result", 1], asked["result", 1], **TOL)


# Cache keys
# --------------------------------------------------------------------------------------------------
def test_get_act_name_as_in_transformer_lens_docs():
    assert get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    assert get_act_name("pre", 2) == "blocks.2.mlp.hook_pre"
    assert get_act_name("embed") == "hook_embed"
    assert get_act_name("normalized", 27, "ln2") == "blocks.27.ln2.hook_normalized"
    assert get_act_name("k6") == "blocks.6.attn.hook_k"
    assert get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"
    assert get_act_name("pre5") == "blocks.5.mlp.hook_pre"
    assert get_act_name("attn", 0) == "blocks.0.attn.hook_pattern"
    assert get_act_name("resid_pre", 3) == "blocks.3.hook_resid_pre"
    assert get_act_name("scale") == "ln_final.hook_scale"
    assert get_act_name("blocks.1.attn.hook_z") == "blocks.1.attn.hook_z"


def test_cache_shortcuts_batch_and_device():
    config = STYLES["gpt2"]
    model, ids, _, cache = run(config)
    assert cache["pattern", 0] is cache["blocks.0.attn.hook_pattern"]
    assert cache["q", 1, "attn"] is cache["blocks.1.attn.hook_q"]
    assert cache["resid_post", -1] is cache[f"blocks.{config.n_layers - 1}.hook_resid_post"]
    assert cache["scale"] is cache["ln_final.hook_scale"]
    with pytest.raises(KeyError, match="did you mean blocks.0.attn.hook_pattern"):
        cache["blocks.0.attn.hook_patern"]
    with pytest.raises(KeyError, match=r"blocks\.0\.attn\.hook_result.*names_filter"):
        cache["result", 0]
    assert cache.to("cpu") is cache
    with pytest.raises(UserError, match="batch of 2"):
        cache.remove_batch_dim()
    _, one = model.run_with_cache(ids[:1])
    single = one["resid_pre", 1].clone()
    one.remove_batch_dim()
    assert torch.equal(one["resid_pre", 1], single[0])
    # the views work without the batch axis as well
    torch.testing.assert_close(one.decompose_resid().sum(0), one["resid_post", -1], **TOL)


def test_apply_slice_is_transformer_lens_slice():
    x = torch.arange(24).view(2, 6, 2)
    assert torch.equal(apply_slice(x, None, -2), x)
    assert torch.equal(apply_slice(x, -1, -2), x[:, -1])
    assert torch.equal(apply_slice(x, (1, 4), -2), x[:, 1:4])
    assert torch.equal(apply_slice(x, [0, 5], 1), x[:, [0, 5]])


# Residual-stream views
# -------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", list(STYLES))
def test_decompositions_sum_to_the_stream(style):
    config = STYLES[style]
    model, _, _, cache = run(config)
    final = cache["resid_post", -1]  # ln_final's input
    parallel = config.parallel_residual
    accumulated, labels = cache.accumulated_resid(return_labels=True, incl_mid=not parallel)
    torch.testing.assert_close(accumulated[-1], final, **TOL)
    assert labels[-1] == "final_post" and labels[:3] == (
        ["0_pre", "1_pre", "2_pre"] if parallel else ["0_pre", "0_mid", "1_pre"]
    )
    parts, labels = cache.decompose_resid(return_labels=True)
    torch.testing.assert_close(parts.sum(0), final, **TOL)
    assert labels[0] == "embed" and ("0_mlp_out" in labels) != config.attn_only
    # every layer's input, and every MLP's input (resid_pre if parallel)
    for layer in range(config.n_layers):
        torch.testing.assert_close(
            cache.decompose_resid(layer).sum(0), cache["resid_pre", layer], **TOL
        )
        mlp_in = cache["resid_pre" if parallel else "resid_mid", layer]
        torch.testing.assert_close(
            cache.decompose_resid(layer, mlp_input=True).sum(0), mlp_in, **TOL
        )
    heads, labels = cache.stack_head_results(return_labels=True, incl_remainder=True)
    assert (
        heads.shape == (config.n_layers * config.n_heads + 1, B, T, config.d_model)
        and labels[5] == "L1H1"
    )
    torch.testing.assert_close(heads.sum(0), final, **TOL)
    for expand in (True, False):
        full, labels = cache.get_full_resid_decomposition(expand_neurons=expand, return_labels=True)
        torch.testing.assert_close(full.sum(0), final, **TOL)
        assert labels[-1] == "bias"
    # into layer 1's MLP, last position
    full = cache.get_full_resid_decomposition(1, mlp_input=True, pos_slice=-1)
    torch.testing.assert_close(
        full.sum(0), cache["resid_pre" if parallel else "resid_mid", 1][:, -1], **TOL
    )
    if parallel:
        with pytest.raises(UserError, match="no resid_mid"):
            cache.accumulated_resid(incl_mid=True)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_apply_ln_to_stack_freezes_the_cached_scale(style):
    """Each term centred (LayerNorm) and divided by the stream's cached scale: the terms sum to
    hook_normalized."""
    config = STYLES[style]
    model, _, logits, cache = run(config)
    parts = cache.decompose_resid()
    scaled = cache.apply_ln_to_stack(parts)
    torch.testing.assert_close(scaled, centre(parts, config) / cache["ln_final.hook_scale"], **TOL)
    torch.testing.assert_close(scaled.sum(0), cache["ln_final.hook_normalized"], **TOL)
    into_mlp = cache.decompose_resid(2, mlp_input=True, apply_ln=True)
    torch.testing.assert_close(into_mlp.sum(0), cache["normalized", 2, "ln2"], **TOL)
    # the logit lens: each accumulated stream through ln_final with its own statistics; the last
    # gives the logits
    lens = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(lens[-1] @ model.W_U + model.b_U, logits, **TOL)
    x = centre(cache["resid_pre", 1], config)
    ln = model.ln_final
    bias = ln.bias if getattr(ln, "bias", None) is not None else 0
    torch.testing.assert_close(
        lens[1], x / (x.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt() * ln.weight + bias, **TOL
    )


@pytest.mark.parametrize("style", list(STYLES))
def test_logit_attrs_of_the_full_decomposition_is_the_logit_difference(style):
    config = STYLES[style]
    model, ids, logits, cache = run(config)
    answer, wrong = 3, 7
    # [component, batch, d_model]
    full = cache.get_full_resid_decomposition(pos_slice=-1, expand_neurons=False)
    attrs = cache.logit_attrs(full, answer, wrong, pos_slice=-1)  # [component, batch]
    # by TransformerLens's formula: (x − mean) / scale · (w ⊙ (W_U[:, a] − W_U[:, b]))
    ln = model.ln_final
    direction = ln.weight * (model.W_U[:, answer] - model.W_U[:, wrong])
    expected = (centre(full, config) / cache["ln_final.hook_scale"][:, -1]) @ direction
    torch.testing.assert_close(attrs, expected, **TOL)
    # summed, the logit difference, less what no component carries: the final norm's bias and b_U
    constant = 0.0
    if getattr(ln, "bias", None) is not None:
        constant = ln.bias @ (model.W_U[:, answer] - model.W_U[:, wrong])
    diff = logits[:, -1, answer] - logits[:, -1, wrong]
    torch.testing.assert_close(attrs.sum(0) + constant, diff, **TOL)
    # per-row tokens [batch] at every position, and per-position tokens [batch, pos]
    stack = cache.decompose_resid()
    per_row = cache.logit_attrs(stack, torch.tensor([answer, wrong]))
    assert per_row.shape == (stack.shape[0], B, T)
    per_pos = cache.logit_attrs(stack, ids)
    assert per_pos.shape == (stack.shape[0], B, T)
    torch.testing.assert_close(
        per_row[:, 1], cache.logit_attrs(stack, wrong, batch_slice=(1, 2))[:, 0], **TOL
    )


def test_views_refuse_a_post_norm_model():
    config = ModelConfig(
        **BASE, causal=False, norm_placement="post", final_norm=False, embed_norm=True
    )
    _, _, _, cache = run(config)
    with pytest.raises(UserError, match="post-norm"):
        cache.decompose_resid()


# Weights
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_stacked_weights_compute_the_cached_activations(style):
    config = STYLES[style]
    model, ids, logits, cache = run(config)
    L, H, D, d = config.n_layers, config.n_heads, config.d_head, config.d_model
    assert model.W_Q.shape == model.W_K.shape == model.W_V.shape == (L, H, d, D)
    assert (
        model.W_O.shape == (L, H, D, d)
        and model.b_O.shape == (L, d)
        and model.b_Q.shape == (L, H, D)
    )
    group = H // config.n_kv_heads
    for l in range(L):
        ln = model.blocks[l].ln1
        x = cache["normalized", l, "ln1"] * ln.weight + (
            ln.bias if getattr(ln, "bias", None) is not None else 0
        )
        for h in range(H):
            torch.testing.assert_close(
                x @ model.W_Q[l, h] + model.b_Q[l, h], cache["q", l][:, :, h], **TOL
            )
            kv = h // group  # grouped-query: query head h reads key/value head h // group
            torch.testing.assert_close(
                x @ model.W_K[l, h] + model.b_K[l, h], cache["k", l][:, :, kv], **TOL
            )
            torch.testing.assert_close(
                x @ model.W_V[l, h] + model.b_V[l, h], cache["v", l][:, :, kv], **TOL
            )
        out = torch.einsum("bthd,hdm->btm", cache["z", l], model.W_O[l]) + model.b_O[l]
        torch.testing.assert_close(out, cache["attn_out", l], **TOL)
    torch.testing.assert_close(model.W_E[ids], cache["hook_embed"], **TOL)
    ln = model.ln_final
    final = cache["ln_final.hook_normalized"] * ln.weight + (
        ln.bias if getattr(ln, "bias", None) is not None else 0
    )
    torch.testing.assert_close(final @ model.W_U + model.b_U, logits, **TOL)
    if config.positional == "learned":
        torch.testing.assert_close(model.W_pos[:T].expand(B, T, d), cache["hook_pos_embed"], **TOL)
    else:
        with pytest.raises(UserError, match="W_pos"):
            model.W_pos


def test_factored_matrix_against_its_product():
    g = torch.Generator().manual_seed(0)
    A, Bm = (
        torch.randn(2, 3, 10, 4, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 4, 10, generator=g, dtype=torch.float64),
    )
    m = FactoredMatrix(A, Bm)
    AB = A @ Bm
    torch.testing.assert_close(m.AB, AB, **TOL)
    U, S, V = m.svd()
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), AB, **TOL)
    torch.testing.assert_close(S, torch.linalg.svdvals(AB)[..., :4], **TOL)
    torch.testing.assert_close(m.norm(), AB.norm(dim=(-2, -1)), **TOL)
    # the 4 largest eigenvalues of the 10 x 10 product are those of BA
    full = torch.linalg.eigvals(AB[1, 2])
    big = full[full.abs().argsort(descending=True)[:4]]
    assert torch.allclose(big.abs().sort().values, m[1, 2].eigenvalues.abs().sort().values)
    torch.testing.assert_close(m[1, 2].AB, AB[1, 2], **TOL)
    torch.testing.assert_close(m.T.AB, AB.transpose(-2, -1), **TOL)


def test_circuits_and_composition_scores_from_the_formula():
    config = STYLES["llama"]
    model = build(config)
    L, H = config.n_layers, config.n_heads
    QK, OV = model.QK, model.OV
    assert tuple(QK.shape) == (L, H, config.d_model, config.d_model)
    torch.testing.assert_close(OV[1, 2].AB, model.W_V[1, 2] @ model.W_O[1, 2], **TOL)
    torch.testing.assert_close(QK[0, 3].AB, model.W_Q[0, 3] @ model.W_K[0, 3].T, **TOL)

    def score(a: torch.Tensor, b: torch.Tensor) -> float:  # ‖a b‖_F / (‖a‖_F ‖b‖_F)
        return float((a @ b).norm() / (a.norm() * b.norm()))

    q, k, v = (model.all_composition_scores(mode) for mode in "QKV")
    assert q.shape == (L, H, L, H)
    for l1, h1, l2, h2 in [(0, 1, 1, 2), (0, 3, 2, 0), (1, 0, 2, 3)]:
        ov = OV[l1, h1].AB
        assert q[l1, h1, l2, h2] == pytest.approx(score(ov, QK[l2, h2].AB), rel=1e-9)
        assert k[l1, h1, l2, h2] == pytest.approx(score(ov, QK[l2, h2].AB.T), rel=1e-9)
        assert v[l1, h1, l2, h2] == pytest.approx(score(ov, OV[l2, h2].AB), rel=1e-9)
    assert float(q[1, 0, 0, 0]) == 0.0 and float(v[1, 0, 1, 1]) == 0.0  # only earlier -> later
    direct = composition_scores(OV[0, 1], OV[1, 2], broadcast_dims=False)
    assert float(direct) == pytest.approx(float(v[0, 1, 1, 2]), rel=1e-9)


# Tokens
# --------------------------------------------------------------------------------------------------
def char_model() -> Transformer:
    tokenizer = Tokenizer.train_char("abcdefgh ")
    model = build(ModelConfig(**{**BASE, "d_vocab": tokenizer.vocab_size}))
    model.tokenizer = tokenizer
    return model


def test_tokens(capsys):
    model = char_model()
    ids = model.to_tokens("bad cab")
    assert ids.shape == (1, 7) and model.to_string(ids[0]) == "bad cab"
    assert model.to_str_tokens("bad") == ["b", "a", "d"]
    assert model.to_str_tokens(ids) == list("bad cab")
    assert model.to_string(model.to_tokens(["ab", "cd"])) == ["ab", "cd"]
    assert model.to_single_token("c") == model.tokenizer.encode("c")[0]
    with pytest.raises(UserError, match=r"'ab' is 2 tokens"):
        model.to_single_token("ab")
    with pytest.raises(UserError, match="different lengths"):
        model.to_tokens(["a", "abc"])
    with pytest.raises(UserError, match="no beginning-of-sequence"):
        model.to_tokens("a", prepend_bos=True)
    result = test_prompt("abc abc ab", "c", model, prepend_space_to_answer=False, top_k=3)
    printed = capsys.readouterr().out
    with torch.no_grad():
        logits = model(model.to_tokens("abc abc ab"))[0, -1]
    c = model.to_single_token("c")
    assert result[0]["rank"] == int((logits > logits[c]).sum())
    assert result[0]["prob"] == pytest.approx(float(logits.softmax(-1)[c]))
    assert "Rank:" in printed and "Top 0th token" in printed and len(result[0]["top"]) == 3


def test_prepend_bos_as_documented():
    """None: the tokenizer's own rule (a LLaMA-style tokenizer adds <s>, a GPT-2-style one nothing);
    True: its
    BOS first (once); False: no special tokens at all."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate("abc")}
    for bos, adds in (("<s>", True), ("<|endoftext|>", False)):
        backend = Backend(models.WordLevel({**vocab, bos: 3}, unk_token=bos))
        backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([bos])
        if adds:  # LLaMA's tokenizer.json: a template that puts <s> first
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", special_tokens=[(bos, 3)]
            )
        model = build(ModelConfig(**{**BASE, "d_vocab": 4}))
        model.tokenizer = Tokenizer(backend)
        assert model.to_tokens("cab").tolist() == [([3] if adds else []) + [2, 0, 1]]
        assert model.to_tokens("cab", prepend_bos=True).tolist() == [[3, 2, 0, 1]]
        assert model.to_tokens("cab", prepend_bos=False).tolist() == [[2, 0, 1]]
        assert model.to_str_tokens("ab", prepend_bos=True) == [bos, "a", "b"]
