"""attnlab.inspection.patching: sweeps against values computed here by running the blocks by hand
(no hooks), the patch-everything / patch-nothing bounds, the labelled axes, the heat maps and the
one-line errors."""

from __future__ import annotations

import pytest
import torch
from styles import config, randomize

import attnlab
from attnlab import Transformer
from attnlab.errors import UserError
from attnlab.inspection import patching
from attnlab.model.config import ModelConfig

T = 5
BASE = dict(d_vocab=13, n_ctx=16, d_model=16, n_layers=2, n_heads=4, d_mlp=24)
GPT2 = ModelConfig(**BASE)
LLAMA = config("llama-gqa", **BASE, tie_embeddings=True)
# Pythia (GPT-NeoX): attention and MLP in parallel on resid_pre (no resid_mid), partial RoPE, untied
PYTHIA = config("pythia-parallel", **BASE, rotary_fraction=0.5, tie_embeddings=False)
TOL = dict(rtol=1e-9, atol=1e-9)


def setup(config: ModelConfig):
    torch.manual_seed(0)
    model = Transformer(config).double().eval()
    randomize(model, 0.4)
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(0, config.d_vocab, (2, T), generator=g)
    corrupted = clean.clone()
    # one token differs, as in IOI's name swaps
    corrupted[:, 1] = (clean[:, 1] + 1) % config.d_vocab
    with torch.no_grad():
        clean_logits, cache = model.run_with_cache(clean)
    metric = patching.logit_diff_metric(answer=2, wrong=5)
    return model, clean, corrupted, cache, metric, float(metric(clean_logits))


def finish(model, resid: torch.Tensor, start: int) -> torch.Tensor:
    """Run the blocks from `start` on, then the final norm and the unembedding: no hooks
    involved."""
    with torch.no_grad():
        for block in model.blocks[start:]:
            resid = block(resid)
        return model.unembed(model.ln_final(resid))


def test_resid_pre_sweep_equals_running_the_blocks_by_hand():
    model, clean, corrupted, cache, metric, clean_value = setup(GPT2)
    result = patching.get_act_patch_resid_pre(
        model, corrupted, cache, metric, clean_metric=clean_value
    )
    assert result.axis_names == ("layer", "pos") and result.shape == (2, T)
    with torch.no_grad():
        _, corrupted_cache = model.run_with_cache(corrupted)
    for layer in range(2):
        for pos in range(T):
            resid = corrupted_cache["resid_pre", layer].clone()
            resid[:, pos] = cache["resid_pre", layer][:, pos]
            assert float(result[layer, pos]) == pytest.approx(
                float(metric(finish(model, resid, layer))), rel=1e-9
            )
    # positions the corruption never reached (before it) change nothing; at layer 0, pos 1 is the
    # whole difference
    torch.testing.assert_close(
        result[0, 0], torch.tensor(result.corrupted, dtype=result.values.dtype), **TOL
    )
    assert float(result[0, 1]) == pytest.approx(clean_value, rel=1e-9)
    assert float(result.normalized()[0, 1]) == pytest.approx(1.0)


def test_head_sweep_equals_recomputing_the_layer_by_hand():
    model, clean, corrupted, cache, metric, _ = setup(GPT2)
    result = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric)
    assert result.axis_names == ("layer", "head") and result.shape == (2, 4)
    with torch.no_grad():
        _, corrupted_cache = model.run_with_cache(corrupted)
    last = 1  # the last layer: attn_out = Σ_h z_h W_O^h + b_O, then the MLP, then the head
    for head in range(4):
        z = corrupted_cache["z", last].clone()
        z[:, :, head] = cache["z", last][:, :, head]
        attn_out = torch.einsum("bthd,hdm->btm", z, model.W_O[last]) + model.b_O[last]
        resid_mid = corrupted_cache["resid_pre", last] + attn_out
        with torch.no_grad():
            resid = resid_mid + model.blocks[last].mlp(model.blocks[last].ln2(resid_mid))
        logits = finish(model, resid, last + 1)
        assert float(result[last, head]) == pytest.approx(float(metric(logits)), rel=1e-9)


@pytest.mark.parametrize("config", [GPT2, LLAMA, PYTHIA], ids=["gpt2", "llama-gqa", "pythia"])
def test_patch_everything_gives_clean_and_nothing_gives_corrupted(config):
    model, clean, corrupted, cache, metric, clean_value = setup(config)
    with torch.no_grad():
        corrupted_value = float(metric(model(corrupted)))
    everything = lambda act, index, clean_act: clean_act.clone()  # noqa: E731
    nothing = lambda act, index, clean_act: act  # noqa: E731
    # the whole stream into a layer, or out of the last one, carries the whole clean run
    for name in ("resid_pre", "resid_post"):
        result = patching.generic_activation_patch(
            model, corrupted, cache, metric, everything, name, ("layer",)
        )
        index = 0 if name == "resid_pre" else -1
        assert float(result[index]) == pytest.approx(clean_value, rel=1e-9)
    for name in ("resid_pre", "attn_out", "mlp_out", "z", "pattern", "q", "k", "v"):
        result = patching.generic_activation_patch(
            model, corrupted, cache, metric, nothing, name, ("layer",)
        )
        torch.testing.assert_close(
            result.values, torch.full((2,), corrupted_value, dtype=torch.float64), **TOL
        )


@pytest.mark.parametrize("config", [GPT2, LLAMA, PYTHIA], ids=["gpt2", "llama-gqa", "pythia"])
def test_every_sweep_has_labelled_axes_and_a_heat_map(config, tmp_path):
    model, clean, corrupted, cache, metric, clean_value = setup(config)
    kv = config.n_kv_heads
    expected = {  # every sweep of the module (checked below), with its [layer, ...] shape
        "get_act_patch_resid_pre": (2, T),
        "get_act_patch_resid_mid": (2, T),
        "get_act_patch_attn_out": (2, T),
        "get_act_patch_mlp_out": (2, T),
        "get_act_patch_attn_head_out_all_pos": (2, 4),
        "get_act_patch_attn_head_q_all_pos": (2, 4),
        "get_act_patch_attn_head_k_all_pos": (2, kv),
        "get_act_patch_attn_head_v_all_pos": (2, kv),
        "get_act_patch_attn_head_pattern_all_pos": (2, 4),
        "get_act_patch_attn_head_out_by_pos": (2, T, 4),
        "get_act_patch_attn_head_q_by_pos": (2, T, 4),
        "get_act_patch_attn_head_k_by_pos": (2, T, kv),
        "get_act_patch_attn_head_v_by_pos": (2, T, kv),
        "get_act_patch_attn_head_pattern_by_pos": (2, 4, T),
    }
    sweeps = {
        n for n in dir(patching) if n.startswith("get_act_patch_") and not n.endswith("_every")
    }
    assert sweeps == set(expected)
    if config.parallel_residual:  # no resid_mid: the MLP reads resid_pre
        with pytest.raises(UserError, match="no resid_mid to patch"):
            patching.get_act_patch_resid_mid(model, corrupted, cache, metric)
        del expected["get_act_patch_resid_mid"]
    for name, shape in expected.items():
        result = getattr(patching, name)(model, corrupted, cache, metric, clean_metric=clean_value)
        assert result.shape == shape, name
        assert all(len(result.labels[a]) == n for a, n in zip(result.axis_names, shape)), name
        assert torch.isfinite(result.values).all()
    block = patching.get_act_patch_block_every(
        model, corrupted, cache, metric, clean_metric=clean_value
    )
    assert block.axis_names == ("activation", "layer", "pos") and block.labels["activation"] == [
        "resid_pre",
        "attn_out",
        "mlp_out",
    ]
    heads = patching.get_act_patch_attn_head_all_pos_every(
        model, corrupted, cache, metric, clean_metric=clean_value
    )
    assert heads.shape == (5, 2, 4)
    assert (
        torch.isnan(heads.values[2, :, kv:]).all() and torch.isfinite(heads.values[:, :, :kv]).all()
    )
    for result, file in (
        (block, "block.png"),
        (heads, "heads.png"),
        (
            patching.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, metric),
            "by_pos.png",
        ),
    ):
        path = result.plot(tmp_path / file)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert block.to_dict()["shape"] == [3, 2, T]


def test_mistakes_are_one_line_errors():
    model, clean, corrupted, cache, metric, _ = setup(GPT2)
    with pytest.raises(UserError, match="same length"):
        patching.get_act_patch_resid_pre(model, corrupted[:, :3], cache, metric)
    with pytest.raises(
        UserError,
        match=r"unknown hook name 'blocks.0.hook_resid_pree'; did you mean .*hook_resid_pre",
    ):
        patching.generic_activation_patch(
            model,
            corrupted,
            cache,
            metric,
            patching.layer_pos_patch_setter,
            "resid_pree",
            ("layer", "pos"),
        )
    with pytest.raises(UserError, match="one number"):
        patching.get_act_patch_resid_pre(model, corrupted, cache, lambda logits: logits[:, -1, 0])
    with pytest.raises(UserError, match="clean cache has no"):
        partial = model.run_with_cache(clean, names_filter="blocks.0.hook_resid_pre")[1]
        patching.get_act_patch_attn_out(model, corrupted, partial, metric)


# The fast path against the reference one
# --------------------------------------------------------------------------------------------------
SWEEPS = [n for n in dir(patching) if n.startswith("get_act_patch_") and not n.endswith("_every")]


@pytest.mark.parametrize("config", [GPT2, LLAMA, PYTHIA], ids=["gpt2", "llama-gqa", "pythia"])
@pytest.mark.parametrize("reads", ["last position", "position 2", "every position"])
def test_fast_sweeps_equal_the_reference_ones(config, reads):
    """Every named sweep, its patched runs stacked three at a time (a count that splits a layer's
    heads and positions unevenly) and started at the patched layer, equals one whole run per
    index; with a metric that names the one position it reads (unembedded alone) and one that
    does not (every position's logits)."""
    model, clean, corrupted, cache, _, clean_value = setup(config)
    if reads == "every position":  # the same numbers, but nothing says which logits it reads
        last = patching.logit_diff_metric(answer=2, wrong=5)
        metric = lambda logits: last(logits)  # noqa: E731
        expected_notes = {"path": "fast"}
    else:
        metric = patching.logit_diff_metric(answer=2, wrong=5, pos=-1 if "last" in reads else 2)
        expected_notes = {"path": "fast", "logits": f"position {metric.logits_position} only"}
    for name in SWEEPS:
        if name == "get_act_patch_resid_mid" and config.parallel_residual:
            continue
        sweep = getattr(patching, name)
        fast = sweep(model, corrupted, cache, metric, path="fast", batch_size=3)
        reference = sweep(model, corrupted, cache, metric, path="reference")
        assert fast.notes == expected_notes, name
        assert reference.notes["path"] == "reference", name
        torch.testing.assert_close(fast.values, reference.values, **TOL, msg=name)
        assert fast.corrupted == pytest.approx(reference.corrupted, rel=1e-12)
        # the default stack: every patched run of a layer in one forward pass
        torch.testing.assert_close(
            sweep(model, corrupted, cache, metric).values, reference.values, **TOL, msg=name
        )


@pytest.mark.slow
def test_fast_head_sweep_equals_the_reference_on_smollm2():
    """The real grouped-query model (30 layers x 9 heads, 3 key/value heads), float32, a short
    prompt: the whole head-output sweep on the fast path against the reference path's own runs
    (its hook, one whole run each) for every head of the first, a middle and the last layer (the
    whole reference sweep is 270 runs)."""
    model = attnlab.load("smollm2")
    clean = model.to_tokens("The cat sat on the mat because it")
    corrupted = model.to_tokens("The dog sat on the mat because it")
    assert clean.shape == corrupted.shape
    metric = patching.logit_diff_metric(model.to_single_token(" was"), model.to_single_token(" is"))
    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        fast = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric)
        assert fast.notes == {"path": "fast", "logits": "position -1 only"}
        assert fast.shape == (30, 9)
        assert fast.corrupted == pytest.approx(float(metric(model(corrupted))), abs=1e-5)
        reference = torch.stack(
            [
                torch.tensor(
                    [
                        float(metric(patched_run(model, corrupted, cache, layer, head)))
                        for head in range(9)
                    ]
                )
                for layer in (0, 15, 29)
            ]
        ).double()
    scale = float(reference.abs().max())
    torch.testing.assert_close(fast[[0, 15, 29]], reference, rtol=1e-5, atol=1e-5 * scale)


def patched_run(model, corrupted, cache, layer: int, head: int) -> torch.Tensor:
    """The reference path's run for one index: the whole model, the sweep's setter in a hook."""
    name = f"blocks.{layer}.attn.hook_z"

    def hook(z, hook):
        return patching.layer_head_vector_patch_setter(z.clone(), (layer, head), cache[name])

    return model.run_with_hooks(corrupted, fwd_hooks=[(name, hook)])


def test_fast_path_falls_back_visibly_or_refuses(caplog):
    model, clean, corrupted, cache, metric, _ = setup(LLAMA)

    def own_setter(activation, index, clean_act):  # a caller's setter: the fast path won't guess
        activation[:, index[1]] = clean_act[:, index[1]]
        return activation

    args = (model, corrupted, cache, metric, own_setter, "resid_pre", ("layer", "pos"))
    with caplog.at_level("INFO", logger="attnlab.inspection.patching"):
        result = patching.generic_activation_patch(*args)
    assert result.notes == {
        "path": "reference",
        "why": "patch_setter 'own_setter' is the caller's own",
    }
    assert "patch resid_pre: reference path (patch_setter 'own_setter'" in caplog.text
    reference = patching.get_act_patch_resid_pre(model, corrupted, cache, metric)
    torch.testing.assert_close(result.values, reference.values, **TOL)
    with pytest.raises(UserError, match="fast patching path does not apply: patch_setter"):
        patching.generic_activation_patch(*args, path="fast")
    # a hook of the caller's on the model: it must run as the reference path runs it
    with model.hooks([("blocks.0.hook_resid_pre", lambda x, hook: x * 1.5)]):
        hooked = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric)
        with pytest.raises(UserError, match=r"hooks are attached to the model \(blocks.0.hook_re"):
            patching.get_act_patch_attn_head_out_all_pos(
                model, corrupted, cache, metric, path="fast"
            )
    assert hooked.notes["path"] == "reference" and "hooks are attached" in hooked.notes["why"]
    # a plain torch hook on any module counts too
    handle = model.blocks[1].mlp.register_forward_pre_hook(lambda module, args: None)
    try:
        plain = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric)
    finally:
        handle.remove()
    assert plain.notes["why"] == "hooks are attached to the model (blocks.1.mlp)"
    every = patching.get_act_patch_attn_head_all_pos_every(model, corrupted, cache, metric)
    assert every.notes["path"] == "fast" and set(every.notes["paths"].values()) == {"fast"}
    with pytest.raises(UserError, match="path must be one of auto, fast, reference"):
        patching.get_act_patch_resid_pre(model, corrupted, cache, metric, path="quick")
    with pytest.raises(UserError, match="batch_size must be at least 1"):
        patching.get_act_patch_resid_pre(model, corrupted, cache, metric, batch_size=0)
    metric.logits_position = T
    with pytest.raises(UserError, match=r"logits_position \(5\) is not a position of the 5 tokens"):
        patching.get_act_patch_resid_pre(model, corrupted, cache, metric)


def test_start_at_layer_continues_the_run():
    model, clean, corrupted, cache, metric, _ = setup(LLAMA)
    with torch.no_grad():
        logits = model(clean)
        torch.testing.assert_close(model(cache["resid_pre", 1], start_at_layer=1), logits, **TOL)
        torch.testing.assert_close(
            model(cache["resid_pre", 0], start_at_layer=0, stop_at_layer=1),
            cache["resid_pre", 1],
            **TOL,
        )
    with pytest.raises(UserError, match=r"start_at_layer=2 is not a block of this model; give 0"):
        model(cache["resid_pre", 1], start_at_layer=2)
    with pytest.raises(UserError, match=r"the input is the residual stream \[batch, pos, d_model"):
        model(clean, start_at_layer=1)
