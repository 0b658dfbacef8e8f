"""Attention: the chapter's soft dictionary, implemented once, and the multi-head layer built on it.

Design choices:
- The equation  Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V,  scale = 1/√d_k  lives in three
  small
  functions (`attention_scores`, `apply_mask`, `attention_pattern`) that the explicit path and the
  hooked multi-head layer both call. Every other path (torch's fused SDPA, the KV-cached decode, the
  chunked path) is tested against them.
- `chunked_attention` walks the keys in blocks with an online softmax (scores and masks from the
  same functions, one block at a time), so memory grows linearly in T in the forward and backward
  passes.
  It returns outputs only: patterns of long inputs come from one place, inspection.capture.
- Boolean masks follow torch: True means "may attend". Additive masks are added to the scores.
- `causal=True` with T queries and S ≥ T keys means the queries are the *last* T positions (cached
  decoding): query i sees keys j ≤ i + (S − T). torch's `is_causal` aligns top-left instead, so it
  is only used when T == S.
- A sliding window W (Mistral; Beltagy et al. 2020) narrows the causal band: query i sees keys i +
  (S − T) − W < j ≤ i + (S − T), itself and the W − 1 before it, as transformers counts it. It is
  part of the causal mask (`causal_mask(..., window=W)`), so every path (explicit, fused, chunked,
  cached) gets it from the same place; the fused kernel then takes an explicit mask instead of
  `is_causal`. Each block has its own (`ModelConfig.layer_window`: Gemma 3 windows five blocks of
  six).
- An attention soft-cap c (Gemma 2's attn_logit_softcapping) bounds each score smoothly to (−c, c)
  before the mask: scores = c·tanh(Q Kᵀ · scale / c) (`soft_cap`, in `attention_scores`, so the
  explicit path, the hooks and the explorer all see it). torch's fused kernel has no such step:
  with a cap, `scaled_dot_product_attention` takes the explicit equation, and the C paths
  (attnlab.generate.fast_layers' prompt kernels, the kernel decode step) are not chosen.
- A fully masked row (e.g. a padding query) gives zeros, never NaN.
- The multi-head layer takes the fused path unless someone hooks the scores or the pattern, which
  are the only activations the fused kernel never materialises; hooks elsewhere keep it fused.
- `hook_result` (each head's output z_h W_O^h, [batch, pos, head, d_model]) is computed only when
  hooked, as TransformerLens's `use_attn_result`: H times the memory of attn_out, so the plain path
  never makes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..lens.hooks import HookPoint
from .config import ModelConfig
from .layers import Linear, RMSNorm  # qk-norm is the one norm attention owns
from .positions import apply_rope


def causal_mask(
    T: int,
    S: int,
    device: torch.device | str | None = None,
    diagonal: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean (T, S) mask, True where query i (the (S−T+i)-th position) may see key j: j ≤ i + S −
    T, and with a sliding `window` W also j > i + S − T − W (the query and the W − 1 keys before
    it).

    `diagonal` replaces S − T when the (T, S) block sits inside a larger matrix (the chunked
    path)."""
    diagonal = S - T if diagonal is None else diagonal
    allowed = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=diagonal)
    return allowed if window is None else allowed.triu(diagonal=diagonal - window + 1)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """c·tanh(scores / c): the scores bounded smoothly to (−c, c); the scores as they are when cap
    is None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """scores = Q Kᵀ · scale: how well each query matches each key, soft-capped to (−c, c) by
    `softcap` c where given (Gemma 2). (..., T, d_k) x (..., S, d_k) -> (..., T, S)."""
    return soft_cap(torch.matmul(q, k.transpose(-2, -1)) * scale, softcap)


def apply_mask(
    scores: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    diagonal: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Set forbidden scores to −∞ (causal: above the shifted diagonal, and below the band of a
    sliding `window`;
    boolean mask: where False), or add an additive mask.

    `diagonal`: for a block of a larger score matrix, its causal diagonal (see causal_mask)."""
    T, S = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(
            ~causal_mask(T, S, scores.device, diagonal, window), float("-inf")
        )
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    return scores


def attention_pattern(masked_scores: torch.Tensor) -> torch.Tensor:
    """weights = softmax over keys; each row sums to 1, and a row with every key masked is all
    zeros."""
    # a row is all masked when its largest score is −∞: one read of the scores, no boolean copy
    all_masked = torch.isneginf(masked_scores.amax(dim=-1, keepdim=True))
    # softmax of an all −∞ row is 0/0 = NaN, in the forward pass and in its gradient (which
    # masked_fill afterwards does not stop for additive masks): give such rows finite scores before
    # the softmax.
    pattern = torch.softmax(masked_scores.masked_fill(all_masked, 0.0), dim=-1)
    return pattern.masked_fill(all_masked, 0.0)


def expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: repeat each key/value head for the query heads that share it (dim
    −3)."""
    if q.dim() >= 3 and kv.dim() >= 3 and kv.shape[-3] != q.shape[-3]:
        if q.shape[-3] % kv.shape[-3]:
            raise ValueError(
                f"query heads ({q.shape[-3]}) must be a multiple of key/value heads "
                f"({kv.shape[-3]})"
            )
        return kv.repeat_interleave(q.shape[-3] // kv.shape[-3], dim=-3)
    return kv


def _fused_mask(
    T: int,
    S: int,
    causal: bool,
    mask: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """The attn_mask / is_causal pair for torch's SDPA that means the same as (causal, mask, window)
    here."""
    if causal and window is not None and window < S:  # the band hides keys: is_causal cannot say so
        allowed = causal_mask(T, S, device, window=window)
        if mask is None:
            return allowed, False
        return (
            mask & allowed
            if mask.dtype == torch.bool
            else mask.masked_fill(~allowed, float("-inf"))
        ), False
    if mask is None:
        if not causal or T == 1:  # a single (last) query sees every key
            return None, False
        if T == S:
            return None, True
        return causal_mask(T, S, device), False
    if not causal:
        return mask, False
    allowed = causal_mask(T, S, device)
    if mask.dtype == torch.bool:
        return mask & allowed, False
    return mask.masked_fill(~allowed, float("-inf")), False


def _checked_scale(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None) -> float:
    """The scale to use (default 1/√d_k), after checking that causal attention has at least as many
    keys as queries."""
    T, S = q.shape[-2], k.shape[-2]
    if causal and T > S:
        raise ValueError(
            f"causal attention needs at least as many keys as queries, got T={T} queries, S={S} "
            "keys"
        )
    return q.shape[-1] ** -0.5 if scale is None else scale


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scale + mask) V for q (..., T, d_k), k (..., S, d_k), v (..., S, d_v).

    Returns the output (..., T, d_v), or `(output, weights)` with weights (..., T, S) when
    `return_weights`. Without weights it runs torch's fused kernel; with them, the explicit
    equation. Key/value tensors with fewer heads (dim −3) than q are shared across query heads
    (grouped-query).
    `window` (with causal): each query sees itself and the window − 1 keys before it. `softcap` c:
    the scores are c·tanh(scores / c) before the mask, computed by the explicit equation (torch's
    fused kernel has no such step).
    """
    scale = _checked_scale(q, k, causal, scale)
    T, S = q.shape[-2], k.shape[-2]
    if softcap is not None and not return_weights:
        out, _ = scaled_dot_product_attention(
            q,
            k,
            v,
            causal=causal,
            mask=mask,
            scale=scale,
            return_weights=True,
            dropout_p=dropout_p,
            window=window,
            softcap=softcap,
        )
        return out
    if T == 1 and not return_weights and dropout_p == 0 and torch.compiler.is_compiling():
        # one query (a decode step) in a compiled graph: the explicit equation, which inductor fuses
        # into a few loops, instead of the fused kernel's per-call setup (benchmarks/README.md,
        # "Generation speed")
        return scaled_dot_product_attention(
            q, k, v, causal=causal, mask=mask, scale=scale, return_weights=True, window=window
        )[0]
    if not return_weights:
        attn_mask, is_causal = _fused_mask(T, S, causal, mask, q.device, window)
        gqa = q.dim() >= 3 and k.shape[-3] != q.shape[-3]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=gqa,
        )
        # rows with no visible key: zeros, whatever the kernel did (a window alone leaves none)
        if mask is not None:
            visible = (
                attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
            ).any(-1, keepdim=True)
            out = out.masked_fill(~visible, 0.0)
        return out
    k, v = expand_kv(q, k), expand_kv(q, v)
    weights = attention_pattern(
        apply_mask(attention_scores(q, k, scale, softcap), causal=causal, mask=mask, window=window)
    )
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return torch.matmul(dropped, v), weights


def _key_blocks(T: int, S: int, block_size: int, causal: bool):
    """(s0, s1, i0) per block of keys s0..s1: under causal masking queries before i0 see none of it,
    so they are skipped (about half the work when T == S)."""
    for s0 in range(0, S, block_size):
        yield s0, min(s0 + block_size, S), max(0, s0 - (S - T)) if causal else 0


def _block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float,
    s0: int,
    s1: int,
    i0: int,
    window: int | None = None,
) -> torch.Tensor:
    """Masked scores of queries i0.. against keys s0..s1: the explicit path's equation on one
    block."""
    T, S = q.shape[-2], k.shape[-2]
    if mask is not None:  # mask broadcasts to (..., T, S): slice the axes it really has
        mask = mask[..., s0:s1] if mask.shape[-1] == S else mask
        mask = mask[..., i0:, :] if mask.dim() >= 2 and mask.shape[-2] == T else mask
    scores = attention_scores(q[..., i0:, :], k[..., s0:s1, :], scale)  # [..., T - i0, s1 - s0]
    return apply_mask(scores, causal=causal, mask=mask, diagonal=S - T + i0 - s0, window=window)


class _ChunkedAttention(torch.autograd.Function):
    """Online softmax over key blocks (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022).

    Forward keeps, per query, the running max m of its scores, the running sum l of exp(score − m)
    and the running Σ exp(score − m)·v; a new block rescales them by exp(m_old − m_new). The
    backward pass recomputes each block's pattern p = exp(score − logsumexp) instead of storing it:
    dV = pᵀ dO,  dS = p ⊙ (dO Vᵀ − rowsum(dO ⊙ O)),  dQ = dS K · scale,  dK = dSᵀ Q · scale. So
    memory is O(T · block) per head in both directions, never O(T · S). Additive masks get no
    gradient.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, mask, causal: bool, scale: float, block_size: int, window: int | None
    ):
        T, S = q.shape[-2], k.shape[-2]
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        acc = q.new_zeros(*batch, T, v.shape[-1])  # Σ exp(score − m) · v
        m = q.new_full((*batch, T, 1), float("-inf"))  # running max of the scores
        l = q.new_zeros(*batch, T, 1)  # Σ exp(score − m)
        for s0, s1, i0 in _key_blocks(T, S, block_size, causal):
            scores = _block_scores(q, k, causal, mask, scale, s0, s1, i0, window)
            m_new = torch.maximum(m[..., i0:, :], scores.amax(-1, keepdim=True))
            # rows with no visible key so far
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)
            p = torch.exp(scores - m_safe)
            rescale = torch.exp(m[..., i0:, :] - m_safe)
            l[..., i0:, :] = l[..., i0:, :] * rescale + p.sum(-1, keepdim=True)
            acc[..., i0:, :] = acc[..., i0:, :] * rescale + torch.matmul(p, v[..., s0:s1, :])
            m[..., i0:, :] = m_new
        visible = l > 0  # a row that saw no key gives zeros, as the explicit path does
        out = torch.where(visible, acc / l.clamp_min(torch.finfo(l.dtype).tiny), 0.0)
        # log Σ_j exp(score_j)  [..., T, 1]
        lse = torch.where(visible, m + torch.log(l), float("-inf"))
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.causal, ctx.scale, ctx.block_size, ctx.window = causal, scale, block_size, window
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        T, S = q.shape[-2], k.shape[-2]
        delta = (d_out * out).sum(-1, keepdim=True)  # rowsum(dO ⊙ O)  [..., T, 1]
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # such rows have all scores −∞: p = 0
        d_q = torch.zeros_like(out[..., :1]).expand(*out.shape[:-1], q.shape[-1]).clone()
        d_k, d_v = [], []
        for s0, s1, i0 in _key_blocks(T, S, ctx.block_size, ctx.causal):
            p = torch.exp(
                _block_scores(q, k, ctx.causal, mask, ctx.scale, s0, s1, i0, ctx.window)
                - lse[..., i0:, :]
            )
            d_o = d_out[..., i0:, :]
            d_v.append(torch.matmul(p.transpose(-2, -1), d_o))
            d_scores = p * (
                torch.matmul(d_o, v[..., s0:s1, :].transpose(-2, -1)) - delta[..., i0:, :]
            )
            d_q[..., i0:, :] += torch.matmul(d_scores, k[..., s0:s1, :]) * ctx.scale
            d_k.append(torch.matmul(d_scores.transpose(-2, -1), q[..., i0:, :]) * ctx.scale)
        d_k, d_v = torch.cat(d_k, dim=-2), torch.cat(d_v, dim=-2)
        return (
            d_q.sum_to_size(q.shape),
            d_k.sum_to_size(k.shape),
            d_v.sum_to_size(v.shape),
            None,
            None,
            None,
            None,
            None,
        )


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int = 256,
    window: int | None = None,
) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + mask) V one block of `block_size` keys at a time (same arguments as
    scaled_dot_product_attention): the T × S scores never exist at once, in the forward or backward
    pass.

    It returns the output only: the one memory-light way to look at patterns is
    attnlab.inspection.capture.capture_patterns (chosen heads, a chunk of query rows at a time).
    """
    scale = _checked_scale(q, k, causal, scale)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    k, v = expand_kv(q, k), expand_kv(q, v)
    return _ChunkedAttention.apply(q, k, v, mask, causal, scale, block_size, window)[0]


class Attention(nn.Module):
    """Multi-head attention: h heads with their own W_Q, W_K, W_V, concatenated and mixed by W_O.

    Hook shapes: hook_q / hook_rot_q  # [batch, pos, head, d_head]
                 hook_k / hook_v / hook_rot_k  # [batch, key_pos, kv_head, d_head]
                 hook_attn_scores / hook_pattern  # [batch, head, query_pos, key_pos]
                 hook_z  # [batch, pos, head, d_head]
                 hook_result  # [batch, pos, head, d_model]: only when hooked
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.window = config.layer_window(layer)  # this block's sliding window (None: global)
        H, Hkv, D, d_model = config.n_heads, config.n_kv_heads, config.d_head, config.d_model
        self.W_Q = Linear(d_model, H * D, bias=config.use_qkv_bias)
        self.W_K = Linear(d_model, Hkv * D, bias=config.use_qkv_bias)
        self.W_V = Linear(d_model, Hkv * D, bias=config.use_qkv_bias)
        self.W_O = Linear(H * D, d_model, bias=config.bias)
        # qk-norm over each head's d_head, or over the whole projection (qk_norm_whole: OLMo 2)
        q_width, k_width = (H * D, Hkv * D) if config.qk_norm_whole else (D, D)
        self.q_norm = RMSNorm(q_width, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.norm_eps) if config.qk_norm else None
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_rot_q, self.hook_rot_k = HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern, self.hook_z = (
            HookPoint(),
            HookPoint(),
            HookPoint(),
        )
        self.hook_result = HookPoint(on_demand=True)

    @property
    def needs_pattern(self) -> bool:
        """True when a hook wants the scores or the pattern, which only the explicit path
        computes."""
        return self.hook_attn_scores.has_hooks or self.hook_pattern.has_hooks

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W_Q x, W_K x, W_V x [batch, pos, heads · d_head]. The fast layers, where a caller swaps
        them in, multiply a prompt's three in one call (attnlab.generate.fast_layers)."""
        return self.W_Q(x), self.W_K(x), self.W_V(x)

    def rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE of x [batch, pos, head, d_head] by rope's (cos, sin) (a new tensor)."""
        return apply_rope(x, *rope)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        dropout_p: float,
        window: int | None,
    ) -> torch.Tensor:
        """z = softmax(Q Kᵀ · scale + mask) V [batch, head, pos, d_head] when no hook wants the
        pattern: torch's fused kernel (scaled_dot_product_attention). The fast layers, where a
        caller swaps them in, attend a prompt in C (attnlab.generate.fast_layers)."""
        cfg = self.config
        return scaled_dot_product_attention(
            q,
            k,
            v,
            causal=cfg.causal,
            mask=mask,
            scale=cfg.scale,
            dropout_p=dropout_p,
            window=window,
            softcap=cfg.attn_softcap,
        )

    # The explicit path, in the three steps the hooks sit between (when the pattern is wanted); the
    # fast layers' KernelAttention (attnlab.generate.fast_layers) overrides each for a prompt.
    def score(
        self, q: torch.Tensor, k: torch.Tensor, *, mask: torch.Tensor | None, window: int | None
    ) -> torch.Tensor:
        """scores = Q Kᵀ · scale (soft-capped where the config says), masked  [batch, head,
        query_pos, key_pos]."""
        cfg = self.config
        scores = attention_scores(q, expand_kv(q, k), cfg.scale, cfg.attn_softcap)
        return apply_mask(scores, causal=cfg.causal, mask=mask, window=window)

    def weigh(self, scores: torch.Tensor) -> torch.Tensor:
        """pattern = softmax of the masked scores over the keys."""
        return attention_pattern(scores)

    def mix(self, pattern: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """z = pattern V  [batch, head, query_pos, d_head]."""
        return torch.matmul(pattern, expand_kv(pattern, v))

    def attend_explicit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        dropout_p: float,
        window: int | None,
    ) -> torch.Tensor:
        """z [batch, head, pos, d_head] in the three steps, with the hooks between them."""
        scores = self.hook_attn_scores(self.score(q, k, mask=mask, window=window))
        pattern = self.hook_pattern(self.weigh(scores))
        return self.mix(F.dropout(pattern, dropout_p, self.training), v)

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        kv_cache=None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape  # batch, query positions, d_model
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        q, k, v = self.project(x)
        q = self.hook_q(q.view(B, T, H, D))
        k = self.hook_k(k.view(B, T, Hkv, D))
        v = self.hook_v(v.view(B, T, Hkv, D))
        if self.q_norm is not None and self.config.qk_norm_whole:  # over heads · d_head
            q = self.q_norm(q.reshape(B, T, H * D)).view(B, T, H, D)
            k = self.k_norm(k.reshape(B, T, Hkv * D)).view(B, T, Hkv, D)
        elif self.q_norm is not None:  # over each head's d_head
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q = self.hook_rot_q(self.rotate(q, rope))
            k = self.hook_rot_k(self.rotate(k, rope))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, start_pos, k, v)  # [B, Hkv, S, D], S = start_pos + T
        dropout_p = cfg.dropout if self.training else 0.0
        window = self.window
        if window is not None and kv_cache is not None and kv_cache.whole_buffer:
            # A cache that hands back its whole buffer (the compiled decode step's) puts the query
            # at its slot rather than last: the band, slots slot − W + 1 ... slot, joins the key
            # mask.
            band = torch.arange(k.shape[-2], device=k.device) > kv_cache.slot - window  # [key_pos]
            mask = band if mask is None else mask & band
            window = None
        if self.needs_pattern:
            z = self.attend_explicit(q, k, v, mask=mask, dropout_p=dropout_p, window=window)
        else:
            z = self.attend(q, k, v, mask=mask, dropout_p=dropout_p, window=window)
        z = self.hook_z(z.transpose(1, 2))  # [B, T, H, D]
        # each head's share of attn_out: attn_out = Σ_h result_h + b_O
        if self.hook_result.has_hooks:
            W_O = self.W_O.weight.to(z.dtype).view(-1, H, D)  # [d_model, H, D]
            out = self.hook_result(torch.einsum("bthd,mhd->bthm", z, W_O)).sum(2)  # [B, T, d_model]
            return out if self.W_O.bias is None else out + self.W_O.bias
        return self.W_O(z.reshape(B, T, H * D))
