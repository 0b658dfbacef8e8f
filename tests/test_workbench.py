"""attnlab.workbench: the Transformer users hold (attnlab.Transformer, attnlab.load) is the plain
model of attnlab.model with `generate` and a `run_with_cache` in the C kernels' layers; the plain
one has neither."""

from __future__ import annotations

import inspect

import pytest
import torch

import attnlab
from attnlab import formats, workbench
from attnlab.generate import kernels
from attnlab.generate.fast_layers import inference_kernels_unusable
from attnlab.generate.loop import generate
from attnlab.model import transformer
from attnlab.model.config import ModelConfig

CONFIG = ModelConfig(d_vocab=97, n_ctx=128, d_model=128, n_layers=2, n_heads=4, d_mlp=192)


def test_attnlabs_transformer_is_the_plain_one_with_generation_added():
    assert attnlab.Transformer is workbench.Transformer
    assert issubclass(workbench.Transformer, transformer.Transformer)
    assert not hasattr(transformer.Transformer, "generate")
    # methods only: the same modules and state as the plain model
    torch.manual_seed(0)
    plain = transformer.Transformer(CONFIG)
    torch.manual_seed(0)
    held = attnlab.Transformer(CONFIG)
    assert plain.state_dict().keys() == held.state_dict().keys()
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in held.state_dict().items())
    assert vars(plain).keys() == vars(held).keys()


def test_load_gives_the_workbench_model_with_the_formats_parameters(tmp_path):
    model = attnlab.Transformer(CONFIG).eval()
    attnlab.save(model, tmp_path / "run")
    assert type(formats.load(tmp_path / "run")) is transformer.Transformer
    loaded = attnlab.load(tmp_path / "run")
    assert type(loaded) is workbench.Transformer
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))
    assert inspect.signature(workbench.load).parameters.keys() == (
        inspect.signature(formats.load).parameters.keys()
    )
    assert all(
        inspect.signature(workbench.load).parameters[k].default == p.default
        for k, p in inspect.signature(formats.load).parameters.items()
    )


def test_generate_is_generations_and_run_with_cache_takes_the_kernels_layers():
    torch.manual_seed(0)
    model = attnlab.Transformer(CONFIG).eval()
    ids = torch.randint(0, CONFIG.d_vocab, (2, 64))
    assert torch.equal(
        model.generate(ids[:1, :8], 6, temperature=0),
        generate(model, ids[:1, :8], 6, temperature=0),
    )
    fast = {"swapped": False}

    def see(tensor, hook):
        fast["swapped"] = type(model.blocks[0].attn.W_Q).__name__ == "KernelLinear"

    with torch.no_grad():
        model.run_with_cache(ids, fwd_hooks=[("blocks.0.hook_resid_pre", see)])
        assert fast["swapped"] == (kernels.available() and inference_kernels_unusable() is None)
        plain = transformer.Transformer.run_with_hooks
        fast["swapped"] = False
        plain(model, ids, fwd_hooks=[("blocks.0.hook_resid_pre", see)])
        assert not fast["swapped"]  # the plain model's run_with_hooks: its own modules


@pytest.mark.parametrize("start_at_layer", [None, 1])
def test_run_with_hooks_passes_the_input_on_as_given(start_at_layer):
    torch.manual_seed(0)
    model = attnlab.Transformer(CONFIG).eval()
    ids = torch.randint(0, CONFIG.d_vocab, (2, 64))
    with torch.no_grad():
        x = (
            ids
            if start_at_layer is None
            else model.embed_tokens(ids, torch.arange(64).expand(2, 64), None)
        )
        by_name = model.run_with_hooks(ids=x, start_at_layer=start_at_layer)
        by_position = model.run_with_hooks(x, start_at_layer=start_at_layer)
    assert torch.equal(by_name, by_position)
