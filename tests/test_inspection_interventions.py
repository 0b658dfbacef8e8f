"""Ablating heads and patching activations through run_with_hooks."""

import pytest
import torch

import attnlab
from attnlab.inspection.interventions import ablate_head, mean_z, patch


@pytest.fixture
def model() -> attnlab.Transformer:
    torch.manual_seed(0)
    return attnlab.Transformer(
        attnlab.preset("nano", d_vocab=50, n_ctx=32, n_layers=2, d_model=32)
    ).eval()


def test_zero_ablation_equals_removing_the_head_from_W_O(model):
    ids = torch.randint(50, (2, 16))
    ablated = model.run_with_hooks(ids, fwd_hooks=[ablate_head(1, 2, "zero")])
    D = model.config.d_head
    with torch.no_grad():
        model.blocks[1].attn.W_O.weight[:, 2 * D : 3 * D] = 0.0  # head 2's columns of W_O
        reference = model(ids)
    torch.testing.assert_close(ablated, reference)


def test_mean_ablation_uses_the_given_mean_or_this_runs(model):
    ids = torch.randint(50, (3, 16))
    mean = mean_z(model, ids, layer=0)  # [head, d_head]
    assert mean.shape == (4, model.config.d_head)
    seen = {}

    def look(z, hook):
        seen["z"] = z

    with_given = model.run_with_hooks(
        ids, fwd_hooks=[ablate_head(0, 1, "mean", mean=mean), ("blocks.0.attn.hook_z", look)]
    )
    torch.testing.assert_close(seen["z"][:, :, 1], mean[1].expand(3, 16, -1))
    of_this_run = model.run_with_hooks(ids, fwd_hooks=[ablate_head(0, 1, "mean")])
    torch.testing.assert_close(with_given, of_this_run)  # same batch: same mean
    assert not torch.allclose(with_given, model(ids))


def test_ablation_hooks_do_not_write_into_their_input(model):
    ids = torch.randint(50, (1, 8))
    seen = {}

    # runs first and keeps the tensor itself (no copy): the ablation must not zero it
    def keep(z, hook):
        seen["z"] = z

    ablated = model.run_with_hooks(
        ids, fwd_hooks=[("blocks.0.attn.hook_z", keep), ablate_head(0, 0)]
    )
    assert seen["z"][:, :, 0].abs().sum() > 0
    assert not torch.allclose(ablated, model(ids))


def test_patching_the_whole_residual_reproduces_the_source_run(model):
    clean, corrupt = torch.randint(50, (2, 12)), torch.randint(50, (2, 12))
    clean_logits, clean_cache = model.run_with_cache(clean, names_filter="blocks.1.hook_resid_pre")
    patched = model.run_with_hooks(
        corrupt, fwd_hooks=[patch("blocks.1.hook_resid_pre", clean_cache)]
    )
    torch.testing.assert_close(patched, clean_logits)


def test_patching_one_position_changes_only_that_position_and_later(model):
    clean, corrupt = torch.randint(50, (1, 12)), torch.randint(50, (1, 12))
    _, clean_cache = model.run_with_cache(clean, names_filter="blocks.0.hook_resid_pre")
    base = model(corrupt)
    patched = model.run_with_hooks(
        corrupt, fwd_hooks=[patch("blocks.0.hook_resid_pre", clean_cache, index=(slice(None), 5))]
    )
    torch.testing.assert_close(patched[:, :5], base[:, :5])  # causal: earlier positions untouched
    assert not torch.allclose(patched[:, 5], base[:, 5])


def test_intervention_errors(model):
    with pytest.raises(attnlab.UserError, match="zero, mean"):
        ablate_head(0, 0, "random")
    with pytest.raises(attnlab.UserError, match="head 7"):
        model.run_with_hooks(torch.zeros(1, 4, dtype=torch.long), fwd_hooks=[ablate_head(0, 7)])
    with pytest.raises(attnlab.UserError, match="same shape"):
        model.run_with_hooks(
            torch.zeros(1, 4, dtype=torch.long),
            fwd_hooks=[patch("blocks.0.hook_resid_pre", torch.zeros(1, 5, 32))],
        )
