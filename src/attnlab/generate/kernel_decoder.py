"""The default decode step: `KernelDecoder` walks the model's weights itself and calls attnlab's C
loops (attnlab.generate.kernels) for the products and the attention.

No graph to build, so no set-up per process, and the whole step is one C call (one OpenMP parallel
region, its threads hot from the first product to the last) instead of the ~100 PyTorch operations
per layer of the module path, whose per-call overhead was most of a step on a small model. A hooked
model, a post-norm one, another dtype or device, or a machine without a C compiler takes the module
path, which computes the same equation (`KernelDecoder.unsupported` says why, and
`generate` says it in one line, attnlab.slower).

Gemma 3's parts run here too, from the kernels there are (and Gemma 2's, the same parts with the
attention scores soft-capped in the C attention): GeGLU as the gelu_tanh activation then
a product with W_in's output; sandwich norms as the sublayer's output written to a buffer, normed
in place and added to the residual; per-block windows as a second key mask (the window's band of
cache slots, remade by the program's first op at each step; Mistral's window too); the windowed
blocks' own RoPE table; √d_model on the embedding in the C lookup. So its step is one program too.
OLMo 2's blocks (no norm before the sublayers: the products read the residual stream itself) and
its qk-norm over the whole projection (q and k normed as one row each) run here as well.

A mixture of experts' MLP (Mixtral, Qwen2-MoE, Qwen3-MoE: attnlab.model.moe) is ops of the same
program (c/moe.c, `_moe_steps`): the router's product, then its softmax, top-k and renormalisation
into small buffers; the chosen experts' products read through a table of every expert's weights
indexed by that choice, so that a step reads k experts' weights, not n_experts' (the point of a
mixture), each multiplied by the dense step's kernel for its kind (float32, int8, every block
kind); SwiGLU's product; their outputs weighed by the router into the residual stream with
Qwen2-MoE's sigmoid-gated shared expert. A row of a batch goes through its own k experts one
product at a time.

Greedy generation runs its whole loop in C (`generate_greedy`, c/program.c's
attnlab_generate_greedy): the argmax of the logits, fed back as the next step's token, with no
Python between tokens (the Python loop around the step cost a measurable part of each token:
benchmarks/README.md, issue 25).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..model.config import GATED_MLPS
from ..model.layers import Linear
from ..model.moe import MoE
from ..quant.blocks import BLOCK_TYPES, BlockEmbedding, BlockLinear
from ..quant.int8 import Int8Linear
from . import kernels
from .fast_layers import few_rows
from .kernels import independent
from .kv_cache import KVCache

# Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K products stream their blocks in the 16-row layout
# (kernels.repack16) where this build's products are fastest in it; False: always the file's layout
# (A/B, tests)
REPACK = True


def stored_weight(linear, fill: bool = True, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor a step streams for `linear`: its blocks (in the 16-row layout where `repacked`,
    made so when `fill`, see `repacked_blocks`), or its weight."""
    if not isinstance(linear, BlockLinear):
        return linear.weight
    if repacked(linear):
        return repacked_blocks(linear, fill, shared)
    if linear.interleaved:  # a step that reads the file's layout (REPACK off): put it back
        with torch.no_grad():
            linear.blocks.copy_(linear.file_blocks())
        linear.interleaved = False
    return linear.blocks


def repacked(linear) -> bool:
    """Whether a step multiplies by `linear` (a BlockLinear) in the 16-row layout: Q8_0, Q4_0,
    Q4_1, Q5_0 and Q4_K with d_out a multiple of 16, on a build whose products of that kind are
    fastest so (kernels.repack16_fast: AVX-512 VNNI and AVX2, faster than the step on the file's
    layout, benchmarks/README.md, "The idle run on the Intel Xeon"; Q5_0 and Q4_K with AVX-512
    VNNI only, Q4_K's in "Q4_K in the 16-row layout")."""
    kind = BLOCK_TYPES[linear.kind].kernel
    return (
        REPACK
        and kind in kernels.REPACKABLE
        and linear.blocks.shape[0] % 16 == 0
        and kernels.repack16_fast(kind)
    )


def repacked_blocks(linear, fill: bool = True, shared: torch.Tensor | None = None) -> torch.Tensor:
    """`linear`'s blocks in the 16-row layout, made once, in place of the file's layout: the
    tensor keeps its memory (the decoder has moved it into 2 MB pages) and takes the repacked
    bytes, through a copy of one matrix (`interleaved`: one copy of the weights,
    attnlab.quant.blocks). `fill` False: the tensor as it is, not yet repacked. Blocks that are
    also `shared` (a tied LM head on the embedding's blocks, which lookups read in the file's
    layout) are repacked beside instead: `fill` False hands out that tensor before it is written,
    so the decoder moves it into 2 MB pages before it is backed; made again when the blocks
    change."""
    if linear.interleaved:
        return linear.blocks
    blocks, kind = linear.blocks, BLOCK_TYPES[linear.kind].kernel
    if blocks is not shared:
        if fill:
            packed = kernels.repack16(blocks, kind, linear.in_features)
            with torch.no_grad():
                blocks.copy_(packed)
            linear.interleaved = True
        return blocks
    key = (blocks.data_ptr(), blocks._version)
    kept = getattr(linear, "_attnlab_repacked", None)
    if kept is None or kept[0] != key:
        kept = linear._attnlab_repacked = (key, torch.empty_like(blocks), False)
    if fill and not kept[2]:
        kernels.repack16(blocks, kind, linear.in_features, out=kept[1])
        kept = linear._attnlab_repacked = (key, kept[1], True)
    return kept[1]


class KernelDecoder:
    """`decode_one_token` through attnlab.generate.kernels, for float32 (or int8-weight, or
    ggml-block) models on a CPU, eager. Block weights (attnlab.quant.blocks) are multiplied as
    blocks at any batch size, the activation rounded to 8 bits per block of 32 (c/linear_q.c,
    attnlab_linear_q): the logits differ from the module path's by that rounding.

    At construction the step is written down once as a list of prepared C calls on preallocated
    buffers, in the
    modules' order: the embedding; per block, norm (both norms first in a parallel block); q, k, v
    products; qk-norm; RoPE; the new key and value written to the cache and attended to; the output
    product added to the residual in place; norm; MLP; and at the end the final norm and the LM
    head. A step then copies its tokens, positions and cache slot into the buffers the calls read
    and runs the list, which begins with the embedding lookup (PyTorch's embed_tokens for sinusoids,
    token types or an embedding norm: then the step is that and a program) and reads RoPE's angles
    from a table made once: ~12 kernels per block, run as one program (kernels.program: one C call
    for the step, the threads waiting for each other only where a kernel reads what the last one
    wrote; calls marked `independent` do not), and three PyTorch copies. The cache must be
    position-major (`KVCache(values_position_minor=False)`), and `key_mask` the tensor every step
    marks.
    Returns a buffer that the next call overwrites. Batches of more than fast_layers.MATVEC_MAX_ROWS
    rows with float32 weights multiply through BLAS (torch.addmm into the same buffers).

    `keep_weights=True` gives every layer's attention call a scratch of its own, so that after a
    step all of them still hold what the attention kernel leaves there, each head's unnormalised
    weights over the keys (kernels.attend_call); `weights()` hands them out as the step's pattern
    rows, with no extra pass over the keys (the explorer's generation view, generate's `on_rows`).
    """

    def __init__(
        self,
        model,
        cache: KVCache,
        key_mask: torch.Tensor | None = None,
        keep_weights: bool = False,
    ) -> None:
        self.model, self.cache = model, cache
        self.key_mask = key_mask  # kept alive: the attention calls read it
        self.keep_weights = keep_weights
        self._allocate(cache.k[0].shape[0])
        # before any call is prepared (they bind addresses): the weights into 2 MB pages, in the
        # order read
        # a tied LM head's blocks are the embedding's, read in the file's layout (repacked_blocks)
        self.shared = getattr(model.embed, "blocks", None)
        kernels.place_in_huge_pages(
            [
                stored_weight(linear, fill=False, shared=self.shared)
                for linear in self.linears_in_step_order(model, experts=True)
            ]
        )
        steps = self._embedding_steps()
        for layer, block in enumerate(model.blocks):
            steps += self._attention_steps(layer, block)
            if block.mlp is not None:
                steps += self._mlp_steps(block)
        steps += self._head_steps()
        # consecutive kernel calls: one C call, one parallel region
        self.run = kernels.program(steps)

    def _allocate(self, B: int) -> None:
        """The buffers every call reads and writes, for a batch of B rows, and RoPE's table of
        angles."""
        model, cfg, max_len = self.model, self.model.config, self.cache.max_len
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        new = lambda *shape: torch.zeros(*shape)  # noqa: E731
        # residual stream, its norm  [batch, d_model]
        self.x, self.h = new(B, cfg.d_model), new(B, cfg.d_model)
        # a parallel MLP reads ln2(resid_pre)
        self.h_mlp = new(B, cfg.d_model) if cfg.wiring == "parallel" else self.h
        self.q, self.z = new(B, H, D), new(B, H, D)  # [batch, head, d_head]
        self.k, self.v = new(B, Hkv, D), new(B, Hkv, D)  # [batch, kv_head, d_head]
        # [layer or 1, batch, head, key slot]: the attention kernel's scratch, one per layer when
        # the weights are kept
        self.scores = new(cfg.n_layers if self.keep_weights else 1, B, H, max_len)
        self.pre, self.gate = new(B, cfg.d_mlp), new(B, cfg.d_mlp)  # [batch, d_mlp]
        # sandwich norms: a sublayer's output, normed before it joins the residual [batch, d_model]
        self.sublayer_out = new(B, cfg.d_model) if cfg.sandwich_norm else None
        # the windowed blocks' keys: key_mask and the band slot - W + 1 ... slot [batch, key slot]
        windowed = any(cfg.layer_window(i) is not None for i in range(cfg.n_layers))
        self.window_mask = torch.zeros(B, max_len, dtype=torch.bool) if windowed else None
        self.logits = new(B, cfg.d_vocab)
        if cfg.n_experts:  # a mixture of experts (_moe_steps)
            k = cfg.experts_per_token
            # the router's logits, then its scores [batch, n_experts]; each row's k experts and
            # their weights [batch, k]
            self.expert_scores = new(B, cfg.n_experts)
            self.expert_weights = new(B, k)
            self.expert_indices = torch.zeros(B, k, dtype=torch.int64)
            # each chosen expert's W_gate x, W_in x [batch, k, d_mlp] and output [batch, k, d_model]
            self.gate_k, self.pre_k = new(B, k, cfg.d_mlp), new(B, k, cfg.d_mlp)
            self.expert_out = new(B, k, cfg.d_model)
            shared = cfg.d_shared_expert  # Qwen2-MoE's shared expert: its own MLP's buffers
            self.shared_gate, self.shared_pre = new(B, shared), new(B, shared)
            self.shared_out, self.shared_logit = new(B, cfg.d_model), new(B, 1)
        self.ids = torch.zeros(B, dtype=torch.int64)  # this step's tokens
        self.position = torch.zeros(B, dtype=torch.int64)  # and their positions
        self.slot = torch.zeros(1, dtype=torch.int64)  # the cache slot this step writes
        # the angles of every position the cache can hold: [position, rotary_dim]
        if model.rotary is not None:
            # (1, max_len, 1, rotary_dim)
            cos, sin = model.rotary(torch.arange(max_len).unsqueeze(0))
            self.cos, self.sin = (
                cos.view(max_len, -1).contiguous(),
                sin.view(max_len, -1).contiguous(),
            )
        # the windowed blocks' own angles (rope_theta_local, Gemma 3)
        if model.rotary_local is not None:
            cos, sin = model.rotary_local(torch.arange(max_len).unsqueeze(0))
            self.cos_local = cos.view(max_len, -1).contiguous()
            self.sin_local = sin.view(max_len, -1).contiguous()

    def _embedding_steps(self) -> list:
        """The embedding in C when it is a lookup (+ learned positions); sinusoids, token types, a
        norm: PyTorch, in __call__."""
        model, cfg = self.model, self.model.config
        self.embed_in_c = (
            cfg.positional in ("rope", "none", "learned")
            and model.token_type_embed is None
            and model.ln_embed is None
        )
        steps = []
        if self.window_mask is not None:  # the windowed blocks' keys, remade at each step
            steps.append(
                kernels.window_mask_call(
                    self.window_mask, self.key_mask, self.slot, cfg.sliding_window
                )
            )
        # Gemma's √d_model, Granite's embedding_multiplier
        scale = (math.sqrt(cfg.d_model) if cfg.scale_embed else 1.0) * cfg.embedding_multiplier
        if isinstance(model.embed, BlockEmbedding):  # the rows of its blocks, dequantized in C
            self.embed_in_c = self.embed_in_c and cfg.positional != "learned"
            if not self.embed_in_c:
                return steps
            kind = BLOCK_TYPES[model.embed.kind].kernel
            return steps + [
                kernels.embed_blocks_call(self.ids, model.embed.blocks, kind, self.x, scale)
            ]
        if not self.embed_in_c:
            return steps
        table = model.pos_embed.weight if cfg.positional == "learned" else None
        return steps + [
            kernels.embed_call(self.ids, model.embed.weight, self.position, table, self.x, scale)
        ]

    def _attention_steps(self, layer: int, block) -> list:
        """resid_mid = resid_pre + attn(ln1(resid_pre)), the new key and value written to the cache
        on the way."""
        x, h, q, k, v, z, product = self.x, self.h, self.q, self.k, self.v, self.z, self._product
        attn, steps = block.attn, []
        # both norms read the residual stream: neither waits for the other
        if block.wiring == "parallel":
            steps.append(independent(kernels.norm_call(block.ln1, x, h)))
            steps.append(kernels.norm_call(block.ln2, x, self.h_mlp))
        elif block.ln1 is None:  # no norm before attention (OLMo 2): the products read x
            h = x
        else:
            steps.append(kernels.norm_call(block.ln1, x, h))
        steps += [
            independent(product(attn.W_Q, h, q)),
            independent(product(attn.W_K, h, k)),
            product(attn.W_V, h, v),
        ]
        if attn.q_norm is not None:  # in place: each head's q and k over its d_head
            # (qk_norm_whole: over all the heads, q and k seen as [batch, heads · d_head])
            q_rows, k_rows = (
                (q.view(q.shape[0], -1), k.view(k.shape[0], -1))
                if self.model.config.qk_norm_whole
                else (q, k)
            )
            steps += [
                independent(kernels.norm_call(attn.q_norm, q_rows, q_rows)),
                kernels.norm_call(attn.k_norm, k_rows, k_rows),
            ]
        if self.model.rotary is not None:
            local = block.rope_local  # the windowed blocks' own angles
            cos, sin = (self.cos_local, self.sin_local) if local else (self.cos, self.sin)
            steps += [
                independent(kernels.rope_call(q, cos, sin, self.position)),
                kernels.rope_call(k, cos, sin, self.position),
            ]
        windowed = self.model.config.layer_window(layer) is not None
        steps.append(
            kernels.attend_call(
                q,
                k,
                v,
                self.cache.k[layer],
                self.cache.v[layer],
                self.slot,
                self.model.config.scale,
                self.window_mask if windowed else self.key_mask,
                self.scores[layer if self.keep_weights else 0],
                z,
                self.model.config.attn_softcap,
            )
        )
        # resid_mid = resid_pre + attn_out
        steps += self._output_steps(attn.W_O, z, block.ln1_post)
        return steps

    def _output_steps(self, linear, x: torch.Tensor, post_norm) -> list:
        """residual += linear(x), or with a sandwich norm residual += post_norm(linear(x))."""
        if post_norm is None:
            return [self._product(linear, x, self.x, accumulate=True)]
        out, residual = self.sublayer_out, self.x
        return [
            self._product(linear, x, out),
            kernels.norm_call(post_norm, out, out),  # in place, as qk-norm
            kernels.add_call(residual, out),
        ]

    def _mlp_steps(self, block) -> list:
        """resid_post = resid_mid + mlp(ln2(resid_mid)) (a parallel block's ln2 read resid_pre,
        above)."""
        mlp, h_mlp, product, steps = block.mlp, self.h_mlp, self._product, []
        if block.wiring != "parallel" and block.ln2 is None:  # no norm before the MLP (OLMo 2)
            h_mlp = self.x
        elif block.wiring != "parallel":
            steps.append(kernels.norm_call(block.ln2, self.x, h_mlp))
        if isinstance(mlp, MoE):
            return steps + self._moe_steps(block, h_mlp)
        steps.append(product(mlp.W_in, h_mlp, self.pre))
        if mlp.gated:
            steps[-1] = independent(steps[-1])  # W_in and W_gate both read h_mlp
            steps.append(product(mlp.W_gate, h_mlp, self.gate))
            gate, pre = self.gate, self.pre
            if self.model.config.mlp == "swiglu":
                steps.append(kernels.silu_mul_call(gate, pre))
            else:  # geglu_tanh: gelu_tanh(W_gate x) ⊙ W_in x
                steps += [
                    kernels.activate_call(gate, kernels.Activation.GELU_TANH),
                    kernels.mul_call(gate, pre),
                ]
            post = self.gate
        else:
            steps.append(
                kernels.activate_call(self.pre, kernels.ACTIVATIONS[self.model.config.mlp])
            )
            post = self.pre
        # resid_post = resid_mid + mlp_out
        steps += self._output_steps(mlp.W_out, post, block.ln2_post)
        return steps

    def _head_steps(self) -> list:
        """The final norm, the LM head and the logits' soft-cap."""
        model, steps = self.model, []
        if model.ln_final is not None:
            steps.append(kernels.norm_call(model.ln_final, self.x, self.h))
        steps.append(
            self._product(
                model.unembed, self.h if model.ln_final is not None else self.x, self.logits
            )
        )
        if model.config.logit_softcap is not None:
            steps.append(kernels.softcap_call(self.logits, model.config.logit_softcap))
        return steps

    def _moe_steps(self, block, h_mlp: torch.Tensor) -> list:
        """A mixture of experts' MLP (attnlab.model.moe) in the program: the router's product and
        choice (kernels.route_call), the chosen experts' W_gate and W_in products through the
        experts' table (kernels.linear_experts_call: only those k experts' weights are read),
        SwiGLU's product, their W_out products, and the outputs weighed into the residual stream
        (kernels.weigh_experts_call) with Qwen2-MoE's gated shared expert, a dense SwiGLU MLP
        computed beside the router; with a sandwich norm, weighed into a buffer, normed and then
        added, as _output_steps."""
        mlp, x, product = block.mlp, self.x, self._product
        steps, shared = [], mlp.shared_expert
        if shared is not None:  # W_gate, W_in and the gate's logit all read h_mlp, as the router
            steps += [
                independent(product(shared.W_gate, h_mlp, self.shared_gate)),
                independent(product(shared.W_in, h_mlp, self.shared_pre)),
                independent(product(mlp.shared_expert_gate, h_mlp, self.shared_logit)),
            ]
        scores, weights, chosen = self.expert_scores, self.expert_weights, self.expert_indices
        steps += [
            product(mlp.W_gate, h_mlp, scores),
            kernels.route_call(scores, weights, chosen, mlp.norm_topk_prob),
        ]

        def table(part: str) -> list:
            return [self._expert_weight(getattr(e, part)) for e in mlp.experts]

        gate, pre, out = self.gate_k, self.pre_k, self.expert_out
        steps += [
            independent(kernels.linear_experts_call(h_mlp, table("W_gate"), chosen, gate)),
            kernels.linear_experts_call(h_mlp, table("W_in"), chosen, pre),
            kernels.silu_mul_call(gate, pre),
        ]
        if shared is not None:
            steps[-1] = independent(steps[-1])
            steps.append(kernels.silu_mul_call(self.shared_gate, self.shared_pre))
        steps.append(
            kernels.linear_experts_call(gate, table("W_out"), chosen, out, x_per_slot=True)
        )
        if shared is not None:
            steps[-1] = independent(steps[-1])
            steps.append(product(shared.W_out, self.shared_gate, self.shared_out))
        # resid_post = resid_mid + Σ_j w_j expert_j (+ sigmoid(w_s · h) shared_expert)
        gated = (self.shared_out, self.shared_logit) if shared is not None else (None, None)
        post_norm = block.ln2_post
        if post_norm is None:
            return steps + [kernels.weigh_experts_call(x, out, weights, *gated)]
        mixture = self.sublayer_out  # resid_post = resid_mid + ln2_post(mixture)
        return steps + [
            kernels.weigh_experts_call(mixture, out, weights, *gated, accumulate=False),
            kernels.norm_call(post_norm, mixture, mixture),
            kernels.add_call(x, mixture),
        ]

    def _expert_weight(self, linear) -> kernels.ExpertWeight:
        """How an expert's Linear (Int8Linear, BlockLinear) is multiplied: as `_product` multiplies
        a dense one (blocks in the 16-row layout where `repacked`)."""
        if isinstance(linear, BlockLinear):
            kind = BLOCK_TYPES[linear.kind].kernel
            blocks = stored_weight(linear, shared=self.shared)
            return kernels.ExpertWeight(blocks, kind=kind, repacked=repacked(linear))
        return kernels.ExpertWeight(linear.weight, getattr(linear, "scale", None))

    @staticmethod
    def linears_in_step_order(model, experts: bool = False) -> list:
        """The Linear (Int8Linear, BlockLinear) modules a step multiplies by, in that order; a
        mixture's routed experts (read as routed, k of them a step) only where `experts`, all of
        them at their place."""
        linears = []
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            linears += [attn.W_Q, attn.W_K, attn.W_V, attn.W_O]
            if isinstance(mlp, MoE):  # as _moe_steps multiplies them
                shared = mlp.shared_expert
                if shared is not None:
                    linears += [shared.W_gate, shared.W_in, mlp.shared_expert_gate]
                linears.append(mlp.W_gate)
                if experts:
                    for part in ("W_gate", "W_in", "W_out"):
                        linears += [getattr(e, part) for e in mlp.experts]
                if shared is not None:
                    linears.append(shared.W_out)
            elif mlp is not None:
                linears += [mlp.W_in] + ([mlp.W_gate] if mlp.gated else []) + [mlp.W_out]
        return linears + [model.unembed]

    @staticmethod
    def unsupported(model) -> str | None:
        """Why `model` must take the module path (None: this decoder computes what the modules
        would)."""
        if model.device.type != "cpu" or model.dtype != torch.float32:  # (no build asked for)
            return (
                f"the model is {str(model.dtype).removeprefix('torch.')} on {model.device.type}; "
                "the kernels run float32 on a CPU"
            )
        why = kernels.unavailable()
        if why is not None:
            return f"attnlab's C kernels are off ({why})"
        if model.config.wiring == "post":
            return "the model has post-norm blocks, which the C step does not cover"
        if model.config.residual_multiplier != 1.0 or model.config.logit_scale != 1.0:
            return (
                "the model scales its sublayers' outputs or its logits (Granite's multipliers), "
                "which the C step does not cover"
            )
        if model.config.mlp not in kernels.ACTIVATIONS and model.config.mlp not in GATED_MLPS:
            return f"the model's {model.config.mlp} MLP is not among the C step's activations"
        for m in model.modules():  # one walk over every module
            if m._forward_hooks or m._forward_pre_hooks:
                return "a hook is attached to the model, and only the modules run hooks"
            if isinstance(m, Linear) and m.weight.dtype != torch.float32:
                return (
                    f"Linear weights are stored as {str(m.weight.dtype).removeprefix('torch.')} "
                    "(the C step multiplies float32, int8 or ggml blocks)"
                )
            if not isinstance(m, (Linear, Int8Linear)) and isinstance(m, torch.nn.Linear):
                return f"a Linear the kernels do not know ({type(m).__name__})"
        return None

    def _product(
        self, linear, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False
    ) -> Callable[[], object]:
        """out (=, or += when accumulate) linear(x), prepared; x (B, ...) and out (B, ...)
        contiguous buffers."""
        B = x.shape[0]
        x2, out2 = x.view(B, -1), out.view(B, -1)  # [batch, d_in], [batch, d_out]
        if isinstance(linear, BlockLinear):  # always the blocks themselves, no float copy
            kind, layout = BLOCK_TYPES[linear.kind].kernel, repacked(linear)
            blocks = stored_weight(linear, shared=self.shared)
            return kernels.block_linear_call(
                x2, blocks, kind, linear.bias, out2, accumulate, layout
            )
        w = linear.weight
        # as KernelLinear.forward chooses (int8: always, no float copy)
        if w.dtype == torch.int8 or few_rows(x2):
            return kernels.linear_call(
                x2, w, linear.bias, getattr(linear, "scale", None), out2, accumulate
            )
        if accumulate:  # many rows: BLAS, added to the residual in place
            if linear.bias is None:
                return lambda: out2.addmm_(x2, w.t())
            return lambda: out2.addmm_(x2, w.t()).add_(linear.bias)
        if linear.bias is None:
            return lambda: torch.mm(x2, w.t(), out=out2)
        return lambda: torch.addmm(linear.bias, x2, w.t(), out=out2)

    @torch.no_grad()
    def __call__(self, token: torch.Tensor, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """token (B, 1) at cache slot `slot` and `positions` (B, 1). Returns the next logits (B, V),
        in a buffer."""
        self.ids.copy_(token.view(-1))
        self.position.copy_(positions.view(-1))
        if not self.embed_in_c:
            self.x.copy_(self.model.embed_tokens(token, positions, None).view(self.x.shape))
        self.slot.fill_(slot)
        for run in self.run:
            run()
        return self.logits

    def can_generate_greedy(self) -> bool:
        """Whether `generate_greedy` applies: the whole step is one C program (its embedding a
        lookup in C, no PyTorch call between kernels) and its tokens, the argmax of d_vocab logits,
        are rows of the embedding table."""
        return (
            len(self.run) == 1
            and isinstance(self.run[0], kernels.Program)
            and self.embed_in_c
            and self.model.config.d_vocab <= self.model.embed.num_embeddings
        )

    def generate_greedy(
        self,
        logits: torch.Tensor,
        tokens: int,
        out: torch.Tensor,
        slot: int,
        positions: torch.Tensor,
        eos: int | None,
        done: torch.Tensor,
    ) -> int:
        """Greedy generation in one C call (kernels.Program.generate_greedy): from `logits` (B,
        V), those of the token at cache slot `slot` - 1 and `positions` (B, 1) - 1, `tokens` new
        tokens into out (B, tokens), each argmax fed back as the next step's token at the next slot
        and position, as generate's loop would. Returns how many were written (fewer once every row
        made `eos`; done (B, 1) bool marks the rows that did)."""
        assert self.can_generate_greedy()
        if logits.data_ptr() != self.logits.data_ptr():
            self.logits.copy_(logits)
        self.position.copy_(positions.view(-1) - 1)  # the C loop moves them one on before a step
        self.slot.fill_(slot - 1)
        flags = done.view(-1)
        return self.run[0].generate_greedy(
            tokens, self.logits, self.ids, self.position, self.slot, self.key_mask, out, eos, flags
        )

    def weights(self) -> torch.Tensor:
        """The last step's attention pattern rows [batch, layer, head, key slot 0 … slot]: each
        head's weights over the keys, softmax(q·Kᵀ · scale) with the mask and window the step used
        (0 on masked keys); needs keep_weights=True. Read from what the attention kernel left in
        its scratch (exp(score − max), the kernel's own normaliser not kept), divided by its
        sum."""
        assert self.keep_weights, "KernelDecoder(keep_weights=True) keeps the weights"
        p = self.scores[..., : int(self.slot) + 1]  # [layer, batch, head, key]
        return (p / p.sum(-1, keepdim=True)).transpose(0, 1)


@torch.no_grad()
def step_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits (B, T, V) after each position of ids (B, T), computed one decode step at a time
    through KernelDecoder, as generation computes them (with block weights: 8-bit activations); for
    perplexity and agreement checks of the decode path against the module path."""
    reason = KernelDecoder.unsupported(model)
    assert reason is None, reason
    B, T = ids.shape
    step = KernelDecoder(model, KVCache.for_model(model, B, T))
    out = torch.empty(B, T, model.config.d_vocab)
    for t in range(T):
        out[:, t] = step(ids[:, t : t + 1], t, torch.full((B, 1), t))
    return out
