"""Norms and the position-wise MLP, the two non-attention parts of a block.

Design choices:
- LayerNorm: (x − mean) / √(var + ε) · w + b (Ba et al. 2016); RMSNorm: x / √(mean(x²) + ε) · w
  (Zhang & Sennrich 2019), computed in float32 and cast back, as LLaMA does, so low-precision runs
  normalise accurately.
- Parameters are called `weight` / `bias` so checkpoints of every format map onto them directly.
- Hook points mean what TransformerLens's mean: `hook_scale` [batch, pos, 1] is the divisor
  √(mean(x̃²) + ε) (x̃ = x − mean for LayerNorm, x for RMSNorm) and `hook_normalized` is x̃ / scale, the
  normalized input BEFORE the weight and bias. `cache.apply_ln_to_stack` divides by the cached scale.
- The output is always the fast form (torch's fused `F.layer_norm` and `F.rms_norm`) unless a hook
  replaces hook_scale or hook_normalized: then the output is computed from the replaced tensors, as in
  TransformerLens. So hooks that only read (run_with_cache) never change a number, and an edit takes effect;
  tests/test_lens.py holds the equation to the fused kernel.
- The MLP expands d_model -> d_mlp (default 4×), applies GELU (exact or tanh), ReLU or ReLU² (relu(x)²,
  So et al. 2021's Primer; a record of the modded-nanogpt speedrun), and projects back;
  SwiGLU (Shazeer 2020) multiplies silu(W_gate x) by W_in x. hook_pre is the pre-activation,
  hook_post what goes into W_out.
- Weights in 8 bits (`quantize(model, "int8")`): each output feature's row w is stored as q = round(w / s) in
  int8 with s = max|w| / 127, one float32 scale per row (gpt-fast's int8 weight-only scheme; llama.cpp's Q8_0
  keeps one scale per block of 32 instead). Activations stay float32: y = (x qᵀ) ⊙ s + b.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..generate import kernels
from .config import ModelConfig
from ..errors import UserError
from ..lens.hooks import HookPoint


# up to this many rows a few-row product beat BLAS here: the compiled multiply-and-sum form (2.5x at 1 row, 1.5x at
# 8) and the C kernel (attnlab.generate.kernels), in Linear.forward and in the kernel decode step alike
MATVEC_MAX_ROWS = 8


def few_rows(x: torch.Tensor) -> bool:
    return x.shape[:-1].numel() <= MATVEC_MAX_ROWS


def kernel_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Few rows of the width the weight takes: a wrong width goes on to F.linear, whose error names both shapes."""
    return few_rows(x) and x.shape[-1] == weight.shape[-1]


class Linear(nn.Linear):
    """nn.Linear (y = x Wᵀ + b), with two fast paths for a few rows (decoding a batch of up to MATVEC_MAX_ROWS
    sequences), whose weights come from main memory at every token: eager, float32 on a CPU, the C kernel of
    attnlab.generate.kernels, which streams each weight row once; inside a compiled graph, a row-wise multiply and sum,
    which inductor turns into one vectorised loop. Both beat the BLAS call at these sizes (how much, on
    which CPU: benchmarks/README.md, "Generation speed"); every larger product takes F.linear, and
    tests/test_fast_paths.py and tests/test_kernels.py hold them to its numbers.
    The weight may be stored narrower than the activations (`store_weights_as`): it is widened where it is used,
    which a compiled graph fuses into the same loop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
            return matvec(x, weight, self.bias) if few_rows(x) else F.linear(x, weight, self.bias)
        if x.dtype == self.weight.dtype == torch.float32 and kernel_rows(x, self.weight) and kernels.usable(x, self.weight):
            return kernels.linear(x, self.weight, self.bias)
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.linear(x, weight, self.bias)


class Int8Linear(nn.Module):
    """A Linear whose weight is stored in int8 with one float32 scale per output feature (`quantize`):
    y = (x qᵀ) ⊙ scale + b, the activations in their own dtype. A few rows on a CPU take the C kernel, which
    widens each int8 weight in registers; otherwise the int8 weight is widened and multiplied (in a compiled
    graph, inside the same multiply-and-sum loop as Linear's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Round each row of `weight` (d_out, d_in) to int8 steps of max|row| / 127 (symmetric, so 0 stays 0)."""
        module = cls(weight.shape[1], weight.shape[0], bias is not None, weight.device)
        with torch.no_grad():
            w = weight.detach().float()
            scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
            module.weight.copy_(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            module.scale.copy_(scale)
            if bias is not None:
                module.bias.copy_(bias.detach())
        return module

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the int8 values stand for: q ⊙ scale, (d_out, d_in)."""
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            y = matvec(x, self.weight.to(x.dtype)) if few_rows(x) else F.linear(x, self.weight.to(x.dtype))
        elif x.dtype == torch.float32 and kernel_rows(x, self.weight) and kernels.usable(x, self.weight):
            return kernels.linear(x, self.weight, self.bias, self.scale)
        else:
            y = F.linear(x, self.weight.to(x.dtype))
        y = y * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


QUANTIZATIONS = ("int8",)


def quantize(model: nn.Module, scheme: str = "int8") -> nn.Module:
    """Store every Linear's weight in 8 bits, in place, for inference (weight-only: activations, norms, embeddings
    stay as they are). A tied LM head gets its own int8 copy; the token embedding it shares keeps its dtype, since
    a lookup reads one row. The model remembers it (`model.quantization`), so attnlab.save writes it that way."""
    if scheme not in QUANTIZATIONS:
        raise UserError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if getattr(model, "quantization", None) == scheme:
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_float(child.weight, child.bias))
    model.quantization = scheme
    return model


def store_weights_as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store every Linear's weight matrix in `dtype` (bfloat16: half the bytes a decode step reads), in place,
    for inference; activations, norms, embeddings and biases keep their dtype, so only the weights are rounded.
    A weight shared with an embedding (a tied LM head) is left as it is, so the residual stream keeps its dtype."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, Linear) and id(module.weight) not in embedding_weights:
            module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
    return model


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b as a multiply and a sum over the input dimension: x (..., d_in), weight (d_out, d_in)."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias


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
        x = x.to(torch.promote_types(dtype, torch.float32))  # half/bfloat16 up to float32; float64 stays exact
        # torch's fused kernel: one pass where pow, mean, add, rsqrt and mul took five (2.8x faster forward and
        # backward at the speedrun's shape on a CPU, the same numbers; benchmarks/README.md, "CPU speedrun")
        out = self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps).to(dtype)
        if not (self.hook_scale.has_hooks or self.hook_normalized.has_hooks):
            return out
        normalized = _hooked_norm(self, x, (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return out if normalized is None else self.weight * normalized.to(dtype)


def _hooked_norm(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """Run hook_scale and hook_normalized (= x / scale) of a norm; the normalized input if a hook replaced
    either, else None (the caller keeps its fast result, so reading a norm's hooks never changes a number)."""
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
}


class MLP(nn.Module):
    """Position-wise feed-forward: W_out · act(W_in · x), or W_out · (silu(W_gate · x) ⊙ W_in · x) for SwiGLU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gated = config.mlp == "swiglu"
        self.act = _ACTIVATIONS[config.mlp]
        self.W_in = Linear(config.d_model, config.mlp_dim, bias=config.bias)
        self.W_gate = Linear(config.d_model, config.mlp_dim, bias=config.bias) if self.gated else None
        self.W_out = Linear(config.mlp_dim, config.d_model, bias=config.bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            post = self.act(self.hook_pre(self.W_gate(x))) * self.W_in(x)
        else:
            post = self.act(self.hook_pre(self.W_in(x)))
        return self.W_out(self.hook_post(post))
