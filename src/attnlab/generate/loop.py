"""Generation: the prompt at once, then one token at a time, with a static KV cache
(attnlab.generate.kv_cache).

Design choices (after gpt-fast):
- `generate` chooses its decode step once, before the first token: the kernel decode program
  (`KernelDecoder`, the default where it applies), the compiled step (`compile=`), or the model's
  modules, eager. The modules where the C step does not apply to a model on a CPU are slower:
  one line says so and why (attnlab.slower), once per reason per process. For as long as it
  runs, the model's Linear layers are the fast ones (`fast_linears`).
- `prefill` runs the whole prompt once and fills the cache; `decode_one_token` feeds back a single
  token. A prompt of up to PREFILL_IN_STEPS tokens goes through the kernel decode step instead, a
  token at a time.
- The compiled decode step has the same shapes at every step, so `torch.compile` traces it once: its
  cache slot is
  a tensor (not a Python int the graph would specialise on), it attends to the *whole* buffer, and a
  boolean key mask (B, max_len) hides the slots not yet written and the left padding. A single query
  may see every key it is shown, so causality needs nothing else (attnlab.model.attention's causal
  offset for T < S). Only the decode step is compiled: prefill runs once per call, compiling it
  would not pay.
- The end-of-sequence test reads one flag every 16 tokens, not every token (every token when
  streaming to `on_token`, which reads each token anyway). Sampling: attnlab.generate.sampling.
- Greedy (temperature 0) on the kernel decode program, with no callback to call between tokens:
  the whole loop runs in C (`KernelDecoder.generate_greedy`: argmax, the token fed back, the next
  step), the same tokens as the loop here (tests/test_kernels.py), faster by the loop's Python
  between steps (benchmarks/README.md, "The idle run on the Intel Xeon").
- Left-padded batches: `attention_mask` marks real tokens; positions count real tokens only, and
  padded keys stay masked, so each row generates exactly what it would alone.
- `on_rows` (generation you can watch, attnlab.generate.watch): each new token's attention rows,
  those of the query whose logits chose it, over every key before it. The kernel decode program
  keeps each layer's weights (`KernelDecoder(keep_weights=True)`); a prefill through the modules and
  the module path hand them out through a hook on every hook_pattern, attached after the decode
  step is chosen (a hook sends the step to the module path: `KernelDecoder.unsupported`).
- Lower precision is the model's dtype (`model.to(torch.bfloat16)`): the cache takes the model's
  dtype, norms compute in float32, and sampling reads float32 logits. Or only the weights
  (`attnlab.quant.quantize.store_weights_as(model, torch.bfloat16)`): half the bytes per
  token, float32 arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager

import torch

from .. import slower
from ..compiling import compile_function
from ..errors import UserError
from ..lens.hooks import reads
from . import kernels
from .fast_layers import fast_linears
from .kernel_decoder import KernelDecoder
from .kv_cache import KVCache, buffer_length
from .sampling import sample_next

EOS_CHECK_EVERY = 16  # tokens between reads of the "every row has ended" flag
# prompts of up to this many tokens go through KernelDecoder one token at a time: the module path's
# prefill costs several decode steps at any length (its ~100 PyTorch calls per layer), so short
# prompts are quicker as steps (benchmarks/README.md, "Figures behind the code")
PREFILL_IN_STEPS = 4


def _check_args(
    model, ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k, top_p
) -> None:
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
            f"prompt ({ids.shape[-1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            "exceeds the model's "
            f"context n_ctx={model.config.n_ctx}; shorten the prompt or generate fewer tokens"
        )


@torch.no_grad()
def prefill(
    model,
    ids: torch.Tensor,
    cache: KVCache,
    positions: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the prompt (B, T), filling the cache; return the logits of its last position (B, V).
    Only that position goes through the final norm and the LM head (as llama.cpp's prompt
    processing: the other T - 1 rows of the largest product are never used), unless a hook on the
    model, the final norm or the head expects every position."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in _tail_modules(model)):
        return model(
            ids, kv_cache=cache, start_pos=0, positions=positions, attention_mask=attention_mask
        )[:, -1]
    resid = model(
        ids,
        kv_cache=cache,
        start_pos=0,
        positions=positions,
        attention_mask=attention_mask,
        stop_at_layer=len(model.blocks),
    )  # [batch, pos, d_model]
    return model.logits_from_resid(resid[:, -1:])[:, -1]


def _tail_modules(model) -> list:
    """The model and every module of its final norm and LM head."""
    return [model] + [
        m for part in (model.ln_final, model.unembed) if part is not None for m in part.modules()
    ]


@torch.no_grad()
def decode_one_token(
    model,
    token: torch.Tensor,
    cache: KVCache,
    slot: int,
    positions: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Feed one token (B, 1) into cache slot `slot` at `positions` (B, 1); return the next logits
    (B, V). The keys are slots [0, slot]; key_mask (B, slot + 1), or None for all of them."""
    return model(
        token,
        kv_cache=cache,
        start_pos=slot,
        positions=positions,
        attention_mask=key_mask,
        # no host read per token: `generate` checked the lengths up front
        check_inputs=False,
    )[:, -1]


@torch.no_grad()
def decode_one_token_at_slot(
    model,
    token: torch.Tensor,
    cache: KVCache,
    slot: torch.Tensor,
    positions: torch.Tensor,
    key_mask: torch.Tensor,
) -> torch.Tensor:
    """`decode_one_token` with static shapes, for torch.compile: the cache slot is a (1,) tensor and
    the token attends to the whole buffer, key_mask (B, max_len) True at the keys it may see, its
    own slot included. A windowed block adds its band, slots slot − W + 1 ... slot, to the key mask
    itself (attnlab.model.attention: the cache's `slot`)."""
    return model(
        token,
        kv_cache=cache.at_slot(slot),
        positions=positions,
        attention_mask=key_mask,
        check_inputs=False,
    )[:, -1]


def compiled_decode_one_token(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """`decode_one_token_at_slot` through torch.compile (one graph, static shapes). The compiled
    code is cached on the function, so every call to this returns a wrapper that reuses it: one
    compilation per model shape. backend "aot_eager" captures the same graph without generating code
    (quick: tests use it). Inductor's options key its on-disk cache by the vector width
    (attnlab.compiling)."""
    return compile_function(decode_one_token_at_slot, backend, fullgraph=True, dynamic=False)


@torch.no_grad()
def generate(
    model,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    compile: bool | str = False,
    use_kernels: bool = True,
    on_logits: Callable[[torch.Tensor], None] | None = None,
    on_rows: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The prompt followed by `max_new_tokens` new tokens: (B, T) -> (B, T + new).

    attention_mask (B, T): 1 for real prompt tokens, 0 for left padding. `on_token` receives each
    new token column (B, 1) as it is chosen (for streaming), `on_logits` the logits (B, V) it is
    drawn from, just before (the explorer shows the candidates), and `on_rows` before that the
    attention rows [B, layer, head, key] of the step that computed those logits (its query over
    every key so far: row T + i − 1 of the final text's pattern, for new token i). Stops early once
    every row has produced `eos_token_id`, padding the rest with it. `compile=True` runs the decode
    step through torch.compile (or a backend's name: compile="aot_eager"): the first call with a new
    shape compiles the step first, later calls reuse it. Otherwise the decode step is
    `KernelDecoder` where it applies (`use_kernels=False`: always the modules, eager).
    """
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    _check_args(model, ids, max_new_tokens, temperature, top_k, top_p)
    if on_rows is not None and compile:
        raise UserError(
            "the attention rows of each step (on_rows) come from the eager steps; drop compile="
        )
    if max_new_tokens == 0:
        return ids
    with _in_eval_mode(model), fast_linears(model), ExitStack() as context:
        generator = None
        if seed is not None:
            generator = torch.Generator(device=ids.device).manual_seed(seed)
        B, T = ids.shape  # batch, prompt positions
        device = ids.device
        max_len = buffer_length(T + max_new_tokens)
        cache = KVCache.for_model(model, B, max_len, values_position_minor=bool(compile))
        # [batch, key slot]: may be attended to
        key_mask = torch.zeros(B, max_len, dtype=torch.bool, device=device)
        if attention_mask is None:
            key_mask[:, :T] = True
            positions = torch.arange(T, device=device).expand(B, T)
        else:
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
            key_mask[:, :T] = attention_mask
            # padding doesn't advance positions
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = torch.empty(B, T + max_new_tokens, dtype=ids.dtype, device=device)
        out[:, :T] = ids
        fast = None
        # one new token after a prompt longer than PREFILL_IN_STEPS takes no decode step: then the
        # step program (a walk of every layer, a prepared call per kernel) is never built
        steps = max_new_tokens > 1 or T <= PREFILL_IN_STEPS
        if steps and not compile and use_kernels:
            why = KernelDecoder.unsupported(model)
            if why is None:
                fast = KernelDecoder(
                    model,
                    cache,
                    key_mask if attention_mask is not None else None,
                    keep_weights=on_rows is not None,
                )
            else:
                _say_module_path(model, why)
        step = _decode_step(model, cache, key_mask, attention_mask is not None, compile, fast)
        if on_rows is not None:  # after the step was chosen: a hook would have chosen the modules
            hooked_rows = context.enter_context(_last_query_rows(model))
        # a short prompt: through the decode step, token by token
        in_steps = fast is not None and T <= PREFILL_IN_STEPS
        if in_steps:
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
        # greedy, nothing to call between tokens, the step one C program: the whole loop in C
        in_c = temperature == 0 and on_token is None and on_logits is None and on_rows is None
        in_python = max_new_tokens  # the tokens the loop below makes
        if in_c and fast is not None and fast.can_generate_greedy():
            new = out[:, T:]
            n = fast.generate_greedy(logits, max_new_tokens, new, T, position, eos_token_id, done)
            in_python = 0
        for i in range(in_python):
            if on_rows is not None:  # the kernels' weights once they computed the logits
                on_rows(fast.weights() if fast is not None and (i or in_steps) else hooked_rows())
            if on_logits is not None:
                on_logits(logits)
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
                done |= token == eos_token_id
            out[:, T + i : T + i + 1] = token
            if on_token is not None:
                on_token(token)
            if i == max_new_tokens - 1:
                break
            # a streaming caller reads every token anyway: then the flag costs nothing to read
            check = on_token is not None or (i + 1) % EOS_CHECK_EVERY == 0
            if eos_token_id is not None and check and bool(done.all()):
                n = i + 1
                break
            logits = step(token, T + i, slot, position)
            slot += 1
            position += 1
        if T + n < out.shape[1]:
            out[:, T + n :] = eos_token_id
        return out


def _say_module_path(model, why: str) -> None:
    """One line (attnlab.slower): this generation's decode step is the model's modules, where
    attnlab's C decode step is the usual one on a CPU; unless the kernels are off, which their own
    line has said (or ATTNLAB_KERNELS=0 chose), or the model is not on a CPU (then the modules,
    or compile=, are the usual path)."""
    if model.device.type == "cpu" and kernels.available():
        slower.say(
            "generation runs the model's modules at every new token",
            "attnlab's C decode step",
            why,
        )


@contextmanager
def _last_query_rows(model):
    """While open, a hook on every layer's hook_pattern keeps its last query's rows; yields a
    function giving those of the latest forward pass, [batch, layer, head, key]."""
    n_layers = model.config.n_layers
    layer_of = {f"blocks.{layer}.attn.hook_pattern": layer for layer in range(n_layers)}
    rows: list[torch.Tensor | None] = [None] * n_layers

    @reads  # (a fused attention may then compute past the pattern before calling it)
    def keep(pattern: torch.Tensor, hook) -> None:  # [batch, head, query_pos, key_pos]
        # copied: a view would keep the prompt's whole T × T pattern alive
        rows[layer_of[hook.name]] = pattern[:, :, -1].float().clone()

    with model.hooks([(layer_of.__contains__, keep)]):
        yield lambda: torch.stack(rows, dim=1)


@contextmanager
def _in_eval_mode(model):
    """eval() for as long as generation runs, then the model's own mode again. eval() sets every
    module's flag, a walk of every module: only when one is training."""
    was_training = model.training
    switch = any(m.training for m in model.modules())
    if switch:
        model.eval()
    try:
        yield
    finally:
        if switch:
            model.train(was_training)


def _decode_step(
    model,
    cache: KVCache,
    key_mask: torch.Tensor,
    padded: bool,
    compile: bool | str,
    fast: KernelDecoder | None,
) -> Callable[..., torch.Tensor]:
    """The decode step generate runs for every new token: step(token (B, 1), pos, slot, position (B,
    1)) ->
    logits (B, V), where the cache slot is both the int pos and the (1,) tensor slot; it marks the
    slot in key_mask first. Compiled, it reads the tensor (a graph must not specialise on the slot);
    eager, the int. Eager steps attend to the slots written so far (no mask without padding): static
    shapes only pay when compiled, and cost an eager step its masking (benchmarks/README.md,
    "Generation speed")."""
    if compile:
        compiled = compiled_decode_one_token(compile if isinstance(compile, str) else "inductor")

        def step(
            token: torch.Tensor, pos: int, slot: torch.Tensor, position: torch.Tensor
        ) -> torch.Tensor:
            key_mask.index_fill_(1, slot, True)
            return compiled(model, token, cache, slot, position, key_mask).float()
    elif fast is not None:

        def step(
            token: torch.Tensor, pos: int, slot: torch.Tensor, position: torch.Tensor
        ) -> torch.Tensor:
            key_mask[:, pos] = True
            return fast(token, pos, position)
    else:

        def step(
            token: torch.Tensor, pos: int, slot: torch.Tensor, position: torch.Tensor
        ) -> torch.Tensor:
            key_mask[:, pos] = True
            mask = key_mask[:, : pos + 1] if padded else None
            return decode_one_token(model, token, cache, pos, position, mask).float()

    return step
