"""The fast layers that generation swaps into a model: products of a few rows through attnlab's C
kernel or, compiled, a fused multiply-and-sum; weights in 8 bits; weights stored narrower than the
activations.

Design choices:
- The model's `Linear` is F.linear and nothing else. `fast_linears(model)` turns its Linear modules
  into `KernelLinear` for as long as generation runs (the same modules, weights and hooks: only
  their class changes, and changes back), so no layer chooses a fast path itself.
- A forward pass that needs no gradients (torch.no_grad, inference_mode), of float32 on the CPU and
  of at least TILES_MIN_ROWS rows, runs with its Linear, Attention, RMSNorm and MLP modules swapped
  too (`inference_layers`, which Transformer.forward enters): run_with_cache, patching sweeps and
  plain forwards get generation's RoPE, RMSNorm and SwiGLU kernels where no hook reads inside
  them; products on AMX's tiles at float32's accuracy where the CPU and the OS allow them
  (kernels.float_products: a layer's q, k and v, and its gate and up, with x split once), and
  then also the attention's q Kᵀ and pattern V where hooks read the pattern, RMSNorm with the
  scale and normalized input its hooks read, and SwiGLU's product beside a hooked gate, in C
  (where every hook on the scores and pattern, or on the gate, only reads, `lens.hooks.reads`:
  run_with_cache's own, the attention's three steps in one call a layer, and SwiGLU's product
  from the call that makes gate and up, bit for bit the separate steps; a hook that may edit
  keeps them apart, and one line says so); else, where it
  measured faster than torch's (MKL's) GEMM on this machine (kernels.float_rows),
  decode.c's tiled float32 GEMM and the attention in C (with the pattern in three steps, the
  hooks between them); elsewhere torch's products and attention, the explicit path's T x T
  steps in place (the fewest tensors, the module path's numbers bit for bit). Block layers
  keep their module path there (their prompt product rounds activations to 8 bits). Where the
  kernels cannot run, `inference_kernels_unusable()` says why, and so does one line, once per
  process (attnlab.slower).
- ggml's blocks (`quantize(model, "q4_0" | "q4_1" | "q8_0")`, attnlab.generate.blocks): 32
  weights per block with their own scale, as llama.cpp stores them.
- Weights in 8 bits (`quantize(model, "int8")`): each output feature's row w is stored as q =
round(w / s) in
  int8 with s = max|w| / 127, one float32 scale per row (gpt-fast's int8 weight-only scheme;
  llama.cpp's Q8_0
  keeps one scale per block of 32 instead). Activations stay float32: y = (x qᵀ) ⊙ s + b. `quantize`
  swaps
  `Int8Linear` in for every Linear, for good: the model remembers it, and is saved that way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .. import slower
from ..errors import UserError
from ..memory import new_tensor
from ..model.attention import Attention, causal_mask, expand_kv
from ..model.layers import MLP, Linear, RMSNorm
from . import kernels
from .blocks import BLOCK, BLOCK_TYPES, QUANTIZABLE, BlockLinear

# up to this many rows a few-row product beat BLAS (benchmarks/README.md, "Figures behind the
# code"): the compiled multiply-and-sum form and the C kernel (attnlab.generate.kernels), in
# KernelLinear and the kernel decode step alike
MATVEC_MAX_ROWS = 8
# the block kinds decode.c's prompt products unpack (kernels.ROWS_KINDS); Q6_K multiplies a prompt
# through the C dequantizer and F.linear
PROMPT_KINDS = tuple(k for k, t in BLOCK_TYPES.items() if t.kernel in kernels.ROWS_KINDS)


# from this many rows, and this many multiply-adds, the tiled float32 GEMM (kernels.linear_rows)
# beat torch's F.linear on every shape measured (benchmarks/README.md, "Interpretability at speed");
# below, the tiles' layout of the weights costs more than the product saves
TILES_MIN_ROWS = 64
TILES_MIN_MACS = 1 << 20


def few_rows(x: torch.Tensor) -> bool:
    return x.shape[:-1].numel() <= MATVEC_MAX_ROWS


def tile_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Enough rows (and arithmetic) for the tiled float32 GEMM to beat F.linear."""
    rows = x.shape[:-1].numel()
    return rows >= TILES_MIN_ROWS and rows * weight.shape[0] * weight.shape[1] >= TILES_MIN_MACS


def kernel_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Few rows of the width the weight takes: a wrong width goes on to F.linear, whose error names
    both shapes."""
    return few_rows(x) and x.shape[-1] == weight.shape[-1]


class KernelLinear(Linear):
    """Linear (y = x Wᵀ + b), with two fast paths for a few rows (decoding a batch of up to
    MATVEC_MAX_ROWS sequences), whose weights come from main memory at every token: eager, float32
    on a CPU, the C kernel of attnlab.generate.kernels, which streams each weight row once; inside a
    compiled graph, a row-wise multiply and sum, which inductor turns into one vectorised loop. Both
    run faster than the BLAS call (benchmarks/README.md, "Generation speed"). From TILES_MIN_ROWS
    rows (a prompt, a batch of sequences) the product kernels.float_products chooses: AMX's tiles
    at float32's accuracy where the CPU and the OS allow them, else the tiled float32 GEMM in C
    where this build runs it on AVX-512 and it measured faster than torch's; everything else takes
    F.linear, and tests/test_fast_paths.py and tests/test_kernels.py hold them to its numbers.
    The weight may be stored narrower than the activations (`store_weights_as`): it is widened where
    it is used, which a compiled graph fuses into the same loop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
            return matvec(x, weight, self.bias) if few_rows(x) else F.linear(x, weight, self.bias)
        if (
            x.dtype == self.weight.dtype == torch.float32
            and kernel_rows(x, self.weight)
            and kernels.usable(x, self.weight)
        ):
            return kernels.linear(x, self.weight, self.bias)
        if (
            x.dtype == self.weight.dtype == torch.float32
            and x.shape[-1] == self.weight.shape[-1]
            and self.weight.is_contiguous()
            and tile_rows(x, self.weight)
            and kernels.usable(x, self.weight, *([] if self.bias is None else [self.bias]))
        ):  # many rows: AMX's tiles where allowed, else the tiled float32 GEMM where it measured
            # faster than torch's (MKL's) here
            product = kernels.float_products()
            if product == "amx":
                return kernels.linear_amx(x, self.weight, self.bias)
            if product == "c":
                return kernels.linear_rows(x, self.weight, self.bias)
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.linear(x, weight, self.bias)


class KernelBlockLinear(BlockLinear):
    """BlockLinear with generation's fast paths (eager, float32, on a CPU): a few rows multiply the
    blocks in C with 8-bit activations (decode.c, attnlab_linear_q: the decode step's product);
    more rows (a prompt) of the kinds in PROMPT_KINDS take the tiled GEMM with the same 8-bit
    activations (attnlab_linear_q_rows) where this build runs it on AVX-512 VNNI, else the tiled
    float32 GEMM on dequantized tiles where it has AVX-512; anything else dequantizes in C and runs
    F.linear (the module path's numbers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.compiler.is_compiling()
            or x.dtype != torch.float32
            or x.shape[-1] != self.in_features
            or not kernels.usable(x, self.blocks)
        ):
            return super().forward(x)
        kind = BLOCK_TYPES[self.kind].kernel
        if few_rows(x):
            return kernels.block_linear(x, self.blocks, kind, self.bias)
        eight_bits = kernels.rows_vectorized()[0]  # (the float32 choice only measured without it)
        if self.kind in PROMPT_KINDS and (eight_bits or kernels.float_rows()):
            activations = "8-bit" if eight_bits else "float32"
            return kernels.block_linear_rows(x, self.blocks, kind, self.bias, activations)
        return F.linear(x, kernels.dequantize(self.blocks, kind, self.in_features), self.bias)


def prompt_rows(x: torch.Tensor, *modules: nn.Module) -> bool:
    """A prompt's activations (more than MATVEC_MAX_ROWS rows, eager, float32, where the C kernels
    run) for modules that no torch hook watches: the prompt kernels that replace several PyTorch
    calls at once (one rounding of x for q, k, v; RoPE, RMSNorm, SwiGLU in C) may skip no hook."""
    return (
        not torch.compiler.is_compiling()
        and x.dtype == torch.float32
        and not few_rows(x)
        and kernels.usable(x)
        and not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
    )


def shared_rounding(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether `linears` (taking x) may multiply a prompt with one 8-bit rounding of x
    (kernels.block_linear_rows_many): all blocks of PROMPT_KINDS, in generation's fast layers, on a
    build whose 8-bit prompt product is vectorised."""
    return (
        all(
            type(m) is KernelBlockLinear and m.kind in PROMPT_KINDS and m.in_features == x.shape[-1]
            for m in linears
        )
        and prompt_rows(x, *linears)
        and kernels.usable(*(m.blocks for m in linears))
        and kernels.rows_vectorized()[0]
    )


def multiply_sharing_rounding(x: torch.Tensor, *linears: KernelBlockLinear) -> list[torch.Tensor]:
    """[m(x) for m in linears] as the tiled 8-bit GEMM computes each, x rounded once."""
    return kernels.block_linear_rows_many(
        x, [(m.blocks, BLOCK_TYPES[m.kind].kernel, m.bias) for m in linears]
    )


def amx_together(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether `linears` (taking x) multiply x in one AMX call, x split once for all of them
    (kernels.linear_amx_many: each product `linear_amx`'s, bit for bit): float32 KernelLinear
    modules that no torch hook watches, each with enough rows for the tiles, where
    kernels.float_products chose AMX."""
    return (
        not torch.compiler.is_compiling()
        and x.dtype == torch.float32
        and all(
            type(m) is KernelLinear
            and m.weight.dtype == torch.float32
            and m.weight.is_contiguous()
            and m.in_features == x.shape[-1]
            and tile_rows(x, m.weight)
            and not (m._forward_hooks or m._forward_pre_hooks)
            for m in linears
        )
        and kernels.usable(x, *(p for m in linears for p in (m.weight, m.bias) if p is not None))
        and kernels.float_products() == "amx"
    )


def multiply_together(x: torch.Tensor, *linears: KernelLinear) -> list[torch.Tensor]:
    """[m(x) for m in linears] on AMX tiles, x split once (`amx_together`)."""
    return kernels.linear_amx_many(x, [(m.weight, m.bias) for m in linears])


class KernelRMSNorm(RMSNorm):
    """RMSNorm with generation's fast path for a prompt: decode.c's RMSNorm (the decode step's),
    the rows shared by the threads; where hooks read its scale and normalized input
    (run_with_cache) and the products are not torch's (kernels.float_products; with torch's, the
    module path's numbers bit for bit), those two from the same C pass, handed to the hooks as
    RMSNorm hands its own (`_hooked_norm`: a hook that replaces either, or edits the scale in
    place, gets the module path's steps after it); everything else as RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (
            not torch.compiler.is_compiling()
            and self.weight.dtype == torch.float32
            and x.shape[-1] == self.weight.shape[0]
            and kernels.usable(self.weight)
        ):
            return super().forward(x)
        if prompt_rows(x, self.hook_scale, self.hook_normalized):
            return kernels.rms_norm_rows(x, self.weight, self.eps)
        if prompt_rows(x) and kernels.float_products() != "torch":  # (torch's: its numbers)
            out, scale, normalized = kernels.rms_norm_parts_rows(x, self.weight, self.eps)
            version = scale._version
            hooked_scale = self.hook_scale(scale)
            if hooked_scale is not scale or scale._version != version:
                normalized = x / hooked_scale  # RMSNorm's normalized input from the hook's scale
            hooked = self.hook_normalized(normalized)
            return out if hooked is normalized and hooked_scale is scale else self.weight * hooked
        return super().forward(x)


class KernelMLP(MLP):
    """MLP with generation's fast path for a SwiGLU prompt that no hook reads inside: the gate and
    up products share one rounding of x where both are blocks (`shared_rounding`) or go through
    one AMX call (`amx_together`), and silu(gate) · up runs in C (decode.c's, the decode step's);
    where hooks read the gate and the product (run_with_cache), the product in C into up, which
    no one holds, or, on AMX tiles with a gate hook that only reads, from the same call as gate
    and up (kernels.swiglu_amx), unless the products are torch's (then MLP's steps, its numbers
    bit for bit); everything else as MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (
            self.gated
            and self.act is F.silu
            # silu(gate) · up is written over gate: no hook may hold it
            and prompt_rows(x, self.hook_pre, self.hook_post, self.W_gate, self.W_in)
        ):
            if self.gated and in_place():
                # MLP.forward's steps, act(gate) · up written over act(gate), which no one holds
                # yet: its numbers bit for bit, one [rows, d_mlp] tensor fewer (run_with_cache);
                # gate and up in one AMX call where it runs
                fused = (
                    self.act is F.silu
                    and self.W_gate.bias is None
                    and self.W_in.bias is None
                    and amx_together(x, self.W_gate, self.W_in)
                )
                if fused and self.hook_pre.only_read:
                    # a gate hook that only reads (run_with_cache's): silu(gate) · up from the
                    # tiles' blocks, in the same C call, bit for bit
                    gate, post = kernels.swiglu_amx(x, self.W_gate.weight, self.W_in.weight)
                    self.hook_pre(gate)
                    return self.W_out(self.hook_post(post))
                if fused:
                    say_editing_hook("SwiGLU's gate and silu(gate) · up", "an MLP's hook_pre")
                if amx_together(x, self.W_gate, self.W_in):
                    gate, up = multiply_together(x, self.W_gate, self.W_in)
                    gate = self.hook_pre(gate)
                else:
                    gate, up = self.hook_pre(self.W_gate(x)), None
                up = self.W_in(x) if up is None else up
                if (
                    self.act is F.silu
                    and gate.shape == up.shape
                    and gate.dtype == up.dtype == torch.float32
                    and gate.is_contiguous()
                    and up.is_contiguous()
                    and prompt_rows(x, self.W_in)
                    and kernels.float_products() != "torch"
                ):  # silu(gate) · up in C, into up (no one holds it), the gate left to its hook;
                    # with torch's products, torch's steps: the module path's numbers bit for bit
                    return self.W_out(self.hook_post(kernels.silu_mul_up_rows(gate, up)))
                act = self.act(gate)
                post = act.mul_(up) if act is not gate else act * up
                return self.W_out(self.hook_post(post))
            return super().forward(x)
        if shared_rounding(x, self.W_gate, self.W_in):
            gate, up = multiply_sharing_rounding(x, self.W_gate, self.W_in)
        elif amx_together(x, self.W_gate, self.W_in):
            gate, up = multiply_together(x, self.W_gate, self.W_in)
        else:
            gate, up = self.W_gate(x), self.W_in(x)
        if not (gate.is_contiguous() and up.is_contiguous() and gate.dtype == torch.float32):
            return self.W_out(F.silu(gate) * up)
        return self.W_out(kernels.silu_mul_rows(gate, up))


def say_editing_hook(steps: str, points: str) -> None:
    """One line (attnlab.slower): a hook at `points` that may edit (not marked
    attnlab.lens.hooks.reads) keeps `steps` apart, where AMX's tiles compute them in one C call
    under hooks that only read."""
    slower.say(
        f"forward passes compute {steps} in separate steps",
        "in one C call on AMX tiles",
        f"a hook at {points} may edit them (a hook that only reads says so with "
        "attnlab.lens.hooks.reads)",
    )


def in_place() -> bool:
    """Whether a fast path may write into a tensor it made before handing it on: no autograd graph
    that could need its first value (gradients off), not compiling."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class KernelAttention(Attention):
    """Attention with generation's fast paths for a prompt (eager, float32, on a CPU): W_Q, W_K and
    W_V of blocks share one rounding of x (`shared_rounding`); RoPE in C, out of place (decode.c,
    attnlab_rope_rows: apply_rope's numbers bit for bit); and, where this build of the kernels has
    AVX-512, causal attention over the whole prompt from position 0, without mask or dropout, and
    without a window or with one no shorter than the prompt, in C (decode.c, attnlab_attend_rows);
    everything else as Attention. When a hook wants the scores or the pattern (run_with_cache),
    the same prompts take the explicit path's three steps in C (attnlab_attend_scores,
    _softmax_rows, _attend_mix), the hooks between them as in Attention.forward; where the products
    take AMX's tiles (kernels.float_products), q Kᵀ and pattern V on them and the softmax in C,
    all three in one call where the hooks between them only read (kernels.attend_explicit);
    where torch's GEMM is the faster and AMX cannot run, torch's steps, with the scores scaled and
    masked in place and the softmax's all-masked guard only where a row needs it (Attention's
    numbers bit for bit)."""

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if shared_rounding(x, self.W_Q, self.W_K, self.W_V):
            q, k, v = multiply_sharing_rounding(x, self.W_Q, self.W_K, self.W_V)
            return q, k, v
        if amx_together(x, self.W_Q, self.W_K, self.W_V):
            q, k, v = multiply_together(x, self.W_Q, self.W_K, self.W_V)
            return q, k, v
        return super().project(x)

    def rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rope
        if (
            prompt_rows(x)
            and x.dim() == 4
            and cos.shape == sin.shape == (*x.shape[:2], 1, cos.shape[-1])
            and cos.dtype == sin.dtype == torch.float32
            and cos.shape[-1] % 2 == 0
            and cos.shape[-1] <= x.shape[-1]
            and kernels.usable(cos, sin)
        ):
            return kernels.rope_rows(x, cos, sin)
        return super().rotate(x, rope)

    def prompt(self, q, k, *, mask, dropout_p, window, amx: bool = False) -> bool:
        """A prompt from position 0 the kernels take: causal, the queries are every key, no mask,
        dropout or window it outgrows, float32 on the CPU, no gradients, a vectorised build whose
        float32 tiles measured faster than torch's GEMM (`amx`: where the products take AMX's
        tiles, kernels.float_products)."""
        return (
            self.config.causal
            and mask is None
            and (window is None or window >= q.shape[-2])  # a window the prompt never outgrows
            and dropout_p == 0
            and q.dim() == 4
            and q.shape[-2] == k.shape[-2]  # the queries are every key: a prompt from position 0
            and q.dtype == k.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and kernels.usable(q, k)
            and (kernels.float_products() == "amx" if amx else kernels.float_rows())
        )

    def attend(self, q, k, v, *, mask, dropout_p, window):
        if (
            q.shape[-1] % 32 == 0
            and v.dtype == torch.float32
            and self.prompt(q, k, mask=mask, dropout_p=dropout_p, window=window)
            and kernels.usable(v)
        ):
            return kernels.attend_rows(q, k, v, self.config.scale)
        return super().attend(q, k, v, mask=mask, dropout_p=dropout_p, window=window)

    def attend_explicit(self, q, k, v, *, mask, dropout_p, window):
        if (
            v.dtype == torch.float32
            and v.shape == k.shape
            and self.prompt(q, k, mask=mask, dropout_p=dropout_p, window=window, amx=True)
            and kernels.usable(v)
        ):
            if self.hook_attn_scores.only_read and self.hook_pattern.only_read:
                # hooks that only read (run_with_cache's): the three steps in one C call, bit for
                # bit
                scores, pattern, z = kernels.attend_explicit(q, k, v, self.config.scale)
                self.hook_attn_scores(scores)
                self.hook_pattern(pattern)
                return z
            say_editing_hook(
                "the attention's scores, pattern and z", "hook_attn_scores or hook_pattern"
            )
        return super().attend_explicit(q, k, v, mask=mask, dropout_p=dropout_p, window=window)

    def score(self, q, k, *, mask, window):
        if self.prompt(q, k, mask=mask, dropout_p=0.0, window=window, amx=True):
            return kernels.attend_scores(q, k, self.config.scale, amx=True)
        if self.prompt(q, k, mask=mask, dropout_p=0.0, window=window):
            return kernels.attend_scores(q, k, self.config.scale)
        if self.config.causal and mask is None and in_place():
            # Attention.score's product, scale and causal mask (attention_scores, apply_mask) in one
            # tensor, the last two in place: its numbers bit for bit, two T x T copies fewer (where
            # torch's GEMM is the faster one, run_with_cache's path: benchmarks/README.md, issue 25)
            scores = torch.matmul(q, expand_kv(q, k).transpose(-2, -1)).mul_(self.config.scale)
            T, S = scores.shape[-2:]
            hidden = ~causal_mask(T, S, scores.device, window=window)
            return scores.masked_fill_(hidden, float("-inf"))
        return super().score(q, k, mask=mask, window=window)

    def weigh(self, scores):
        if (
            scores.dtype == torch.float32
            and scores.shape[-1] > 0
            and not torch.compiler.is_compiling()
            and kernels.usable(scores)
            and (kernels.float_rows() or kernels.float_products() == "amx")
        ):
            # with AMX's products too: its numbers are not torch's bit for bit anyway, and the C
            # pass saves torch's all-masked guard (run_with_cache 1.5-5 %, benchmarks/README.md)
            return kernels.softmax_rows(scores)
        if scores.shape[-1] > 0 and in_place():
            # attention_pattern's guard changes nothing where every row sees a key (its two
            # masked_fill copies then equal the scores and the softmax): the softmax alone, bit for
            # bit; a row with every key masked (a hook may have made one) takes the reference
            if not torch.isneginf(scores.amax(dim=-1)).any():
                return torch.softmax(scores, dim=-1, out=new_tensor(*scores.shape))
        return super().weigh(scores)

    def mix(self, pattern, v):
        if (
            pattern.dim() == v.dim() == 4
            and pattern.shape[-1] == v.shape[-2]
            and pattern.shape[0] == v.shape[0]
            and pattern.shape[1] % v.shape[1] == 0
            and pattern.dtype == v.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and kernels.usable(pattern, v)
        ):
            if kernels.float_products() == "amx":
                return kernels.attend_mix(pattern, v, amx=True)
            if v.shape[-1] % 32 == 0 and kernels.float_rows():
                return kernels.attend_mix(pattern, v)
        return super().mix(pattern, v)


@contextlib.contextmanager
def fast_linears(model: nn.Module, blocks: bool = True) -> Iterator[nn.Module]:
    """Within the block, the model's Linear modules are KernelLinear, its BlockLinear modules
    KernelBlockLinear (unless `blocks` is False), its Attention modules KernelAttention, its RMSNorm
    modules KernelRMSNorm and its MLP modules KernelMLP (class swapped in place, then back).
    Modules already swapped stay as they are, and are left so."""
    fast = {
        Linear: KernelLinear,
        Attention: KernelAttention,
        RMSNorm: KernelRMSNorm,
        MLP: KernelMLP,
    }
    if blocks:
        fast[BlockLinear] = KernelBlockLinear
    swapped = [(m, type(m)) for m in model.modules() if type(m) in fast]
    for module, cls in swapped:
        module.__class__ = fast[cls]
    try:
        yield model
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def inference_kernels_unusable() -> str | None:
    """Why a forward pass without gradients cannot take the C kernels here (None: it can): no
    kernels (no compiler, a build that failed its self-check, ATTNLAB_KERNELS=0), or a build whose
    float32 tiles are not vectorised (AVX2 and portable builds, where torch's GEMM is kept)."""
    why = kernels.unavailable()
    if why is not None:
        return f"attnlab's C kernels are off ({why})"
    if not kernels.rows_vectorized()[1]:
        return f"the {kernels.variant()} build of the kernels has no vectorised float32 tiles"
    return None


HOOKED_PASSES = "run_with_cache and other hooked forward passes run torch's modules"


def _hooked(model: nn.Module) -> bool:
    """Whether a hook is attached at any of the model's hook points (attnlab.lens)."""
    return any(point.has_hooks for point in getattr(model, "hook_dict", {}).values())


def inference_layers(model: nn.Module, resid: torch.Tensor) -> contextlib.AbstractContextManager:
    """What Transformer.forward runs its blocks and LM head in: `fast_linears(model, blocks=False)`
    for a pass that needs no gradients (torch.no_grad or inference_mode), outside a compiled graph,
    whose residual stream `resid` [batch, pos, d_model] is float32 on the CPU with at least
    TILES_MIN_ROWS rows, where `inference_kernels_unusable()` has no objection; else nothing
    changes. Each swapped module still checks its own inputs and falls back to its module path."""
    if (
        torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or resid.dtype != torch.float32
        or resid.device.type != "cpu"
        or resid.shape[:-1].numel() < TILES_MIN_ROWS
    ):
        return contextlib.nullcontext(model)
    why = inference_kernels_unusable()
    if why is not None:
        # said for hooked passes (run_with_cache, patching, the explorer), whose speed the C pass
        # is for; a plain pass (training's evaluation) takes torch's modules as it always has.
        # (No kernels at all: their own line said so.)
        if kernels.available() and _hooked(model):
            slower.say(HOOKED_PASSES, "attnlab's C kernels", why)
        return contextlib.nullcontext(model)
    return fast_linears(model, blocks=False)


class Int8Linear(nn.Module):
    """A Linear whose weight is stored in int8 with one float32 scale per output feature
    (`quantize`):
    y = (x qᵀ) ⊙ scale + b, the activations in their own dtype. A few rows on a CPU take the C
    kernel, which widens each int8 weight in registers; otherwise the int8 weight is widened and
    multiplied (in a compiled graph, inside the same multiply-and-sum loop as Linear's)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scale", torch.ones(out_features, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Round each row of `weight` (d_out, d_in) to int8 steps of max|row| / 127 (symmetric, so 0
        stays 0)."""
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
            y = (
                matvec(x, self.weight.to(x.dtype))
                if few_rows(x)
                else F.linear(x, self.weight.to(x.dtype))
            )
        elif (
            x.dtype == torch.float32
            and kernel_rows(x, self.weight)
            and kernels.usable(x, self.weight)
        ):
            return kernels.linear(x, self.weight, self.bias, self.scale)
        else:
            y = F.linear(x, self.weight.to(x.dtype))
        y = y * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, int8"
        )


QUANTIZATIONS = ("int8", *QUANTIZABLE)


def quantize(model: nn.Module, scheme: str = "int8") -> nn.Module:
    """Store every Linear's weight in fewer bits, in place, for inference (weight-only: activations,
    norms, embeddings stay as they are): "int8" (Int8Linear), or ggml's blocks "q8_0", "q4_0",
    "q4_1" (attnlab.generate.blocks.BlockLinear, the bytes llama-quantize would write). A tied LM
    head gets its own copy; the token embedding it shares keeps its dtype, since a lookup reads one
    row. The model remembers it (`model.quantization`), so attnlab.save writes it that way."""
    if scheme not in QUANTIZATIONS:
        raise UserError(
            f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    current = getattr(model, "quantization", None)
    if current == scheme:
        return model
    if current is not None:
        raise UserError(
            f"this model is already quantized ({current}); quantize its float original to "
            f"{scheme} instead (rounding rounded weights again loses more)"
        )
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if scheme in QUANTIZABLE:  # every row must divide into blocks, checked before any change
        for parent, name, child in linears:
            if child.in_features % BLOCK:
                raise UserError(
                    f"{scheme}: a Linear ({name}) takes {child.in_features} inputs, not a multiple "
                    f"of the block size {BLOCK}; use int8 for this model"
                )
    for parent, name, child in linears:
        if scheme == "int8":
            setattr(parent, name, Int8Linear.from_float(child.weight, child.bias))
        else:
            setattr(parent, name, BlockLinear.from_float(child.weight, scheme, child.bias))
    model.quantization = scheme
    return model


def store_weights_as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store every Linear's weight matrix in `dtype` (bfloat16: half the bytes a decode step reads),
    in place, for inference; activations, norms, embeddings and biases keep their dtype, so only the
    weights are rounded. A weight shared with an embedding (a tied LM head) is left as it is, so the
    residual stream keeps its dtype."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, Linear) and id(module.weight) not in embedding_weights:
            module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
    return model


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b as a multiply and a sum over the input dimension: x (..., d_in), weight (d_out,
    d_in)."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias
