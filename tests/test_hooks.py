"""attnlab.lens.hooks on the Transformer: TransformerLens's names and shapes, caching, editing, and
the fused path.

Tolerance for "hooks never change the result" (float32, explicit vs fused attention): relative error
1e-5.
"""

from __future__ import annotations

import pytest
import torch
from styles import randomize

from attnlab import ActivationCache, Transformer
from attnlab.errors import UserError
from attnlab.model.attention import scaled_dot_product_attention
from attnlab.model.config import ModelConfig

B, T = 2, 5
BASE = dict(d_vocab=11, n_ctx=16, d_model=16, n_layers=2, n_heads=4, d_mlp=24)
LEARNED = ModelConfig(**BASE)
ROPE_GQA = ModelConfig(
    **BASE, positional="rope", n_kv_heads=2, norm="rmsnorm", mlp="swiglu", qk_norm=True
)
ENCODER = ModelConfig(
    **BASE, causal=False, norm_placement="post", final_norm=False, embed_norm=True, n_token_types=2
)


def build(config: ModelConfig) -> Transformer:
    """A float32 model with N(0, 0.3) parameters, so patterns are far from uniform and hooks have
    something to change."""
    model = Transformer(config).eval()
    randomize(model)
    return model


def random_ids(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.d_vocab, (B, T))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().max() / b.abs().max()).detach())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every hook the issue lists, with the shape TransformerLens gives it."""
    H, Hkv, D, d, m = config.n_heads, config.n_kv_heads, config.d_head, config.d_model, config.d_mlp
    shapes = {"hook_embed": (B, T, d), "ln_final.hook_normalized": (B, T, d)}
    if config.positional == "learned":
        shapes["hook_pos_embed"] = (B, T, d)
    for i in range(config.n_layers):
        block = {
            "hook_resid_pre": (B, T, d),
            "ln1.hook_normalized": (B, T, d),
            "ln2.hook_normalized": (B, T, d),
            "attn.hook_q": (B, T, H, D),
            "attn.hook_k": (B, T, Hkv, D),
            "attn.hook_v": (B, T, Hkv, D),
            "attn.hook_attn_scores": (B, H, T, T),
            "attn.hook_pattern": (B, H, T, T),
            "attn.hook_z": (B, T, H, D),
            "hook_attn_out": (B, T, d),
            "hook_resid_mid": (B, T, d),
            "mlp.hook_pre": (B, T, m),
            "mlp.hook_post": (B, T, m),
            "hook_mlp_out": (B, T, d),
            "hook_resid_post": (B, T, d),
        }
        if config.positional == "rope":
            block |= {"attn.hook_rot_q": (B, T, H, D), "attn.hook_rot_k": (B, T, Hkv, D)}
        shapes |= {f"blocks.{i}.{name}": shape for name, shape in block.items()}
    return shapes


@pytest.mark.parametrize("config", [LEARNED, ROPE_GQA], ids=["learned", "rope-gqa"])
def test_every_documented_hook_exists_with_its_shape(config):
    model = build(config)
    _, cache = model.run_with_cache(random_ids(config))
    for name, shape in expected_shapes(config).items():
        assert name in model.hook_names(), name
        assert tuple(cache[name].shape) == shape, name
    # every pattern: causal rows summing to 1
    for pattern in cache.stack("blocks.{}.attn.hook_pattern"):
        torch.testing.assert_close(pattern.sum(-1), torch.ones(B, config.n_heads, T))
        assert torch.equal(pattern, pattern.tril())


def test_the_chapters_a_b_c_through_a_model():
    """The demo's walk-through: "A B C" through a one-layer model; its pattern is lower-triangular,
    rows sum to 1."""
    model = build(ModelConfig(d_vocab=3, n_ctx=8, d_model=16, n_layers=1, n_heads=1))
    _, cache = model.run_with_cache(
        torch.tensor([[0, 1, 2]]), names_filter="blocks.0.attn.hook_pattern"
    )
    pattern = cache["blocks.0.attn.hook_pattern"][0, 0]  # [query_pos, key_pos]
    assert pattern.shape == (3, 3) and torch.equal(pattern, pattern.tril())
    torch.testing.assert_close(pattern.sum(-1), torch.ones(3))
    assert pattern[0, 0] == 1.0  # "A" can only attend to itself


def test_cached_activations_fit_together():
    """The cache tells one consistent story: residual sums, the pattern from the scores, z through
    W_O."""
    model = build(LEARNED)
    ids = random_ids(LEARNED)
    logits, cache = model.run_with_cache(ids)
    torch.testing.assert_close(
        cache["hook_embed"] + cache["hook_pos_embed"], cache["blocks.0.hook_resid_pre"]
    )
    for i, block in enumerate(model.blocks):
        c = {
            name.split(f"blocks.{i}.", 1)[1]: t
            for name, t in cache.items()
            if name.startswith(f"blocks.{i}.")
        }
        torch.testing.assert_close(c["hook_resid_pre"] + c["hook_attn_out"], c["hook_resid_mid"])
        torch.testing.assert_close(c["hook_resid_mid"] + c["hook_mlp_out"], c["hook_resid_post"])
        torch.testing.assert_close(
            torch.softmax(c["attn.hook_attn_scores"], dim=-1), c["attn.hook_pattern"]
        )
        _, pattern = scaled_dot_product_attention(
            c["attn.hook_q"].transpose(1, 2),
            c["attn.hook_k"].transpose(1, 2),
            c["attn.hook_v"].transpose(1, 2),
            causal=True,
            return_weights=True,
        )
        torch.testing.assert_close(pattern, c["attn.hook_pattern"])
        torch.testing.assert_close(block.attn.W_O(c["attn.hook_z"].flatten(-2)), c["hook_attn_out"])
        if i + 1 < LEARNED.n_layers:
            torch.testing.assert_close(
                c["hook_resid_post"], cache[f"blocks.{i + 1}.hook_resid_pre"]
            )
    # hook_normalized is before the norm's weight and bias, as in TransformerLens
    ln = model.ln_final
    torch.testing.assert_close(
        model.unembed(cache["ln_final.hook_normalized"] * ln.weight + ln.bias), logits
    )
    stacked = cache.stack("blocks.{}.attn.hook_pattern")
    assert stacked.shape == (LEARNED.n_layers, B, LEARNED.n_heads, T, T)
    torch.testing.assert_close(stacked[1], cache["blocks.1.attn.hook_pattern"])


def test_names_filter_stores_only_what_was_asked():
    model = build(ROPE_GQA)
    ids = random_ids(ROPE_GQA)
    _, cache = model.run_with_cache(ids, names_filter="blocks.1.attn.hook_pattern")
    assert list(cache) == ["blocks.1.attn.hook_pattern"]
    wanted = ["hook_embed", "blocks.0.attn.hook_rot_k", "blocks.1.hook_resid_post"]
    _, cache = model.run_with_cache(ids, names_filter=wanted)
    assert sorted(cache) == sorted(wanted)
    _, cache = model.run_with_cache(ids, names_filter=lambda name: name.endswith("hook_z"))
    assert sorted(cache) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    _, everything = model.run_with_cache(ids)
    assert set(expected_shapes(ROPE_GQA)) <= set(everything)
    assert all(not t.requires_grad for t in everything.values())
    with pytest.raises(KeyError, match="names_filter"):
        cache["blocks.0.attn.hook_pattern"]


def test_zeroing_a_heads_z_is_ablating_that_head():
    """Replacing z of head h by zeros changes the output exactly as removing head h's columns of W_O
    does."""
    model = build(LEARNED)
    ids = random_ids(LEARNED)
    layer, head, D = 1, 2, LEARNED.d_head

    def zero_head(z: torch.Tensor, hook) -> torch.Tensor:
        assert hook.name == f"blocks.{layer}.attn.hook_z"
        z = z.clone()
        z[:, :, head] = 0.0  # [batch, pos, head, d_head]
        return z

    ablated = model.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)])
    clean = model(ids)
    assert not torch.allclose(ablated, clean)
    with torch.no_grad():
        W_O = model.blocks[layer].attn.W_O.weight
        saved = W_O[:, head * D : (head + 1) * D].clone()
        W_O[:, head * D : (head + 1) * D] = 0.0
        try:
            torch.testing.assert_close(ablated, model(ids))
        finally:
            W_O[:, head * D : (head + 1) * D] = saved
    torch.testing.assert_close(model(ids), clean)  # the hook is gone


def test_run_with_cache_keeps_what_the_callers_hooks_pass_on():
    """As TransformerLens: an activation a caller's hook edits is cached as edited (what flows on),
    whether the hook comes with run_with_cache(fwd_hooks=...) or from an enclosing
    model.hooks(...)."""
    model = build(LEARNED)
    ids = random_ids(LEARNED)
    name = "blocks.0.attn.hook_z"

    def zero_head(z: torch.Tensor, hook) -> torch.Tensor:
        z = z.clone()
        z[:, :, 1] = 0.0  # [batch, pos, head, d_head]
        return z

    clean_z = model.run_with_cache(ids, names_filter=name)[1][name]
    assert clean_z[:, :, 1].abs().sum() > 0
    logits, cache = model.run_with_cache(ids, fwd_hooks=[(name, zero_head)])
    with model.hooks([(name, zero_head)]):
        _, enclosed = model.run_with_cache(ids)
    for c in (cache, enclosed):
        assert c[name][:, :, 1].abs().sum() == 0
        torch.testing.assert_close(c[name][:, :, 0], clean_z[:, :, 0])
        # and the cache stays consistent downstream: resid_mid = resid_pre + attn_out of the edited
        # z
        torch.testing.assert_close(
            c["blocks.0.hook_resid_mid"], c["blocks.0.hook_resid_pre"] + c["blocks.0.hook_attn_out"]
        )
    torch.testing.assert_close(logits, model.run_with_hooks(ids, fwd_hooks=[(name, zero_head)]))


def test_replacing_the_pattern_changes_what_is_attended():
    """A uniform causal pattern in place of the learned one: z becomes the running mean of v."""
    model = build(LEARNED)
    ids = random_ids(LEARNED)
    seen = {}

    def uniform(pattern: torch.Tensor, hook) -> torch.Tensor:
        causal = torch.ones(T, T).tril()
        return (causal / causal.sum(-1, keepdim=True)).expand_as(pattern)

    def store(t: torch.Tensor, hook) -> None:
        seen[hook.name] = t

    model.run_with_hooks(
        ids,
        fwd_hooks=[
            ("blocks.0.attn.hook_pattern", uniform),
            ("blocks.0.attn.hook_v", store),
            ("blocks.0.attn.hook_z", store),
        ],
    )
    v, z = seen["blocks.0.attn.hook_v"], seen["blocks.0.attn.hook_z"]
    running_mean = v.cumsum(1) / torch.arange(1, T + 1).view(1, T, 1, 1)
    torch.testing.assert_close(z, running_mean)


def test_hooks_are_removed_afterwards_even_on_error():
    model = build(LEARNED)
    ids = random_ids(LEARNED)

    def fail(t: torch.Tensor, hook) -> None:
        raise RuntimeError("a hook that fails")

    with pytest.raises(RuntimeError, match="a hook that fails"):
        model.run_with_hooks(
            ids,
            fwd_hooks=[
                ("blocks.0.hook_resid_mid", lambda t, hook: None),
                ("blocks.1.attn.hook_pattern", fail),
            ],
        )
    with pytest.raises(RuntimeError, match="a hook that fails"):
        model.run_with_cache(ids, fwd_hooks=[("blocks.1.mlp.hook_post", fail)])
    with pytest.raises(UserError):  # a bad name after a good one: the good one is removed too
        model.run_with_hooks(ids, fwd_hooks=[("hook_embed", fail), ("hook_embd_typo", fail)])
    assert not any(point.has_hooks for point in model.hook_dict.values())
    with model.hooks([("blocks.0.hook_resid_pre", lambda t, hook: t * 0)]):
        assert model.hook_dict["blocks.0.hook_resid_pre"].has_hooks
    assert not model.hook_dict["blocks.0.hook_resid_pre"].has_hooks
    model(ids)  # and the model still runs


class CountFusedCalls:
    """Stands in for torch's SDPA and counts the calls, so a test can see which attention path
    ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.original = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def test_no_hooks_means_the_fused_path(monkeypatch):
    model = build(ROPE_GQA)
    ids = random_ids(ROPE_GQA)
    fused = CountFusedCalls(monkeypatch)
    model(ids)
    assert fused.calls == ROPE_GQA.n_layers
    fused.calls = 0  # hooks on q, k, v, z and the residual stream keep it fused
    model.run_with_cache(
        ids, names_filter=lambda name: "pattern" not in name and "scores" not in name
    )
    assert fused.calls == ROPE_GQA.n_layers
    fused.calls = 0  # wanting layer 0's pattern sends only layer 0 down the explicit path
    model.run_with_cache(ids, names_filter="blocks.0.attn.hook_pattern")
    assert fused.calls == ROPE_GQA.n_layers - 1
    fused.calls = 0
    model.run_with_hooks(
        ids, fwd_hooks=[(lambda name: name.endswith("hook_attn_scores"), lambda t, hook: None)]
    )
    assert fused.calls == 0
    fused.calls = 0
    model(ids)
    assert fused.calls == ROPE_GQA.n_layers


@pytest.mark.parametrize(
    "config", [LEARNED, ROPE_GQA, ENCODER], ids=["learned", "rope-gqa", "encoder"]
)
def test_attaching_hooks_never_changes_the_result(config):
    model = build(config)
    ids = random_ids(config)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0 if config.causal else 1  # left padding for a decoder
    mask[1, -2:] = 1 if config.causal else 0  # right padding for an encoder
    plain = model(ids, attention_mask=mask)
    cached, _ = model.run_with_cache(ids, attention_mask=mask)
    identity = model.run_with_hooks(
        ids, attention_mask=mask, fwd_hooks=[(lambda name: True, lambda t, hook: t)]
    )
    for hooked in (cached, identity):
        assert relative_error(hooked, plain) <= 1e-5


def test_unknown_hook_names_suggest_the_nearest():
    model = build(LEARNED)
    ids = random_ids(LEARNED)
    with pytest.raises(
        UserError,
        match=r"unknown hook name 'blocks.0.attn.hook_patern'; did you mean "
        r".*blocks\.0\.attn\.hook_pattern",
    ):
        model.run_with_cache(ids, names_filter="blocks.0.attn.hook_patern")
    with pytest.raises(UserError, match=r"did you mean .*blocks\.1\.hook_resid_post"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_pst", lambda t, hook: None)])
    with pytest.raises(UserError, match=r"did you mean .*blocks\.0\.attn\.hook_q"):
        model.run_with_cache(ids, names_filter=["hook_embed", "blocks.0.attn.hook_qq"])
    with pytest.raises(UserError, match=r"model\.hook_names\(\)"):
        model.run_with_cache(ids, names_filter="zzzzzz")


def test_activation_cache_is_a_dict_with_help():
    cache = ActivationCache(
        {"blocks.0.attn.hook_pattern": torch.zeros(1), "blocks.1.attn.hook_pattern": torch.ones(1)}
    )
    assert cache.stack("blocks.{}.attn.hook_pattern").tolist() == [[0.0], [1.0]]
    with pytest.raises(KeyError, match="did you mean blocks.0.attn.hook_pattern"):
        cache["blocks.0.attn.hook_patern"]
    with pytest.raises(KeyError, match="no cached names match"):
        cache.stack("blocks.{}.attn.hook_z")
