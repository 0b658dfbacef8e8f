"""Norms and the position-wise MLP, the two non-attention parts of a block.

Design choices:
- LayerNorm: (x − mean) / √(var + ε) · w + b (Ba et al. 2016); RMSNorm: x / √(mean(x²) + ε) · w
  (Zhang & Sennrich 2019), computed in float32 and cast back, as LLaMA does, so low-precision runs
  normalise accurately.
- Parameters are called `weight` / `bias` so checkpoints of every format map onto them directly.
- Hook points mean what TransformerLens's mean: `hook_scale` [batch, pos, 1] is the divisor
  √(mean(x̃²) + ε) (x̃ = x − mean for LayerNorm, x for RMSNorm) and `hook_normalized` is x̃ / scale,
  the normalized input BEFORE the weight and bias. `cache.apply_ln_to_stack` divides by the cached
  scale.
- The output is always the fast form (torch's fused `F.layer_norm` and `F.rms_norm`) unless a hook
  replaces hook_scale or hook_normalized: then the output is computed from the replaced tensors, as
  in TransformerLens. So hooks that only read (run_with_cache) never change a number, and an edit
  takes effect; tests/test_lens.py holds the equation to the fused kernel.
- The MLP expands d_model -> d_mlp (default 4×), applies GELU (exact or tanh), ReLU or ReLU²
  (relu(x)², So et al. 2021's Primer; a record of the modded-nanogpt speedrun), and projects back;
  the gated ones (Shazeer 2020) multiply act(W_gate x) by W_in x: SwiGLU with silu (LLaMA), GeGLU
  with the tanh GELU (Gemma). hook_pre is the pre-activation (of the gate), hook_post what goes
  into W_out.
- `Linear` is F.linear, nothing faster: the fast layers (the C kernels) live in
  attnlab.generate.fast_layers and are swapped in by the code that wants them; weights in fewer
  bits are attnlab.quant's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..lens.hooks import HookPoint
from .config import ModelConfig


class Linear(nn.Linear):
    """nn.Linear (y = x Wᵀ + b) whose weight may be stored narrower than the activations
    (`store_weights_as` of attnlab.quant.quantize): it is widened where it is used. The fast
    products (the C kernels, the compiled multiply-and-sum) are attnlab.generate.fast_layers',
    swapped in by the code that wants them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.linear(x, weight, self.bias)


class LayerNorm(nn.Module):
    """(x − mean) / √(var + ε) · w + b."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]: before weight and bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        if not (self.hook_scale.has_hooks or self.hook_normalized.has_hooks):
            return out
        centred = x - x.mean(-1, keepdim=True)
        scale = (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        normalized = _hooked_norm(self, centred, scale)
        if normalized is None:  # the hooks only read: keep the fused kernel's numbers
            return out
        normalized = normalized * self.weight
        return normalized if self.bias is None else normalized + self.bias


class RMSNorm(nn.Module):
    """x / √(mean(x²) + ε) · w, in float32 at least (as LLaMA computes it)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]: before the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # half/bfloat16 up to float32; float64 stays exact
        x = x.to(torch.promote_types(dtype, torch.float32))
        # torch's fused kernel: one pass where pow, mean, add, rsqrt and mul took five (faster
        # forward and backward, the same numbers: benchmarks/README.md, "Figures behind the code")
        out = self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps).to(dtype)
        if not (self.hook_scale.has_hooks or self.hook_normalized.has_hooks):
            return out
        normalized = _hooked_norm(self, x, (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return out if normalized is None else self.weight * normalized.to(dtype)


def _hooked_norm(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """Run hook_scale and hook_normalized (= x / scale) of a norm; the normalized input if a hook
    replaced either, else None (the caller keeps its fast result, so reading a norm's hooks never
    changes a number)."""
    hooked_scale = norm.hook_scale(scale)
    normalized = x / hooked_scale
    hooked = norm.hook_normalized(normalized)
    return None if hooked is normalized and hooked_scale is scale else hooked


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or config.d_model
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    return LayerNorm(dim, config.norm_eps, bias=config.bias)


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "swiglu": F.silu,  # the gate's nonlinearity
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # the gate's nonlinearity
}


class MLP(nn.Module):
    """Position-wise feed-forward: W_out · act(W_in · x), or W_out · (act(W_gate · x) ⊙ W_in · x)
    for the gated ones (SwiGLU, GeGLU)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gated = config.gated_mlp
        self.act = _ACTIVATIONS[config.mlp]
        self.W_in = Linear(config.d_model, config.d_mlp, bias=config.bias)
        self.W_gate = Linear(config.d_model, config.d_mlp, bias=config.bias) if self.gated else None
        self.W_out = Linear(config.d_mlp, config.d_model, bias=config.bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            post = self.act(self.hook_pre(self.W_gate(x))) * self.W_in(x)
        else:
            post = self.act(self.hook_pre(self.W_in(x)))
        return self.W_out(self.hook_post(post))
