"""The oracle: the chapters' equations transcribed into NumPy (float64), one function per equation.

Design choices:
- Written to be read next to the chapter, not to be fast: heads are a Python loop, attention is
  computed one (batch, head) slice at a time, RoPE rotates each pair of dims with its 2×2 rotation.
  None of it shares code with attnlab, so agreeing with it means something.
- Everything is float64 NumPy; the tests turn attnlab's tensors into arrays and compare.
- Weights use PyTorch's nn.Linear layout (out, in), so a model's state dict can be fed in unchanged:
  `transformer_forward(config, {name: tensor.numpy()}, ids)`.
- Masks are given as `allowed` (bool, True = may attend) or `additive` (added to the scores; −inf
  forbids). A query that may attend to nothing gets zeros, which is what attnlab promises.
"""

from __future__ import annotations

import math

import numpy as np

# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """softmax(x)_i = exp(x_i) / Σ_j exp(x_j)   (shifted by max(x) first, which changes nothing)."""
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def causal_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chapter's causal_attention, as written there, for Q, K (T, d_k) and V (T, d_v):

    scores  = Q Kᵀ / √d_k,   plus −1e9 above the diagonal (a token may not look ahead)
    weights = softmax(scores)          (each row sums to 1)
    output  = weights · V
    """
    d_k = Q.shape[-1]
    scores = Q @ K.T / np.sqrt(d_k)
    T = scores.shape[0]
    scores = scores + np.triu(np.full((T, T), -1e9), k=1)
    weights = softmax(scores, axis=-1)
    return weights @ V, weights


def causal_allowed(T: int, S: int, window: int | None = None) -> np.ndarray:
    """allowed[i, j] = (j ≤ i + S − T): the T queries are the last T of S positions (cached
    decoding). A sliding window W also requires i + S − T − j < W: the query and the W − 1 positions
    before it."""
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    allowed = j <= i + (S - T)
    return allowed if window is None else allowed & (i + (S - T) - j < window)


def attention(
    Q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    *,
    scale: float | None = None,
    causal: bool = False,
    allowed: np.ndarray | None = None,
    additive: np.ndarray | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention(Q, K, V) = softmax(Q Kᵀ · scale + M) V for one head: Q (T, d_k), K (S, d_k), V (S,
    d_v); with `softcap` c the scores are c·tanh(Q Kᵀ · scale / c) before M (Gemma 2).

    scale defaults to 1/√d_k. M is −∞ where a key is forbidden (causal offset or sliding window,
    `allowed` False, or an additive −∞) and the additive mask's value elsewhere. The softmax runs
    over the allowed keys only; a row with no allowed key has weights 0 and output 0.
    """
    T, d_k = Q.shape
    S = K.shape[0]
    if scale is None:
        scale = 1.0 / math.sqrt(d_k)
    scores = (Q @ K.T) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    ok = np.ones((T, S), dtype=bool)
    if causal:
        ok &= causal_allowed(T, S, window)
    if allowed is not None:
        ok &= np.broadcast_to(allowed, (T, S))
    if additive is not None:
        additive = np.broadcast_to(additive, (T, S))
        ok &= ~np.isneginf(additive)
        scores = scores + np.where(np.isneginf(additive), 0.0, additive)
    weights = np.zeros((T, S))
    for i in range(T):
        if ok[i].any():
            weights[i, ok[i]] = softmax(scores[i, ok[i]])
    return weights @ V, weights


def batched_attention(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, allowed=None, additive=None, **kwargs
) -> tuple[np.ndarray, np.ndarray]:
    """`attention` for every leading index of Q (..., T, d_k).

    K, V and the masks have as many leading dims as Q; a leading dim of size 1 broadcasts, and a
    smaller head count in K, V means grouped-query: query head h reads key/value head h // (H /
    H_kv).
    """
    lead = Q.shape[:-2]
    out = np.zeros(lead + (Q.shape[-2], V.shape[-1]))
    weights = np.zeros(lead + (Q.shape[-2], K.shape[-2]))
    for index in np.ndindex(*lead):
        masks = {
            "allowed": None if allowed is None else _slice_for(allowed, index, lead),
            "additive": None if additive is None else _slice_for(additive, index, lead),
        }
        k, v = _slice_for(K, index, lead), _slice_for(V, index, lead)
        out[index], weights[index] = attention(Q[index], k, v, **masks, **kwargs)
    return out, weights


def _slice_for(a: np.ndarray, index: tuple[int, ...], lead: tuple[int, ...]) -> np.ndarray:
    """The (rows, cols) slice of `a` that the query slice `index` reads (broadcast or grouped
    dims)."""
    picked = []
    for i, n_q, n_a in zip(index, lead, a.shape[: len(lead)]):
        if n_a == n_q:
            picked.append(i)
        elif n_a == 1:
            picked.append(0)
        else:  # grouped-query: n_q / n_a query heads share each key/value head
            picked.append(i // (n_q // n_a))
    return a[tuple(picked)]


def linear(x: np.ndarray, W: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """y = x Wᵀ + b, with W in PyTorch's (out, in) layout."""
    y = x @ W.T
    return y + b if b is not None else y


def multi_head_attention(
    X: np.ndarray,
    W_Q: np.ndarray,
    W_K: np.ndarray,
    W_V: np.ndarray,
    W_O: np.ndarray,
    *,
    n_heads: int,
    n_kv_heads: int | None = None,
    b_Q=None,
    b_K=None,
    b_V=None,
    b_O=None,
    scale: float | None = None,
    causal: bool = False,
    allowed: np.ndarray | None = None,
    q_norm: np.ndarray | None = None,
    k_norm: np.ndarray | None = None,
    norm_eps: float = 1e-6,
    rope: tuple[np.ndarray, int, float] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    qk_norm_whole: bool = False,
) -> np.ndarray:
    """MultiHead(X) = Concat(head_1, …, head_h) W_Oᵀ + b_O,  head_i = Attention(X W_Q,iᵀ, X W_K,iᵀ,
    X W_V,iᵀ).

    X (T, d_model) for one sequence. Head i's weights are rows i·d_head … (i+1)·d_head of W_Q; with
    n_kv_heads < n_heads (grouped-query), head i reads key/value head i // (n_heads / n_kv_heads).
    Optional QK-norm (RMSNorm on each head's q and k, weights q_norm / k_norm) and RoPE
    (rope = (positions (T,), rotary_dim, theta)) are applied to q and k before the scores.
    `allowed` (T, T) masks keys (True = may attend). `qk_norm_whole` (OLMo 2): the RMSNorms span
    the whole of XW_Qᵀ and of XW_Kᵀ, before the heads are split. `softcap`: see `attention`.
    """
    n_kv_heads = n_kv_heads or n_heads
    d_head = W_Q.shape[0] // n_heads
    group = n_heads // n_kv_heads
    Q_all = linear(X, W_Q, b_Q)
    K_all = linear(X, W_K, b_K)
    if q_norm is not None and qk_norm_whole:
        Q_all, K_all = rms_norm(Q_all, q_norm, norm_eps), rms_norm(K_all, k_norm, norm_eps)
    heads = []
    for i in range(n_heads):
        rows = slice(i * d_head, (i + 1) * d_head)
        kv_rows = slice((i // group) * d_head, (i // group + 1) * d_head)
        q, k = Q_all[..., rows], K_all[..., kv_rows]
        v = linear(X, W_V[kv_rows], None if b_V is None else b_V[kv_rows])
        if q_norm is not None and not qk_norm_whole:
            q, k = rms_norm(q, q_norm, norm_eps), rms_norm(k, k_norm, norm_eps)
        if rope is not None:
            positions, rotary_dim, theta = rope
            q, k = (
                apply_rope(q, positions, rotary_dim, theta),
                apply_rope(k, positions, rotary_dim, theta),
            )
        head, _ = attention(
            q, k, v, scale=scale, causal=causal, allowed=allowed, window=window, softcap=softcap
        )
        heads.append(head)
    return linear(np.concatenate(heads, axis=-1), W_O, b_O)


# --------------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------------


def sinusoidal_positions(positions: np.ndarray, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos /
    10000^(2i/d_model))."""
    positions = np.asarray(positions, dtype=np.float64)
    pe = np.zeros(positions.shape + (d_model,))
    for i in range(d_model // 2):
        angle = positions / 10000.0 ** (2 * i / d_model)
        pe[..., 2 * i] = np.sin(angle)
        pe[..., 2 * i + 1] = np.cos(angle)
    return pe


def rope_angles(positions: np.ndarray, rotary_dim: int, theta: float = 10000.0) -> np.ndarray:
    """θ_{pos, i} = pos · theta^(−2i/rotary_dim) for pair i = 0 … rotary_dim/2 − 1: shape (...,
    rotary_dim/2)."""
    i = np.arange(rotary_dim // 2)
    return np.asarray(positions, dtype=np.float64)[..., None] * theta ** (-2.0 * i / rotary_dim)


def apply_rope(
    x: np.ndarray, positions: np.ndarray, rotary_dim: int, theta: float = 10000.0
) -> np.ndarray:
    """RoPE, rotate-half convention: dims (i, i + rotary_dim/2) form a pair rotated by θ_{pos, i}:

        x'_i            = x_i cos θ − x_{i+d/2} sin θ
        x'_{i+d/2}      = x_i sin θ + x_{i+d/2} cos θ
        x'_j (j ≥ rotary_dim) = x_j        (partial rotary leaves the rest alone)

    x (..., pos, d_head) with positions (pos,) or broadcastable to x.shape[:-1].
    """
    half = rotary_dim // 2
    angles = rope_angles(positions, rotary_dim, theta)  # (..., pos, half)
    out = np.array(x, dtype=np.float64, copy=True)
    for i in range(half):
        c, s = np.cos(angles[..., i]), np.sin(angles[..., i])
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * c - b * s
        out[..., i + half] = a * s + b * c
    return out


# --------------------------------------------------------------------------------------------------
# Norms, activations, MLP
# --------------------------------------------------------------------------------------------------


def layer_norm(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, eps: float = 1e-5
) -> np.ndarray:
    """LayerNorm(x) = (x − mean(x)) / √(var(x) + ε) · w + b   (biased variance, over the last
    dim)."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * weight
    return y + bias if bias is not None else y


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """RMSNorm(x) = x / √(mean(x²) + ε) · w."""
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU(x) = x · Φ(x) = x · ½ (1 + erf(x / √2))."""
    erf = np.vectorize(math.erf)
    return x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (GPT-2): ½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def relu(x: np.ndarray) -> np.ndarray:
    """ReLU(x) = max(0, x)."""
    return np.maximum(x, 0.0)


def relu2(x: np.ndarray) -> np.ndarray:
    """ReLU²(x) = max(0, x)² (So et al. 2021, Primer)."""
    return np.maximum(x, 0.0) ** 2


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU(x) = x · σ(x) = x / (1 + e^(−x))."""
    return x / (1.0 + np.exp(-x))


ACTIVATIONS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "relu2": relu2}


def mlp(x: np.ndarray, params: dict[str, np.ndarray], kind: str = "gelu") -> np.ndarray:
    """FFN(x) = W_out act(W_in x + b_in) + b_out;  SwiGLU: W_out (SiLU(W_gate x) ⊙ W_in x) + b_out;
    GeGLU: the same with GELU (tanh) for SiLU.

    params: W_in, W_out (and W_gate) weights in (out, in) layout, optional b_in, b_gate, b_out.
    """
    if kind in ("swiglu", "geglu_tanh"):  # GeGLU (Gemma): the tanh GELU where SwiGLU has SiLU
        gate = silu if kind == "swiglu" else gelu_tanh
        hidden = gate(linear(x, params["W_gate"], params.get("b_gate"))) * linear(
            x, params["W_in"], params.get("b_in")
        )
    else:
        hidden = ACTIVATIONS[kind](linear(x, params["W_in"], params.get("b_in")))
    return linear(hidden, params["W_out"], params.get("b_out"))


# --------------------------------------------------------------------------------------------------
# Blocks and the whole model
# --------------------------------------------------------------------------------------------------


def pre_norm_block(x: np.ndarray, attn, mlp_fn, norm1, norm2) -> np.ndarray:
    """Pre-norm block (GPT-2, LLaMA):  h = x + Attn(Norm₁(x));  out = h + MLP(Norm₂(h)).

    attn, mlp_fn, norm1, norm2 are functions of an array; mlp_fn None means an attention-only block.
    """
    h = x + attn(norm1(x))
    return h if mlp_fn is None else h + mlp_fn(norm2(h))


def sandwich_norm_block(x: np.ndarray, attn, mlp_fn, norm1, norm2, post1, post2) -> np.ndarray:
    """Pre-norm block with sandwich norms (Gemma 2/3): each sublayer's output normed again before
    the residual add:  h = x + Post₁(Attn(Norm₁(x)));  out = h + Post₂(MLP(Norm₂(h)))."""
    h = x + post1(attn(norm1(x)))
    return h + post2(mlp_fn(norm2(h)))


def post_norm_block(x: np.ndarray, attn, mlp_fn, norm1, norm2) -> np.ndarray:
    """Post-norm block (original Transformer, BERT):  h = Norm₁(x + Attn(x));  out = Norm₂(h +
    MLP(h))."""
    h = norm1(x + attn(x))
    return h if mlp_fn is None else norm2(h + mlp_fn(h))


def parallel_block(x: np.ndarray, attn, mlp_fn, norm1, norm2) -> np.ndarray:
    """Parallel block (GPT-J, GPT-NeoX):  out = x + Attn(Norm₁(x)) + MLP(Norm₂(x)); both branches
    read x."""
    return x + attn(norm1(x)) + mlp_fn(norm2(x))


def _norm_fn(config, state: dict[str, np.ndarray], prefix: str):
    """The configured norm with the weights found at `prefix` in the state dict."""
    if config.norm == "rmsnorm":
        return lambda x: rms_norm(x, state[prefix + ".weight"], config.norm_eps)
    return lambda x: layer_norm(
        x, state[prefix + ".weight"], state.get(prefix + ".bias"), config.norm_eps
    )


def transformer_forward(
    config,
    state: dict[str, np.ndarray],
    ids: np.ndarray,
    *,
    token_type_ids: np.ndarray | None = None,
    attention_mask: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> np.ndarray:
    """The whole model for ids (B, T): logits (B, T, d_vocab) if config.causal, else hidden states
    (B, T, d_model).

        x₀ = E[ids] (· √d_model if scale_embed) · embedding_multiplier (+ P[pos] learned | + PE(pos)
        sinusoidal)
        (+ token-type embedding) (then Norm if embed_norm)
        x_{l+1} = Block_l(x_l)           (pre- or post-norm; RoPE inside attention when positional
        == "rope")
        logits  = Norm_final(x_L) W_Uᵀ · logit_scale   (W_U = E when the embeddings are tied)
        logits  = c · tanh(logits / c)   (only with a logit soft-cap c)

    `state` is a model's state dict as NumPy arrays; attention_mask (B, T) is 1 for real tokens.
    """
    B, T = ids.shape
    if positions is None:
        positions = np.broadcast_to(np.arange(T), (B, T))
    out = []
    for b in range(B):
        x = state["embed.weight"][ids[b]]
        if config.scale_embed:  # Vaswani et al. §3.4; Gemma
            x = x * np.sqrt(config.d_model)
        x = x * config.embedding_multiplier  # Granite
        if config.positional == "learned":
            x = x + state["pos_embed.weight"][positions[b]]
        elif config.positional == "sinusoidal":
            x = x + sinusoidal_positions(positions[b], config.d_model)
        if config.n_token_types:
            types = token_type_ids[b] if token_type_ids is not None else np.zeros(T, dtype=int)
            x = x + state["token_type_embed.weight"][types]
        if config.embed_norm:
            x = _norm_fn(config, state, "ln_embed")(x)
        allowed = None
        if attention_mask is not None:
            allowed = np.broadcast_to(attention_mask[b].astype(bool)[None, :], (T, T))
        for layer in range(config.n_layers):
            x = block_forward(config, state, f"blocks.{layer}", x, positions[b], allowed)
        if config.final_norm:
            x = _norm_fn(config, state, "ln_final")(x)
        if config.causal:
            x = linear(
                x,
                state["unembed.weight"] if "unembed.weight" in state else state["embed.weight"],
                state.get("unembed.bias"),  # Phi-2's
            )
            x = x * config.logit_scale  # Granite: 1 / logits_scaling
            if config.logit_softcap is not None:
                x = config.logit_softcap * np.tanh(x / config.logit_softcap)
        out.append(x)
    return np.stack(out)


def block_forward(
    config, state, prefix: str, x: np.ndarray, positions: np.ndarray, allowed
) -> np.ndarray:
    """One block for one sequence x (T, d_model): the pre-norm, post-norm or parallel block of the
    attention, MLP and norms above.

    prefix names the block's weights in `state` ("blocks.0"); positions (T,) feed RoPE; allowed (T,
    T) masks keys.
    """
    a = prefix + ".attn."
    # llama.cpp's swa pattern N: block i is global (no window) when i % N == N − 1; the windowed
    # blocks rotate by their own base where the config gives one
    layer, pattern = int(prefix.rsplit(".", 1)[1]), config.sliding_window_pattern
    window = config.sliding_window
    if pattern is not None and layer % pattern == pattern - 1:
        window = None
    theta = config.rope_theta
    if window is not None and config.rope_theta_local is not None:
        theta = config.rope_theta_local

    def attn(h: np.ndarray) -> np.ndarray:
        return multi_head_attention(
            h,
            state[a + "W_Q.weight"],
            state[a + "W_K.weight"],
            state[a + "W_V.weight"],
            state[a + "W_O.weight"],
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            b_Q=state.get(a + "W_Q.bias"),
            b_K=state.get(a + "W_K.bias"),
            b_V=state.get(a + "W_V.bias"),
            b_O=state.get(a + "W_O.bias"),
            scale=config.scale,
            causal=config.causal,
            allowed=allowed,
            q_norm=state.get(a + "q_norm.weight"),
            k_norm=state.get(a + "k_norm.weight"),
            norm_eps=config.norm_eps,
            softcap=config.attn_softcap,
            qk_norm_whole=config.qk_norm_whole,
            rope=(positions, config.rotary_dim, theta) if config.positional == "rope" else None,
            window=window,
        )

    mlp_fn = None
    if not config.attn_only:
        m = prefix + ".mlp."
        params = {
            "W_in": state[m + "W_in.weight"],
            "b_in": state.get(m + "W_in.bias"),
            "W_out": state[m + "W_out.weight"],
            "b_out": state.get(m + "W_out.bias"),
            "W_gate": state.get(m + "W_gate.weight"),
            "b_gate": state.get(m + "W_gate.bias"),
        }
        mlp_fn = lambda h: mlp(h, params, config.mlp)  # noqa: E731
    block = pre_norm_block if config.norm_placement == "pre" else post_norm_block
    if config.parallel_residual:
        block = parallel_block
    # OLMo 2 (input_norms False): no norm before the sublayers
    norm2 = None if config.attn_only else _norm_fn(config, state, prefix + ".ln2")
    norm1 = _norm_fn(config, state, prefix + ".ln1")
    if not config.input_norms:
        norm1 = norm2 = lambda h: h  # noqa: E731
    r = config.residual_multiplier  # Granite: each sublayer's output times r before the add
    if config.sandwich_norm:
        post1, post2 = (
            (lambda h, norm=_norm_fn(config, state, prefix + name): norm(h) * r)
            for name in (".ln1_post", ".ln2_post")
        )
        return sandwich_norm_block(x, attn, mlp_fn, norm1, norm2, post1, post2)
    scaled_attn = lambda h: attn(h) * r  # noqa: E731
    scaled_mlp = None if mlp_fn is None else (lambda h: mlp_fn(h) * r)
    return block(x, scaled_attn, scaled_mlp, norm1, norm2)
