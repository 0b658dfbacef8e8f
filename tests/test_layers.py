"""attnlab.model.layers: norms and MLPs against the oracle in float64 (tolerance 1e-10)."""

from __future__ import annotations

import numpy as np
import pytest
import reference
import torch

from attnlab.model.config import ModelConfig
from attnlab.model.layers import MLP, LayerNorm, RMSNorm, make_norm

F64 = dict(rtol=1e-10, atol=1e-10)


def randomize(module: torch.nn.Module) -> torch.nn.Module:
    """float64, with every parameter drawn from N(0, 1) so weights and biases all matter."""
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def params(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy() for name, p in module.state_dict().items()}


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_reference(rng, bias):
    dim = int(rng.integers(2, 20))
    norm = randomize(LayerNorm(dim, eps=1e-5, bias=bias))
    x = rng.normal(size=(3, 4, dim)) * 5 + 2
    p = params(norm)
    expected = reference.layer_norm(x, p["weight"], p.get("bias"), 1e-5)
    torch.testing.assert_close(norm(torch.from_numpy(x)), torch.from_numpy(expected), **F64)


def test_rms_norm_matches_reference(rng):
    dim = int(rng.integers(2, 20))
    norm = randomize(RMSNorm(dim, eps=1e-6))
    x = rng.normal(size=(3, 4, dim)) * 5
    expected = reference.rms_norm(x, params(norm)["weight"], 1e-6)
    torch.testing.assert_close(norm(torch.from_numpy(x)), torch.from_numpy(expected), **F64)


def test_rms_norm_keeps_low_precision_dtypes_and_computes_in_float32():
    norm = RMSNorm(16)
    x = torch.randn(2, 16) * 100
    out = norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), norm.float()(x.to(torch.bfloat16).float()), rtol=1e-2, atol=1e-2
    )


def test_norms_reach_unit_scale():
    x = torch.randn(5, 32, dtype=torch.float64) * 7 + 3
    ln = LayerNorm(32).double()(x)
    torch.testing.assert_close(ln.mean(-1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        ln.var(-1, unbiased=False), torch.ones(5, dtype=torch.float64), atol=1e-5, rtol=0
    )
    rms = RMSNorm(32).double()(x)
    torch.testing.assert_close(
        rms.pow(2).mean(-1), torch.ones(5, dtype=torch.float64), atol=1e-5, rtol=0
    )


def test_make_norm_follows_the_config():
    assert isinstance(make_norm(ModelConfig()), LayerNorm)
    assert make_norm(ModelConfig(bias=False)).bias is None
    norm = make_norm(ModelConfig(norm="rmsnorm", norm_eps=1e-3), dim=7)
    assert isinstance(norm, RMSNorm) and norm.weight.shape == (7,) and norm.eps == 1e-3


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "relu", "relu2", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_reference(rng, kind, bias):
    d_model = int(rng.integers(2, 12))
    d_mlp = int(rng.integers(2, 24)) if rng.random() < 0.5 else None
    config = ModelConfig(d_model=d_model, n_heads=1, d_mlp=d_mlp, mlp=kind, bias=bias)
    mlp = randomize(MLP(config))
    x = rng.normal(size=(2, 3, d_model))
    p = params(mlp)
    expected = reference.mlp(
        x,
        {
            "W_in": p["W_in.weight"],
            "b_in": p.get("W_in.bias"),
            "W_out": p["W_out.weight"],
            "b_out": p.get("W_out.bias"),
            "W_gate": p.get("W_gate.weight"),
            "b_gate": p.get("W_gate.bias"),
        },
        kind,
    )
    torch.testing.assert_close(mlp(torch.from_numpy(x)), torch.from_numpy(expected), **F64)
    assert mlp.W_in.weight.shape == (d_mlp or 4 * d_model, d_model)  # default width: 4 × d_model
    assert (mlp.W_gate is not None) == (kind == "swiglu")


def test_gelu_variants_differ_and_match_their_formulas(rng):
    x = rng.normal(size=50) * 3
    exact, approx = reference.gelu(x), reference.gelu_tanh(x)
    assert np.abs(exact - approx).max() > 1e-5  # they are different functions
    assert np.abs(exact - approx).max() < 1e-2  # that approximate each other
    t = torch.from_numpy(x)
    torch.testing.assert_close(torch.nn.functional.gelu(t), torch.from_numpy(exact), **F64)
    torch.testing.assert_close(
        torch.nn.functional.gelu(t, approximate="tanh"), torch.from_numpy(approx), **F64
    )


def test_mlp_hooks_see_the_pre_activation_and_what_enters_w_out(rng):
    config = ModelConfig(d_model=6, n_heads=1, d_mlp=10, mlp="gelu")
    mlp = randomize(MLP(config))
    seen = {}
    mlp.hook_pre.add_hook(lambda t, hook: seen.__setitem__("pre", t))
    mlp.hook_post.add_hook(lambda t, hook: seen.__setitem__("post", t))
    x = torch.from_numpy(rng.normal(size=(1, 2, 6)))
    out = mlp(x)
    torch.testing.assert_close(seen["pre"], mlp.W_in(x))
    torch.testing.assert_close(seen["post"], torch.nn.functional.gelu(seen["pre"]))
    torch.testing.assert_close(out, mlp.W_out(seen["post"]))
