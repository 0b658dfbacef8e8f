"""The fast layers that the code wanting them swaps into a model: products of a few rows through
attnlab's C kernels or, compiled, a fused multiply-and-sum; prompts and other many-row passes on
tiled products, with RoPE, RMSNorm, SwiGLU and attention in C.

Design choices:
- The model's layers are their equations and nothing else (attnlab.model, attnlab.quant). Each
  fast layer here is a subclass of one (KernelLinear of Linear, KernelInt8Linear of Int8Linear,
  KernelBlockLinear of BlockLinear, KernelAttention, KernelRMSNorm, KernelMLP) and is swapped in
  by class for as long as a caller runs (`swapped`: the same modules, weights and hooks, the class
  changed and changed back), so no layer chooses a fast path itself.
- `fast_linears(model)`: generation's swap, for its whole run (prompt and decode steps).
- `inference_layers(model, input, start_at_layer)`: the swap a forward pass without gradients
  enters, decided before the pass from the residual stream it will run on (`residual_stream`):
  float32 on the CPU with at least TILES_MIN_ROWS rows, where `inference_kernels_unusable()` has
  no objection, its blocks and LM head run in the fast layers; otherwise only int8 weights take
  their C product. run_with_cache (attnlab.workbench), the patching sweeps, the explorer and
  training's evaluation enter it explicitly.
- A few rows (up to MATVEC_MAX_ROWS: decoding a small batch): y = x Wᵀ + b streams each weight row
  once, in C (eager) or as a multiply-and-sum loop (compiled), since the weights come from memory
  at every token and a BLAS call pays for a shape it does not have.
- Many rows (a prompt): the products `kernels.float_products()` chose for this machine: AMX's
  tiles at float32's accuracy where the CPU and the OS allow them, tiles_f32.c's tiled float32 GEMM
  where it is the faster, else torch's GEMM. Products that take the same input share one pass over
  it: q, k and v, gate and up (x split once for AMX, rounded once to 8 bits for blocks).
- Where hooks only read (`attnlab.lens.hooks.reads`, run_with_cache's), steps the hooks sit between
  may run in one C call (q Kᵀ, softmax and pattern V; gate, up and silu(gate) · up; RMSNorm's scale
  and normalized input) and hand the hooks the same tensors, bit for bit; a hook that may edit
  keeps the steps apart, and one line says so.
- Where torch's products are kept, the explicit attention's T x T steps run in place: Attention's
  numbers bit for bit, fewer tensors.
- Block layers keep their module path in forward passes without gradients (their prompt product
  rounds activations to 8 bits); generation multiplies the blocks themselves.
- Where the kernels cannot run, `inference_kernels_unusable()` says why, and so does one line,
  once per process (attnlab.slower).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .. import slower
from ..memory import new_tensor
from ..model.attention import Attention, causal_mask, expand_kv, soft_cap
from ..model.layers import MLP, Linear, RMSNorm
from ..quant.blocks import BLOCK_TYPES, BlockLinear
from ..quant.int8 import Int8Linear
from . import kernels

# up to this many rows a few-row product beat BLAS (benchmarks/README.md, "Figures behind the
# code"): the compiled multiply-and-sum form and the C kernel (attnlab.generate.kernels), in
# KernelLinear and the kernel decode step alike
MATVEC_MAX_ROWS = 8
# the block kinds tiles_q8.c's prompt products unpack (kernels.ROWS_KINDS); Q6_K multiplies a prompt
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
    where this build vectorises it (AVX-512, AVX2) and it measured faster than torch's; everything
    else takes F.linear, and tests/test_fast_paths.py and tests/test_kernels.py hold them to its
    numbers.
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
    blocks in C with 8-bit activations (c/linear_q.c, attnlab_linear_q: the decode step's product);
    more rows (a prompt) of the kinds in PROMPT_KINDS take the tiled GEMM with the same 8-bit
    activations (attnlab_linear_q_rows) where this build runs it on AVX-512 VNNI, else the tiled
    float32 GEMM on dequantized tiles where it has them vectorised (kernels.float_rows); anything
    else dequantizes in C and runs
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
            return kernels.block_linear(x, self.blocks, kind, self.bias, repacked=self.interleaved)
        eight_bits = kernels.rows_vectorized()[0]  # (the float32 choice only measured without it)
        # the prompt products read the file's layout (a matrix at a time where interleaved)
        if self.kind in PROMPT_KINDS and (eight_bits or kernels.float_rows()):
            activations = "8-bit" if eight_bits else "float32"
            return kernels.block_linear_rows(x, self.file_blocks(), kind, self.bias, activations)
        # (the C dequantizer's values are the reference's, bit for bit)
        return self.linear_by_slices(
            x, lambda rows: kernels.dequantize(rows, kind, self.in_features)
        )


class KernelInt8Linear(Int8Linear):
    """Int8Linear (y = (x qᵀ) ⊙ scale + b) with generation's fast paths for a few rows: eager,
    float32, on a CPU, the C kernel of attnlab.generate.kernels, which widens each int8 weight in
    registers and streams each row once; inside a compiled graph, the widened weight in the same
    multiply-and-sum loop as KernelLinear's; everything else as Int8Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and few_rows(x):
            return self.scaled(matvec(x, self.weight.to(x.dtype)))
        if (
            not torch.compiler.is_compiling()
            and x.dtype == torch.float32
            and kernel_rows(x, self.weight)
            and kernels.usable(x, self.weight)
        ):
            return kernels.linear(x, self.weight, self.bias, self.scale)
        return super().forward(x)


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
        x, [(m.file_blocks(), BLOCK_TYPES[m.kind].kernel, m.bias) for m in linears]
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
    """RMSNorm with generation's fast path for a prompt: c/ops.c's RMSNorm (the decode step's),
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
    one AMX call (`amx_together`), and silu(gate) · up runs in C (c/ops.c's, the decode step's);
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


def say_editing_hook(steps: str, points: str, tiles: str = "AMX tiles") -> None:
    """One line (attnlab.slower): a hook at `points` that may edit (not marked
    attnlab.lens.hooks.reads) keeps `steps` apart, where `tiles` (AMX's, or the float32 tiles of
    the C kernels) compute them in one C call under hooks that only read."""
    slower.say(
        f"forward passes compute {steps} in separate steps",
        f"in one C call on {tiles}",
        f"a hook at {points} may edit them (a hook that only reads says so with "
        "attnlab.lens.hooks.reads)",
    )


def in_place() -> bool:
    """Whether a fast path may write into a tensor it made before handing it on: no autograd graph
    that could need its first value (gradients off), not compiling."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class KernelAttention(Attention):
    """Attention with generation's fast paths for a prompt (eager, float32, on a CPU): W_Q, W_K and
    W_V of blocks share one rounding of x (`shared_rounding`); RoPE in C, out of place (c/ops.c,
    attnlab_rope_rows: apply_rope's numbers bit for bit); and, where this build of the kernels
    vectorises its float32 tiles (AVX-512, AVX2) and they measured faster than torch's GEMM
    (kernels.float_rows), causal attention over the whole prompt from position 0, without mask or
    dropout, its scores soft-capped where the model caps them (Gemma 2), and without a window or
    with one no shorter than the prompt, in C (attnlab_attend_rows); everything else as Attention.
    When a hook wants the scores or the pattern (run_with_cache), the same prompts take the explicit
    path's three steps in C (attnlab_attend_scores, _softmax_rows, _attend_mix) where they measured
    faster than torch's steps (kernels.attention_rows), the hooks between them as in
    Attention.forward; where the products take AMX's tiles (kernels.float_products), q Kᵀ and
    pattern V on them and the softmax in C, all three in one call where the hooks between them only
    read (kernels.attend_explicit); where torch's steps are the faster and AMX cannot run, torch's
    steps, with the scores scaled and masked in place and the softmax's all-masked guard only where
    a row needs it (Attention's numbers bit for bit)."""

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

    def prompt(self, q, k, *, mask, dropout_p, window, path: str = "fused") -> bool:
        """A prompt from position 0 the kernels take on `path`: causal, the queries are every key,
        no mask, dropout or window it outgrows, float32 on the CPU, no gradients, and the path
        chosen for this machine: "fused" (attend_rows) where the float32 tiles measured faster
        than torch's GEMM (kernels.float_rows), "explicit" (the scores, pattern and z that hooks
        see) where the C attention measured faster than torch's steps (kernels.attention_rows),
        "amx" where the products take AMX's tiles (kernels.float_products)."""
        chosen = {
            "fused": kernels.float_rows,
            "explicit": kernels.attention_rows,
            "amx": lambda: kernels.float_products() == "amx",
        }[path]
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
            and chosen()
        )

    def attend(self, q, k, v, *, mask, dropout_p, window):
        if (
            q.shape[-1] % 32 == 0
            and v.dtype == torch.float32
            and self.prompt(q, k, mask=mask, dropout_p=dropout_p, window=window)
            and kernels.usable(v)
        ):
            return kernels.attend_rows(q, k, v, self.config.scale, self.config.attn_softcap)
        return super().attend(q, k, v, mask=mask, dropout_p=dropout_p, window=window)

    def attend_explicit(self, q, k, v, *, mask, dropout_p, window):
        if v.dtype == torch.float32 and v.shape == k.shape and kernels.usable(v):
            taken = dict(mask=mask, dropout_p=dropout_p, window=window)
            amx = self.prompt(q, k, **taken, path="amx")
            tiles = (
                not amx and q.shape[-1] % 32 == 0 and self.prompt(q, k, **taken, path="explicit")
            )
            if (amx or tiles) and self.hook_attn_scores.only_read and self.hook_pattern.only_read:
                # hooks that only read (run_with_cache's): the three steps in one C call, bit for
                # bit
                scores, pattern, z = kernels.attend_explicit(
                    q, k, v, self.config.scale, amx=amx, softcap=self.config.attn_softcap
                )
                self.hook_attn_scores(scores)
                self.hook_pattern(pattern)
                return z
            if amx or tiles:
                say_editing_hook(
                    "the attention's scores, pattern and z",
                    "hook_attn_scores or hook_pattern",
                    "AMX tiles" if amx else "the float32 tiles",
                )
        return super().attend_explicit(q, k, v, mask=mask, dropout_p=dropout_p, window=window)

    def score(self, q, k, *, mask, window):
        cap = self.config.attn_softcap
        if self.prompt(q, k, mask=mask, dropout_p=0.0, window=window, path="amx"):
            return kernels.attend_scores(q, k, self.config.scale, amx=True, softcap=cap)
        if self.prompt(q, k, mask=mask, dropout_p=0.0, window=window, path="explicit"):
            return kernels.attend_scores(q, k, self.config.scale, softcap=cap)
        if self.config.causal and mask is None and in_place():
            # Attention.score's product, scale, soft-cap and causal mask (attention_scores,
            # apply_mask) in one tensor, the scale and the mask in place: its numbers bit for bit,
            # two T x T copies fewer (where torch's GEMM is the faster one, run_with_cache's path:
            # benchmarks/README.md, issue 25)
            scores = torch.matmul(q, expand_kv(q, k).transpose(-2, -1)).mul_(self.config.scale)
            scores = soft_cap(scores, cap)
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
            and (kernels.attention_rows() or kernels.float_products() == "amx")
        ):
            # with AMX's products too: its numbers are not torch's bit for bit anyway, and the C
            # pass saves torch's all-masked guard (benchmarks/README.md, "Forward passes in C")
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
            if v.shape[-1] % 32 == 0 and kernels.attention_rows():
                return kernels.attend_mix(pattern, v)
        return super().mix(pattern, v)


FAST = {
    Linear: KernelLinear,
    Int8Linear: KernelInt8Linear,
    BlockLinear: KernelBlockLinear,
    Attention: KernelAttention,
    RMSNorm: KernelRMSNorm,
    MLP: KernelMLP,
}


@contextlib.contextmanager
def swapped(roots: Iterable[nn.Module], fast: dict[type, type]) -> Iterator[None]:
    """Within the block, every module under `roots` whose class is a key of `fast` has the class
    it maps to (swapped in place, then back: the same modules, weights and hooks). Modules already
    swapped stay as they are, and are left so."""
    modules = {id(m): m for root in roots for m in root.modules()}.values()
    changed = [(m, type(m)) for m in modules if type(m) in fast]
    for module, cls in changed:
        module.__class__ = fast[cls]
    try:
        yield
    finally:
        for module, cls in changed:
            module.__class__ = cls


@contextlib.contextmanager
def fast_linears(model: nn.Module, blocks: bool = True) -> Iterator[nn.Module]:
    """Within the block, the model's Linear modules are KernelLinear, its Int8Linear modules
    KernelInt8Linear, its BlockLinear modules KernelBlockLinear (unless `blocks` is False), its
    Attention modules KernelAttention, its RMSNorm modules KernelRMSNorm and its MLP modules
    KernelMLP (`swapped`)."""
    fast = FAST if blocks else {k: v for k, v in FAST.items() if k is not BlockLinear}
    with swapped([model], fast):
        yield model


def inference_kernels_unusable() -> str | None:
    """Why a forward pass without gradients cannot take the C kernels here (None: it can): no
    kernels (no compiler, a build that failed its self-check, ATTNLAB_KERNELS=0), or a build whose
    float32 tiles are not vectorised (the portable builds, where torch's GEMM is kept)."""
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


def _table_dtype(table: nn.Module) -> torch.dtype:
    """The dtype an embedding table's lookups give: its weight's, float32 for ggml blocks
    (BlockEmbedding dequantizes to float32)."""
    weight = next(table.parameters(), None)
    return torch.float32 if weight is None else weight.dtype


def residual_stream(
    model: nn.Module, input: torch.Tensor, start_at_layer: int | None = None
) -> tuple[int, torch.dtype, torch.device]:
    """(rows, dtype, device) of the residual stream that `model(input, start_at_layer=...)` runs
    its blocks on, known before the pass: with start_at_layer, the input's own; else batch x
    positions of the ids (B, T) or (T,), on their device, in the dtype of the token embedding's
    lookups promoted by the learned positions and token types added to them (Transformer.
    embed_tokens: scaling by √d_model, sinusoidal positions and the embedding norm keep it)."""
    if start_at_layer is not None:
        return input.shape[:-1].numel(), input.dtype, input.device
    dtype = _table_dtype(model.embed)
    for table in (model.pos_embed, model.token_type_embed):
        if table is not None:
            dtype = torch.promote_types(dtype, _table_dtype(table))
    return input.numel(), dtype, input.device


def many_rows(rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """A residual stream the C kernels' prompt paths take: float32 on the CPU, at least
    TILES_MIN_ROWS rows."""
    return dtype == torch.float32 and device.type == "cpu" and rows >= TILES_MIN_ROWS


def inference_layers(
    model: nn.Module, input: torch.Tensor, start_at_layer: int | None = None
) -> contextlib.AbstractContextManager:
    """What the code that wants the C kernels runs a forward pass `model(input, start_at_layer=...)`
    in (run_with_cache, patching sweeps, the explorer, training's evaluation), entered before the
    pass. Only for a pass that needs no gradients (torch.no_grad or inference_mode), outside a
    compiled graph; else nothing changes. Its residual stream (`residual_stream`) float32 on the
    CPU with at least TILES_MIN_ROWS rows, where `inference_kernels_unusable()` has no objection:
    the blocks and the LM head run in `fast_linears(blocks=False)` (the embeddings as they are).
    Otherwise only Int8Linear modules become KernelInt8Linear (a few rows in C). Each swapped module
    still checks its own inputs and falls back to its module path."""
    if (
        torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or not isinstance(input, torch.Tensor)
    ):
        return contextlib.nullcontext(model)
    int8 = {Int8Linear: KernelInt8Linear}
    if not many_rows(*residual_stream(model, input, start_at_layer)):
        return swapped([model], int8)
    why = inference_kernels_unusable()
    if why is not None:
        # said for hooked passes (run_with_cache, patching, the explorer), whose speed the C pass
        # is for; a plain pass (training's evaluation) takes torch's modules as it always has.
        # (No kernels at all: their own line said so.)
        if kernels.available() and _hooked(model):
            slower.say(HOOKED_PASSES, "attnlab's C kernels", why)
        return swapped([model], int8)
    parts = [p for p in (*model.blocks, model.ln_final, model.unembed) if p is not None]
    return swapped(parts, {k: v for k, v in FAST.items() if k is not BlockLinear})


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b as a multiply and a sum over the input dimension: x (..., d_in), weight (d_out,
    d_in)."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias
