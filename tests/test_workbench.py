"""attnlab.workbench: the Transformer users hold (attnlab.Transformer, attnlab.load) is the plain
model of attnlab.model with `generate` and a `run_with_cache` in the C kernels' layers; the plain
one has neither. The code that wants the kernels (the patching sweeps, head scores, pattern
capture, mean ablation, training's whole-split loss) enters their layers itself, for every pass,
on the plain model too."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import attnlab
from attnlab import formats, workbench
from attnlab.generate import fast_layers, kernels
from attnlab.generate.fast_layers import inference_kernels_unusable
from attnlab.generate.loop import generate
from attnlab.inspection.capture import capture_patterns
from attnlab.inspection.interventions import mean_z
from attnlab.inspection.scores import score_patterns
from attnlab.model import transformer
from attnlab.model.config import ModelConfig
from attnlab.training.trainer import whole_split_loss

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


def entered_sweep(model, ids, path):
    with fast_layers.inference_layers(model, ids):  # the clean run, as the user enters it
        clean = model.run_with_cache(ids.flip(1))[1]
    return attnlab.patching.get_act_patch_resid_pre(
        model, ids, clean, lambda logits: logits[:, -1, 0].mean(), path=path
    )


@pytest.mark.parametrize(
    "run",
    [
        lambda model, ids: score_patterns(model, ids),
        lambda model, ids: capture_patterns(model, ids, layers=[1]),
        lambda model, ids: mean_z(model, ids, 1),
        lambda model, ids: entered_sweep(model, ids, "reference"),
        lambda model, ids: entered_sweep(model, ids, "fast"),
        lambda model, ids: whole_split_loss(model, ids.flatten().numpy(), 64),
    ],
    ids=[
        "score_patterns",
        "capture_patterns",
        "mean_z",
        "sweep reference",
        "sweep fast",
        "training's whole-split loss",
    ],
)
def test_the_code_that_wants_the_kernels_enters_their_layers_for_every_pass(run, monkeypatch):
    """The plain model's forward enters no fast layer: each pass of the interpretability code
    runs within inference_layers, entered by that code (fast_layers.swapped is its swap)."""
    inside, passes, original = [0], [], fast_layers.swapped

    @contextlib.contextmanager
    def counted(roots, fast):
        with original(roots, fast):
            inside[0] += 1
            try:
                yield
            finally:
                inside[0] -= 1

    def forward(self, *args, **kwargs):
        passes.append(inside[0] > 0 or torch.is_grad_enabled())
        return plain_forward(self, *args, **kwargs)

    plain_forward = transformer.Transformer.forward
    monkeypatch.setattr(fast_layers, "swapped", counted)
    monkeypatch.setattr(transformer.Transformer, "forward", forward)
    torch.manual_seed(0)
    model = transformer.Transformer(CONFIG).eval()  # the plain class: no workbench help
    ids = torch.randint(0, CONFIG.d_vocab, (2, 64))
    passes.clear()
    with torch.no_grad():
        run(model, ids)
    assert passes and all(passes), passes
