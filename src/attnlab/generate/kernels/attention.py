"""The kernels' attention, each a typed wrapper of one C function: a decode step's attention over
the KV cache (`attend_call`, an op of a step program), and a whole prompt's causal attention from
position 0, in one call (`attend_rows`) or in three steps for hooks between them
(`attend_scores`, `softmax_rows`, `attend_mix`; on AMX tiles all three in one call,
`attend_explicit`).

Design choices:
- Each computes the chapter's equation, softmax(q Kᵀ · scale, causal mask) V, with grouped-query
  heads; tests/test_kernels.py holds each to attnlab.model's attention.
- Each that makes scores takes the model's soft-cap (`softcap`, Gemma 2's attn_logit_softcapping;
  None: none, passed to C as 0): c·tanh(q Kᵀ · scale / c) before the mask, as attention_scores.
- q, k and v are read as [batch, pos, head, d_head], as the projections make them (no copy then);
  the results are views of that layout transposed to [batch, head, pos, d_head].
- The steps' AMX forms keep float32's accuracy (three bfloat16 parts per value) and run only where
  builds.amx_unusable has no objection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...memory import new_tensor
from . import builds
from .buffers import _kept_scratch
from .products import _no_amx_raises
from .programs import Call, Op


def attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Causal attention of a whole prompt from position 0: softmax(q Kᵀ · scale, soft-capped where
    `softcap` is given, each query seeing the keys up to its own position) V, for q [batch, head, T,
    d_head] and k, v [batch, kv_head, T, d_head] (grouped-query), float32, d_head a multiple of 32
    (attnlab_attend_rows). Returns [batch, head, T, d_head], a view of a [batch, T, head, d_head]
    tensor. Callers check `usable`."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape == (B, Hkv, T, D) and H % Hkv == 0 and D % 32 == 0
    assert q.dtype == k.dtype == v.dtype == torch.float32
    # [batch, pos, head, d_head], as the projections made them (no copy then)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    threads = torch.get_num_threads()
    lib = builds.library()
    scratch = torch.empty(lib.attnlab_attend_rows_scratch(B, T, Hkv, D, threads) // 4)
    out = torch.empty(B, T, H, D)
    lib.attnlab_attend_rows(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        B,
        T,
        H,
        Hkv,
        D,
        scale,
        softcap or 0.0,
        threads,
    )
    return out.transpose(1, 2)


def attend_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    amx: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """The masked scores of a whole prompt's causal attention from position 0: q Kᵀ · scale
    (soft-capped where `softcap` is given) where the query sees the key (key position ≤ query
    position), −∞ elsewhere (apply_mask's values), for q [batch, head, T, d_head], k [batch,
    kv_head, T, d_head] (grouped-query), float32 (attnlab_attend_scores; `amx`:
    attnlab_attend_scores_amx, on AMX tiles at float32's accuracy, where `amx_unusable` has no
    objection). Returns a new [batch, head, T, T]. Callers check `usable`."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == (B, Hkv, T, D) and H % Hkv == 0
    assert q.dtype == k.dtype == torch.float32
    q, k = (t.transpose(1, 2).contiguous() for t in (q, k))  # [batch, pos, head, d_head]
    lib = builds.library()
    scores = new_tensor(B, H, T, T)
    if amx:
        _no_amx_raises()
        threads = torch.get_num_threads()
        scratch = _kept_scratch(lib.attnlab_attend_amx_scratch(T, T, D, threads))
        lib.attnlab_attend_scores_amx(
            q.data_ptr(), k.data_ptr(), scores.data_ptr(), scratch.data_ptr(),
            B, T, H, Hkv, D, scale, softcap or 0.0, threads,
        )  # fmt: skip
        return scores
    scratch = torch.empty(lib.attnlab_attend_rows_scratch(B, T, Hkv, D, 1) // 4)
    lib.attnlab_attend_scores(
        q.data_ptr(),
        k.data_ptr(),
        scores.data_ptr(),
        scratch.data_ptr(),
        B,
        T,
        H,
        Hkv,
        D,
        scale,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    return scores


def softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """attention_pattern's softmax over the last dimension of float32 scores (−∞: weight 0; a row
    of −∞ only: zeros), in C (attnlab_softmax_rows). Returns a new tensor of the same
    shape. Callers check `usable`."""
    assert scores.dtype == torch.float32
    scores = scores.contiguous()
    pattern = new_tensor(*scores.shape)
    n = scores.shape[-1]
    builds.library().attnlab_softmax_rows(
        scores.data_ptr(), pattern.data_ptr(), scores.numel() // n, n, torch.get_num_threads()
    )
    return pattern


def attend_explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    amx: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attend_scores, softmax_rows and attend_mix (of the same `amx` and `softcap`) in one call, for
    hooks between them that only read (attnlab_attend_explicit, d_head a multiple of 32; `amx`:
    attnlab_attend_explicit_amx, where `amx_unusable` has no objection): a block of queries' scores
    and pattern read back from the core's cache, the pattern's zeros after the block's last query
    not multiplied. Their three results, bit for bit (values finite: an infinite or NaN value past a
    query block's last key is not multiplied by its zero weight), for q [batch, head, T, d_head], k,
    v [batch, kv_head, T, d_head]. Returns (scores, pattern, z [batch, head, T, d_head])."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape == (B, Hkv, T, D) and H % Hkv == 0 and (amx or D % 32 == 0)
    assert q.dtype == k.dtype == v.dtype == torch.float32
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [batch, pos, head, d_head]
    lib, threads = builds.library(), torch.get_num_threads()
    scores, pattern, out = new_tensor(B, H, T, T), new_tensor(B, H, T, T), new_tensor(B, T, H, D)
    if not amx:
        scratch = torch.empty(lib.attnlab_attend_rows_scratch(B, T, Hkv, D, 1) // 4)
        lib.attnlab_attend_explicit(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), scores.data_ptr(), pattern.data_ptr(),
            out.data_ptr(), scratch.data_ptr(), B, T, H, Hkv, D, scale, softcap or 0.0, threads,
        )  # fmt: skip
        return scores, pattern, out.transpose(1, 2)
    _no_amx_raises()
    scratch = _kept_scratch(lib.attnlab_attend_amx_scratch(T, T, D, threads))
    lib.attnlab_attend_explicit_amx(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), scores.data_ptr(), pattern.data_ptr(),
        out.data_ptr(), scratch.data_ptr(), B, T, H, Hkv, D, scale, softcap or 0.0, threads,
    )  # fmt: skip
    return scores, pattern, out.transpose(1, 2)


def attend_mix(pattern: torch.Tensor, v: torch.Tensor, amx: bool = False) -> torch.Tensor:
    """z = pattern V for pattern [batch, head, T, S] and v [batch, kv_head, S, d_head]
    (grouped-query), float32, d_head a multiple of 32 (attnlab_attend_mix; `amx`: any
    d_head, attnlab_attend_mix_amx on AMX tiles at float32's accuracy, where `amx_unusable` has no
    objection). Returns [batch, head, T, d_head], a view of a [batch, T, head, d_head] tensor.
    Callers check `usable`."""
    B, H, T, S = pattern.shape
    Hkv, D = v.shape[1], v.shape[-1]
    assert v.shape == (B, Hkv, S, D) and H % Hkv == 0 and (amx or D % 32 == 0)
    assert pattern.dtype == v.dtype == torch.float32
    pattern, v = pattern.contiguous(), v.transpose(1, 2).contiguous()  # v: [batch, pos, head, D]
    out = new_tensor(B, T, H, D)
    if amx:
        _no_amx_raises()
        lib, threads = builds.library(), torch.get_num_threads()
        scratch = _kept_scratch(lib.attnlab_attend_amx_scratch(T, S, D, threads))
        lib.attnlab_attend_mix_amx(
            pattern.data_ptr(), v.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            B, T, S, H, Hkv, D, threads,
        )  # fmt: skip
        return out.transpose(1, 2)
    builds.library().attnlab_attend_mix(
        pattern.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        B,
        T,
        S,
        H,
        Hkv,
        D,
        torch.get_num_threads(),
    )
    return out.transpose(1, 2)


def attend_call(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None,
    scores: torch.Tensor,
    out: torch.Tensor,
    softcap: float | None = None,
) -> Callable[[], None]:
    """Write k_new, v_new (rows, n_kv_heads, d_head) at cache slot `slot` (a one-element int64
    tensor, read at each call) of k_cache, v_cache (rows, n_kv_heads, max_len, d_head), then out
    (rows, heads, d_head) = softmax(q Kᵀ · scale, soft-capped where `softcap` is given) V over slots
    [0, slot] that key_mask (rows, max_len) bool allows (None: all). `scores` is scratch of rows ·
    heads · max_len floats; the call leaves there each head's unnormalised weights, exp(score − max)
    at the slots it attended to and 0 at masked ones (KernelDecoder.weights reads them)."""
    rows, heads, d_head = q.shape
    n_kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    # the C code trusts these layouts: check them once here, where the call is prepared
    assert all(
        t.is_contiguous() and t.dtype == torch.float32
        for t in (q, k_new, v_new, k_cache, v_cache, scores, out)
    )
    assert (
        k_new.shape == v_new.shape == (rows, n_kv_heads, d_head) and v_cache.shape == k_cache.shape
    )
    assert (
        k_cache.shape == (rows, n_kv_heads, max_len, d_head)
        and heads % n_kv_heads == 0
        and out.shape == q.shape
    )
    assert scores.numel() >= rows * heads * max_len and slot.dtype == torch.int64
    assert key_mask is None or (
        key_mask.dtype == torch.bool
        and key_mask.stride(-1) == 1
        and key_mask.shape == (rows, max_len)
    )
    stride = key_mask.stride(0) if key_mask is not None else 0
    return Call(
        Op.ATTEND,
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        key_mask,
        stride,
        scores,
        out,
        rows,
        heads,
        n_kv_heads,
        d_head,
        max_len,
        slot,
        scale,
        softcap or 0.0,
        torch.get_num_threads(),
    )
