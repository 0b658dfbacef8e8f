"""Generation: one token at a time, with a static KV cache, optionally through a compiled decode step.

Design choices (after gpt-fast):
- `KVCache` is static: one preallocated buffer per layer for keys and values, written in place, so a
  decode step allocates nothing that grows with the sequence.
- `prefill` runs the whole prompt once and fills the cache; `decode_one_token` feeds back a single token. A
  prompt of up to PREFILL_IN_STEPS tokens goes through the kernel decode step instead, a token at a time.
- The compiled decode step has the same shapes at every step, so `torch.compile` traces it once: its cache slot is
  a tensor (not a Python int the graph would specialise on), it attends to the *whole* buffer, and a
  boolean key mask (B, max_len) hides the slots not yet written and the left padding. A single query may
  see every key it is shown, so causality needs nothing else (attnlab.model.attention's causal offset for
  T < S). Only the decode step is compiled: prefill runs once per call, compiling it would not pay.
- The default decode step (`KernelDecoder`, no compilation) walks the model's weights itself and calls
  attnlab.generate.kernels' C loops for the products and the attention: no graph to build, so no set-up per process,
  and the whole step is one C call (one OpenMP parallel region, its threads hot from the first product to the
  last) instead of the ~100 PyTorch operations per layer of the module path, whose per-call overhead was most of
  a step on a small model. A hooked model, a post-norm one, another dtype or device, or a
  machine without a C compiler takes the module path, which computes the same equation.
- The buffer length is rounded up to a multiple of 64 so that nearby lengths share one compiled graph.
- Sampling never reads a tensor on the host: greedy is an argmax; otherwise the token is the argmax of
  p_i / E_i with E_i ~ Exp(1), which picks i with probability p_i (the "exponential race" of gpt-fast)
  and avoids torch.multinomial. The end-of-sequence test reads one flag every 16 tokens, not every token
  (every token when streaming to `on_token`, which reads each token anyway).
- Sampling: temperature (0 = greedy argmax), then top-k, then top-p (nucleus), from a seeded generator.
- Left-padded batches: `attention_mask` marks real tokens; positions count real tokens only, and padded
  keys stay masked, so each row generates exactly what it would alone.
- Lower precision is the model's dtype (`model.to(torch.bfloat16)`): the cache takes the model's dtype,
  norms compute in float32, and sampling reads float32 logits. Or only the weights
  (`attnlab.model.layers.store_weights_as(model, torch.bfloat16)`): half the bytes per token, float32 arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import kernels
from .kernels import independent
from ..errors import UserError
from ..model.layers import few_rows

CACHE_ROUND = 64  # cache lengths are rounded up to this, so nearby lengths share a compiled decode step
EOS_CHECK_EVERY = 16  # tokens between reads of the "every row has ended" flag
# prompts of up to this many tokens go through KernelDecoder one token at a time: the module path's prefill costs
# 3-10 decode steps at any length (its ~100 PyTorch calls per layer), so below ~4 tokens steps are quicker
# (measured on the 6 x 384 and 135M shapes, float32 and int8: benchmarks/README.md, issue 14)
PREFILL_IN_STEPS = 4


class KVCache:
    """Keys and values of every layer for positions [0, max_len): k[layer], v[layer] of shape
    [batch, kv_head, pos, d_head].

    One tensor per layer, not one [layer, ...] tensor: a compiled step then writes each layer's own
    tensor in place, where writing a view of a shared tensor would make it copy the whole buffer.
    `values_position_minor` (the compiled decode step's layout) stores the values as [batch, kv_head, d_head,
    pos] and hands them out transposed (same shape as the keys, other strides): a single query's weighted sum
    of the values then reads each value dimension's positions contiguously, a loop inductor vectorises; stored
    position-major, it walked the positions 64 floats apart, one dependent add at a time (4-12 % more tokens/s,
    benchmarks/README.md, "Generation speed"). Eager kernels want them position-major (8-20 % slower otherwise).
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, d_head: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 values_position_minor: bool = False) -> None:
        shape = (batch, n_kv_heads, max_len, d_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        if values_position_minor:
            self.v = [torch.zeros(batch, n_kv_heads, d_head, max_len, dtype=dtype, device=device).transpose(-2, -1)
                      for _ in range(n_layers)]
        else:
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, values_position_minor: bool = False) -> "KVCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim, model.dtype, model.device,
                   values_position_minor)

    def update(self, layer: int, start: int | torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [batch, kv_head, T, d_head] at positions start..start+T.

        `start` an int (prefill, plain calls): return the keys/values of positions [0, start+T) (from 0: the
        tensors given, which hold exactly those, contiguous whatever the cache's layout).
        `start` a one-element tensor (the decode step): write that slot and return the whole buffer, whose
        shape never changes; the caller's key mask must hide the slots not yet written.
        """
        if isinstance(start, torch.Tensor):
            self.k[layer][:, :, start] = k
            self.v[layer][:, :, start] = v
            return self.k[layer], self.v[layer]
        end = start + k.shape[-2]
        if end > self.max_len:
            raise UserError(f"the KV cache holds {self.max_len} positions but generation reached {end}; raise max_len")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        if start == 0:
            return k, v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """logits (B, V) / temperature, with ids outside top-k and top-p set to −∞: softmax of this is what
    `sample_next` draws from (temperature > 0), so the explorer can show that very distribution."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # keep the smallest set whose mass reaches top_p
        drop[..., 0] = False  # and always the most likely id (a top_p below float32's smallest number is 0 here)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). temperature 0 is greedy.

    argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p: P(i wins) = p_i (the minimum of independent
    exponentials E_i / p_i). Unlike torch.multinomial it never waits on the host.
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1, keepdim=True)


def _check_args(model, ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k, top_p) -> None:
    if not model.config.causal:
        raise UserError("generate needs a causal (decoder) model; this one is an encoder")
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise UserError(f"top_k must be a positive integer, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")
    total = ids.shape[-1] + max_new_tokens
    if model.config.positional == "learned" and total > model.config.n_ctx:
        raise UserError(
            f"prompt ({ids.shape[-1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's "
            f"context n_ctx={model.config.n_ctx}; shorten the prompt or generate fewer tokens"
        )


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt (B, T), filling the cache; return the logits of its last position (B, V)."""
    return model(ids, kv_cache=cache, start_pos=0, positions=positions, attention_mask=attention_mask)[:, -1]


@torch.no_grad()
def decode_one_token(model, token: torch.Tensor, cache: KVCache, slot: torch.Tensor | int, positions: torch.Tensor,
                     key_mask: torch.Tensor | None) -> torch.Tensor:
    """Feed one token (B, 1) into cache slot `slot` at `positions` (B, 1); return the next logits (B, V).

    slot a (1,) tensor (compiled): key_mask (B, max_len) is True at the keys the token may see, its own slot
    included. slot an int (eager): the keys are slots [0, slot], key_mask (B, slot + 1) or None for all."""
    return model(token, kv_cache=cache, start_pos=slot, positions=positions, attention_mask=key_mask,
                 check_inputs=False)[:, -1]  # no host read per token: `generate` checked the lengths up front


class KernelDecoder:
    """`decode_one_token` through attnlab.generate.kernels, for float32 (or int8-weight) models on a CPU, eager.

    At construction the step is written down once as a list of prepared C calls on preallocated buffers, in the
    modules' order: per block, norm (both norms first in a parallel block); q, k, v products; qk-norm; RoPE; the new key and value written to the cache
    and attended to; the output product added to the residual in place; norm; MLP; and at the end the final norm
    and the LM head. A step then copies its tokens, positions and cache slot into the buffers the calls read
    and runs the list, which begins with the embedding lookup (PyTorch's embed_tokens for sinusoids, token types or an
    embedding norm) and reads RoPE's angles from a table made once: ~12 kernels per block, run as one program
    (kernels.program: one C call for the step, the threads waiting for each other only where a kernel reads what
    the last one wrote; calls marked `independent` do not), and three PyTorch copies. The cache must be
    position-major (`KVCache(values_position_minor=False)`), and `key_mask` the tensor every step marks.
    Returns a buffer that the next call overwrites. Batches of more than layers.MATVEC_MAX_ROWS rows with float32
    weights multiply through BLAS (torch.addmm into the same buffers).
    """

    def __init__(self, model, cache: KVCache, key_mask: torch.Tensor | None = None) -> None:
        cfg = model.config
        B, H, Hkv, D = cache.k[0].shape[0], cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.model = model
        new = lambda *shape: torch.zeros(*shape)  # noqa: E731
        self.x, self.h = new(B, cfg.d_model), new(B, cfg.d_model)  # residual stream, its norm  [batch, d_model]
        self.q, self.z = new(B, H, D), new(B, H, D)  # [batch, head, d_head]
        self.k, self.v = new(B, Hkv, D), new(B, Hkv, D)  # [batch, kv_head, d_head]
        self.scores = new(B, H, cache.max_len)  # [batch, head, key slot]: the attention kernel's scratch
        self.pre, self.gate = new(B, cfg.mlp_dim), new(B, cfg.mlp_dim)  # [batch, d_mlp]
        self.logits = new(B, cfg.d_vocab)
        self.ids = torch.zeros(B, dtype=torch.int64)  # this step's tokens
        self.position = torch.zeros(B, dtype=torch.int64)  # and their positions
        self.slot = torch.zeros(1, dtype=torch.int64)  # the cache slot this step writes
        if model.rotary is not None:  # the angles of every position the cache can hold: [position, rotary_dim]
            cos, sin = model.rotary(torch.arange(cache.max_len).unsqueeze(0))  # (1, max_len, 1, rotary_dim)
            self.cos, self.sin = cos.view(cache.max_len, -1).contiguous(), sin.view(cache.max_len, -1).contiguous()
        self.key_mask = key_mask  # kept alive: the attention calls read it
        x, h, q, k, v, z = self.x, self.h, self.q, self.k, self.v, self.z
        # before any call is prepared (they bind addresses): the weights into 2 MB pages, in the order read
        kernels.place_in_huge_pages([linear.weight for linear in self.linears_in_step_order(model)])
        product = self._product
        steps = []
        # the embedding in C when it is a lookup (+ learned positions); sinusoids, token types, a norm: PyTorch
        self.embed_in_c = (cfg.positional in ("rope", "none", "learned") and model.token_type_embed is None
                           and model.ln_embed is None)
        if self.embed_in_c:
            table = model.pos_embed.weight if cfg.positional == "learned" else None
            steps.append(kernels.embed_call(self.ids, model.embed.weight, self.position, table, x))
        self.h_mlp = new(B, cfg.d_model) if cfg.parallel_residual else h  # a parallel MLP reads ln2(resid_pre)
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            if block.parallel:  # both norms read the residual stream: neither waits for the other
                steps.append(independent(kernels.norm_call(block.ln1, x, h)))
                steps.append(kernels.norm_call(block.ln2, x, self.h_mlp))
            else:
                steps.append(kernels.norm_call(block.ln1, x, h))
            steps += [independent(product(attn.W_Q, h, q)), independent(product(attn.W_K, h, k)),
                      product(attn.W_V, h, v)]
            if attn.q_norm is not None:  # in place: each head's q and k over its d_head
                steps += [independent(kernels.norm_call(attn.q_norm, q, q)), kernels.norm_call(attn.k_norm, k, k)]
            if model.rotary is not None:
                steps += [independent(kernels.rope_call(q, self.cos, self.sin, self.position)),
                          kernels.rope_call(k, self.cos, self.sin, self.position)]
            steps.append(kernels.attend_call(q, k, v, cache.k[layer], cache.v[layer], self.slot, cfg.scale, key_mask,
                                             self.scores, z))
            steps.append(product(attn.W_O, z, x, accumulate=True))  # resid_mid = resid_pre + attn_out
            if block.mlp is not None:
                mlp, h_mlp = block.mlp, self.h_mlp
                if not block.parallel:
                    steps.append(kernels.norm_call(block.ln2, x, h_mlp))
                steps.append(product(mlp.W_in, h_mlp, self.pre))
                if mlp.gated:
                    steps[-1] = independent(steps[-1])  # W_in and W_gate both read h_mlp
                    steps += [product(mlp.W_gate, h_mlp, self.gate),
                              kernels.prepare("attnlab_silu_mul", self.gate, self.pre, self.pre.numel())]
                    post = self.gate
                else:
                    steps.append(kernels.prepare("attnlab_activate", self.pre, self.pre.numel(),
                                                 kernels.ACTIVATIONS[cfg.mlp]))
                    post = self.pre
                steps.append(product(mlp.W_out, post, x, accumulate=True))  # resid_post = resid_mid + mlp_out
        if model.ln_final is not None:
            steps.append(kernels.norm_call(model.ln_final, x, h))
        steps.append(product(model.unembed, h if model.ln_final is not None else x, self.logits))
        if cfg.logit_softcap is not None:
            steps.append(kernels.prepare("attnlab_softcap", self.logits, self.logits.numel(), cfg.logit_softcap))
        self.run = kernels.program(steps)  # consecutive kernel calls: one C call, one parallel region

    @staticmethod
    def linears_in_step_order(model) -> list:
        """The Linear (or Int8Linear) modules a step multiplies by, in the order it does."""
        linears = []
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            linears += [attn.W_Q, attn.W_K, attn.W_V, attn.W_O]
            if mlp is not None:
                linears += [mlp.W_in] + ([mlp.W_gate] if mlp.gated else []) + [mlp.W_out]
        return linears + [model.unembed]

    @staticmethod
    def unsupported(model) -> str | None:
        """Why `model` must take the module path (None: this decoder computes what the modules would)."""
        from ..model.layers import Int8Linear, Linear

        if not kernels.available():
            return "attnlab's C kernels are not built on this machine (no C compiler, or ATTNLAB_KERNELS=0)"
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return "the kernels run float32 on a CPU"
        if model.config.norm_placement != "pre":
            return "post-norm blocks take the module path"
        if model.config.mlp not in kernels.ACTIVATIONS and model.config.mlp != "swiglu":
            return f"the {model.config.mlp} MLP takes the module path"
        if model.config.sliding_window is not None:
            return "a sliding attention window takes the module path (the attention kernel sees every earlier key)"
        for m in model.modules():  # one walk (2,004 modules on the 135M shape)
            if m._forward_hooks or m._forward_pre_hooks:
                return "a hook is attached: the module path runs it"
            if isinstance(m, Linear) and m.weight.dtype != torch.float32:
                return "Linear weights stored as another dtype take the module path"
            if not isinstance(m, (Linear, Int8Linear)) and isinstance(m, torch.nn.Linear):
                return "a Linear the kernels do not know"
        return None

    @staticmethod
    def _product(linear, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> Callable[[], object]:
        """out (=, or += when accumulate) linear(x), prepared; x (B, ...) and out (B, ...) contiguous buffers."""
        B = x.shape[0]
        x2, out2, w = x.view(B, -1), out.view(B, -1), linear.weight  # [batch, d_in], [batch, d_out]
        if w.dtype == torch.int8 or few_rows(x2):  # as Linear.forward chooses (int8: always, no float copy)
            return kernels.linear_call(x2, w, linear.bias, getattr(linear, "scale", None), out2, accumulate)
        if accumulate:  # many rows: BLAS, added to the residual in place
            if linear.bias is None:
                return lambda: out2.addmm_(x2, w.t())
            return lambda: out2.addmm_(x2, w.t()).add_(linear.bias)
        if linear.bias is None:
            return lambda: torch.mm(x2, w.t(), out=out2)
        return lambda: torch.addmm(linear.bias, x2, w.t(), out=out2)

    @torch.no_grad()
    def __call__(self, token: torch.Tensor, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """token (B, 1) at cache slot `slot` and `positions` (B, 1). Returns the next logits (B, V), in a buffer."""
        self.ids.copy_(token.view(-1))
        self.position.copy_(positions.view(-1))
        if not self.embed_in_c:
            self.x.copy_(self.model.embed_tokens(token, positions, None).view(self.x.shape))
        self.slot.fill_(slot)
        for run in self.run:
            run()
        return self.logits


def compiled_decode_one_token(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """`decode_one_token` through torch.compile (one graph, static shapes). The compiled code is cached on the
    function, so every call to this returns a wrapper that reuses it: one compilation per model shape.
    backend "aot_eager" captures the same graph without generating code (quick: tests use it)."""
    return torch.compile(decode_one_token, backend=backend, fullgraph=True, dynamic=False)


@torch.no_grad()
def generate(model, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, attention_mask: torch.Tensor | None = None,
             eos_token_id: int | None = None, on_token: Callable[[torch.Tensor], None] | None = None,
             compile: bool | str = False, use_kernels: bool = True) -> torch.Tensor:
    """The prompt followed by `max_new_tokens` new tokens: (B, T) -> (B, T + new).

    attention_mask (B, T): 1 for real prompt tokens, 0 for left padding. `on_token` receives each new
    token column (B, 1) as it is chosen (for streaming). Stops early once every row has produced
    `eos_token_id`, padding the rest with it. `compile=True` runs the decode step through torch.compile
    (or a backend's name: compile="aot_eager"): the first call with a new shape compiles for a while (tens
    of seconds on a CPU), later calls reuse it. Otherwise the decode step is `KernelDecoder` where it applies
    (`use_kernels=False`: always the modules, eager).
    """
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    _check_args(model, ids, max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return ids
    was_training = model.training
    # eval() sets every module's flag (16 ms on the 135M shape, 0.25 ms per token of a 128-token run): only when needed
    switch = any(m.training for m in model.modules())
    if switch:
        model.eval()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=ids.device).manual_seed(seed)
    B, T = ids.shape  # batch, prompt positions
    device = ids.device
    max_len = -(-(T + max_new_tokens) // CACHE_ROUND) * CACHE_ROUND
    cache = KVCache.for_model(model, B, max_len, values_position_minor=bool(compile))
    key_mask = torch.zeros(B, max_len, dtype=torch.bool, device=device)  # [batch, key slot]: may be attended to
    if attention_mask is None:
        key_mask[:, :T] = True
        positions = torch.arange(T, device=device).expand(B, T)
    else:
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        key_mask[:, :T] = attention_mask
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # padding doesn't advance positions
    out = torch.empty(B, T + max_new_tokens, dtype=ids.dtype, device=device)
    out[:, :T] = ids
    # Eager steps attend to the slots written so far (no mask without padding): static shapes only pay
    # when compiled, and cost an eager step its masking (benchmarks/README.md, "Generation speed").
    step = compiled_decode_one_token(compile if isinstance(compile, str) else "inductor") if compile else None
    fast = None
    if not compile and use_kernels and KernelDecoder.unsupported(model) is None:
        fast = KernelDecoder(model, cache, key_mask if attention_mask is not None else None)
    try:
        if fast is not None and T <= PREFILL_IN_STEPS:  # a short prompt: through the decode step, token by token
            model._check_ids(ids)  # as the module path's prefill does: the C lookup trusts the ids
            model._check_values(ids, positions)
            for t in range(T):
                logits = fast(ids[:, t : t + 1], t, positions[:, t : t + 1])
        else:
            logits = prefill(model, ids, cache, positions, attention_mask)
        slot = torch.tensor([T], device=device)  # the cache slot the next token is written to
        position = positions[:, -1:] + 1  # [batch, 1]
        done = torch.zeros(B, 1, dtype=torch.bool, device=device)
        n = max_new_tokens
        for i in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
                done |= token == eos_token_id
            out[:, T + i : T + i + 1] = token
            if on_token is not None:
                on_token(token)
            if i == max_new_tokens - 1:
                break
            # A streaming caller reads every token anyway, so then the flag costs nothing to read each time.
            check = on_token is not None or (i + 1) % EOS_CHECK_EVERY == 0
            if eos_token_id is not None and check and bool(done.all()):
                n = i + 1
                break
            if step is not None:
                key_mask.index_fill_(1, slot, True)
                logits = step(model, token, cache, slot, position, key_mask).float()
            elif fast is not None:
                key_mask[:, T + i] = True
                logits = fast(token, T + i, position)
            else:
                pos = T + i
                key_mask[:, pos] = True
                mask = key_mask[:, : pos + 1] if attention_mask is not None else None
                logits = decode_one_token(model, token, cache, pos, position, mask).float()
            slot += 1
            position += 1
    finally:
        if switch:
            model.train(was_training)
    if n < max_new_tokens:
        out[:, T + n :] = eos_token_id
    return out
