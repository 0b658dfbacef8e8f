"""The model's one config dataclass and its named presets.

Design choices:
- Frozen and validated in `__post_init__`: a bad config fails at construction with a message that
  names the values and a fix, never later inside a matmul.
- Names are TransformerLens's (d_model, n_heads, d_head, n_layers, n_ctx, d_vocab); the training
  command maps nanoGPT's flag names onto them (see attnlab.training.config).
- Every architecture attnlab loads (GPT-2, GPT-NeoX/Pythia, LLaMA, Qwen2/3, Mistral, BERT) is a
  setting of these fields, so one model class reads all of them.
- The config is saved as JSON in every checkpoint (`to_dict` / `from_dict`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError

POSITIONS = ("learned", "sinusoidal", "rope", "none")
ROPE_SCALINGS = ("none", "linear", "llama3")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
MLPS = ("gelu", "gelu_tanh", "relu", "relu2", "swiglu", "geglu_tanh")
GATED_MLPS = ("swiglu", "geglu_tanh")  # act(W_gate x) ⊙ W_in x


@functools.cache  # the annotations of a class do not change; every ModelConfig asks
def field_types(cls: type) -> dict[str, tuple[Any, bool]]:
    """Each field of the dataclass `cls`: (its type, whether it admits None), from the evaluated
    annotations (typing.get_type_hints), not their text: `int | None` -> (int, True), `str` -> (str,
    False), `dict[str, Any]` -> (dict, False). ModelConfig checks its values by it, and the training
    config generates its flags and checks its config files by it."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = [t for t in typing.get_args(hint) if t is not type(None)] if union else [hint]
        found[f.name] = (
            typing.get_origin(kinds[0]) or kinds[0],
            union and type(None) in typing.get_args(hint),
        )
    return found


@dataclass(frozen=True)
class ModelConfig:
    """A model's shape and parts, saved in every checkpoint: frozen, and validated when it is made
    (a wrong value is a UserError naming it and the fix). `preset(NAME, **overrides)` makes one
    from a named preset; the Model config page of the reference lists every field."""

    d_vocab: int = 256  # vocabulary size: rows of the embedding, columns of the LM head
    # longest sequence the model is built for (size of learned position table, KV cache)
    n_ctx: int = 256
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # number of blocks
    n_heads: int = 4  # query heads per attention layer
    # key/value heads: n_heads = multi-head, 1 = multi-query, else grouped-query
    n_kv_heads: int | None = None
    # size of one head's q, k and v (d_k = d_v); default d_model // n_heads
    d_head: int | None = None
    # hidden width of the MLP; default 4 * d_model ("expands ~4x and back")
    d_mlp: int | None = None
    causal: bool = True  # decoder (causal mask, LM head) or encoder (bidirectional, BERT-style)
    positional: str = "learned"  # learned | sinusoidal | rope | none
    rope_theta: float = 10000.0  # RoPE base: angle of pair i is pos * theta^(-2i/rotary_dim)
    rotary_fraction: float = 1.0  # fraction of each head's dims that RoPE rotates (partial rotary)
    # none | linear (every angle / factor) | llama3 (Llama 3.1: long wavelengths / factor)
    rope_scaling: str = "none"
    # how much longer than pretraining the context is meant to get (linear, llama3)
    rope_scaling_factor: float = 1.0
    # llama3: wavelengths above rope_original_n_ctx / this are divided by the factor
    rope_low_freq_factor: float = 1.0
    # llama3: wavelengths below rope_original_n_ctx / this stay; between, a blend
    rope_high_freq_factor: float = 4.0
    rope_original_n_ctx: int | None = None  # llama3: the context of pretraining; default n_ctx
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    norm_placement: str = "pre"  # pre (GPT-2, LLaMA) or post (original Transformer, BERT)
    # attention and MLP both read resid_pre and add to it (GPT-J, GPT-NeoX/Pythia)
    parallel_residual: bool = False
    final_norm: bool = True  # a norm after the last block (pre-norm models need it; BERT has none)
    # pre-norm blocks whose attention and MLP outputs are normed again before they join the residual
    # stream (ln1_post, ln2_post: Gemma 2/3; CogView's "sandwich" LayerNorm, Ding et al. 2021)
    sandwich_norm: bool = False
    # the norms before attention and the MLP (ln1, ln2); False, with sandwich_norm: only the norms
    # after them (OLMo 2: resid_mid = resid_pre + ln1_post(attn(resid_pre)))
    input_norms: bool = True
    # the token embedding times √d_model before the first block (Vaswani et al. 2017, §3.4; Gemma),
    # the LM head reading the unscaled table
    scale_embed: bool = False
    embed_norm: bool = False  # a norm right after the embeddings (BERT's embeddings.LayerNorm)
    # gelu (exact erf) | gelu_tanh (GPT-2's gelu_new) | relu | relu2 (ReLU², Primer) | swiglu
    # (LLaMA: silu(W_gate x) ⊙ W_in x) | geglu_tanh (Gemma: gelu_tanh(W_gate x) ⊙ W_in x)
    mlp: str = "gelu"
    attn_only: bool = False  # no MLPs at all: attention-only models for circuit studies
    bias: bool = True  # biases in the linear layers and LayerNorms (nanoGPT's --bias)
    # biases on W_Q, W_K, W_V only; default: same as `bias` (Qwen2: True alone)
    qkv_bias: bool | None = None
    # causal only: each query sees itself and the W − 1 keys before it (Mistral)
    sliding_window: int | None = None
    # with sliding_window: every Nth block (N − 1, 2N − 1, ...) is global, it sees every earlier
    # key, and the others have the window (Gemma 3: 6, llama.cpp's swa pattern); None: all windowed
    sliding_window_pattern: int | None = None
    # RoPE base of the windowed blocks, which then take no rope_scaling (Gemma 3: 10,000, where
    # the global blocks have rope_theta 1,000,000); None: rope_theta and its scaling everywhere
    rope_theta_local: float | None = None
    qk_norm: bool = False  # RMSNorm on each head's q and k before the scores (Qwen3, Gemma 3)
    # with qk_norm: one RMSNorm over the whole of q (heads · d_head) and one over k, not each head
    # (OLMo 2)
    qk_norm_whole: bool = False
    # the scores c·tanh(scores / c) before the mask (Gemma 2's attn_logit_softcapping); None: no
    # cap
    attn_softcap: float | None = None
    tie_embeddings: bool = True  # LM head shares its weight with the token embedding
    # logits = c·tanh(logits / c) (Gemma 2, modded-nanogpt); None = no cap
    logit_softcap: float | None = None
    # W_O and W_out start at zero, so every block starts as the identity
    zero_init_projections: bool = False
    n_token_types: int = 0  # token-type (segment) embeddings: BERT uses 2; 0 = none
    dropout: float = 0.0  # on embeddings, attention weights and residual branches while training
    # multiplier of q.k; default 1/sqrt(d_head), the chapter's 1/sqrt(d_k)
    attn_scale: float | None = None
    init_std: float = 0.02  # std of the normal init of weights (GPT-2)
    # format-specific notes (e.g. HF ids)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # mixture of experts (attnlab.model.moe; TransformerLens's num_experts): each block's MLP is
    # n_experts SwiGLU experts of width d_mlp and a router; 0 = one dense MLP
    n_experts: int = 0
    experts_per_token: int = 0  # how many experts the router picks for each token (top-k)
    # the picked experts' router weights divided by their sum (Mixtral always; Qwen's
    # norm_topk_prob), else the softmax's own values
    norm_topk_prob: bool = True
    # width of an expert every token goes through, times sigmoid(w · x) (Qwen2-MoE); 0 = none
    d_shared_expert: int = 0
    # Granite's multipliers (IBM Granite 3): the token embedding times this before the first block
    # (after scale_embed's √d_model)
    embedding_multiplier: float = 1.0
    # each sublayer's output (attn_out, mlp_out: the hooks see it) times this before it joins the
    # residual stream
    residual_multiplier: float = 1.0
    # the logits times this, before any soft-cap (Granite: 1 / logits_scaling)
    logit_scale: float = 1.0
    unembed_bias: bool = False  # a bias on the LM head (Phi-2's lm_head.bias)

    def __post_init__(self) -> None:
        positive = ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads", "d_head", "d_mlp")
        for name in positive:
            value = getattr(self, name)
            if value is None and name in ("d_head", "d_mlp"):  # optional: derived from d_model
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        self._check_types()
        if self.init_std < 0:
            raise UserError(f"init_std must be >= 0, got {self.init_std}")
        if self.d_head is None and self.d_model % self.n_heads:
            near = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            near = sorted(near, key=lambda h: abs(h - self.n_heads))[:2]
            raise UserError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"try n_heads={' or '.join(map(str, sorted(near)))}"
            )
        if self.n_kv_heads is not None and (
            not isinstance(self.n_kv_heads, int) or isinstance(self.n_kv_heads, bool)
        ):
            raise UserError(
                "n_kv_heads must be a positive integer (or None for n_heads), got "
                f"{self.n_kv_heads!r}"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise UserError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
                f"try n_kv_heads=1 (multi-query) or n_kv_heads={self.n_heads} (multi-head)"
            )
        self._resolve_sizes()
        for name, allowed in (
            ("positional", POSITIONS),
            ("norm", NORMS),
            ("norm_placement", NORM_PLACEMENTS),
            ("mlp", MLPS),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(
                    f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise UserError(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction}")
        if self.positional == "rope" and self.rotary_dim % 2:
            raise UserError(
                f"RoPE rotates pairs of dimensions, but rotary_fraction ({self.rotary_fraction}) "
                "x d_head "
                f"({self.d_head}) = {self.rotary_dim} is odd; choose a fraction that gives an "
                "even number"
            )
        if self.rope_scaling not in ROPE_SCALINGS:
            raise UserError(
                f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}; got {self.rope_scaling!r}"
            )
        if self.rope_scaling != "none" and self.positional != "rope":
            raise UserError(
                f"rope_scaling={self.rope_scaling!r} scales RoPE's angles, but "
                f"positional={self.positional!r}; "
                "use positional='rope' or rope_scaling='none'"
            )
        if not self.rope_scaling_factor > 0:
            raise UserError(f"rope_scaling_factor must be > 0, got {self.rope_scaling_factor}")
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise UserError(
                "llama3 RoPE scaling needs 0 < rope_low_freq_factor "
                f"({self.rope_low_freq_factor}) < "
                f"rope_high_freq_factor ({self.rope_high_freq_factor})"
            )
        if self.rope_original_n_ctx is not None and (
            not isinstance(self.rope_original_n_ctx, int) or self.rope_original_n_ctx <= 0
        ):
            raise UserError(
                "rope_original_n_ctx must be a positive integer (or None for n_ctx), got "
                f"{self.rope_original_n_ctx!r}"
            )
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise UserError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int)
            or isinstance(self.sliding_window, bool)
            or self.sliding_window <= 0
            or not self.causal
        ):
            raise UserError(
                "sliding_window must be a positive integer on a causal model (or None: every "
                "earlier key); "
                f"got {self.sliding_window!r} with causal={self.causal}"
            )
        if self.sliding_window_pattern is not None and (
            not isinstance(self.sliding_window_pattern, int)
            or isinstance(self.sliding_window_pattern, bool)
            or self.sliding_window_pattern < 2
            or self.sliding_window is None
        ):
            raise UserError(
                "sliding_window_pattern must be an integer >= 2 with a sliding_window (every Nth "
                f"block global); got {self.sliding_window_pattern!r} with sliding_window="
                f"{self.sliding_window!r}"
            )
        if self.rope_theta_local is not None and (
            self.positional != "rope"
            or self.sliding_window is None
            or not self.rope_theta_local > 0
        ):
            raise UserError(
                "rope_theta_local is the RoPE base of the sliding-window blocks: it needs "
                "positional='rope', a sliding_window and a positive value; got "
                f"{self.rope_theta_local!r} with positional={self.positional!r}, sliding_window="
                f"{self.sliding_window!r}"
            )
        if self.sandwich_norm and (self.wiring != "pre" or self.attn_only):
            raise UserError(
                "sandwich_norm norms the attention and MLP outputs of pre-norm blocks; got "
                f"norm_placement={self.norm_placement!r}, parallel_residual="
                f"{self.parallel_residual}, attn_only={self.attn_only}"
            )
        if self.parallel_residual and (self.norm_placement != "pre" or self.attn_only):
            raise UserError(
                "parallel_residual needs pre-norm blocks with an MLP (attention and MLP both read "
                "resid_pre); "
                f"got norm_placement={self.norm_placement!r}, attn_only={self.attn_only}"
            )
        for name in ("logit_softcap", "attn_softcap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise UserError(
                    f"{name} must be a positive number (or None for no cap), got "
                    f"{getattr(self, name)}"
                )
        if not self.input_norms and not self.sandwich_norm:
            raise UserError(
                "input_norms=False leaves a block with no norm; it needs sandwich_norm=True (the "
                "norms after attention and the MLP, OLMo 2's)"
            )
        if self.qk_norm_whole and not self.qk_norm:
            raise UserError("qk_norm_whole says what qk_norm spans; set qk_norm=True with it")
        for name in ("embedding_multiplier", "residual_multiplier", "logit_scale"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be a positive number, got {getattr(self, name)}")
        if self.n_token_types < 0:
            raise UserError(f"n_token_types must be >= 0, got {self.n_token_types}")
        self._check_experts()

    def _check_experts(self) -> None:
        """A mixture of experts (n_experts > 0) picks 1 to n_experts experts per token, each a
        SwiGLU MLP without biases (Mixtral's and Qwen-MoE's)."""
        if self.n_experts < 0 or self.d_shared_expert < 0:
            raise UserError(
                f"n_experts ({self.n_experts}) and d_shared_expert ({self.d_shared_expert}) must "
                "be >= 0"
            )
        if not self.n_experts:
            if self.d_shared_expert:
                raise UserError(
                    f"d_shared_expert={self.d_shared_expert} is a mixture of experts' shared "
                    "expert; set n_experts too, or d_shared_expert=0"
                )
            return
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise UserError(
                f"experts_per_token must be 1 to n_experts ({self.n_experts}), got "
                f"{self.experts_per_token}; Mixtral picks 2"
            )
        if self.mlp != "swiglu" or self.bias or self.attn_only:
            raise UserError(
                "a mixture of experts has SwiGLU experts without biases: it needs mlp='swiglu', "
                f"bias=False and attn_only=False; got mlp={self.mlp!r}, bias={self.bias}, "
                f"attn_only={self.attn_only}"
            )

    def _check_types(self) -> None:
        """Each field holds what its annotation says (an integer, a finite number, true/false, a
        string, or None where allowed): a config read from a file is untrusted, and a string where a
        number goes must fail here, with the field's name, not inside torch while the model is
        built."""
        described = {
            bool: "true or false",
            int: "an integer",
            float: "a finite number",
            str: "a string",
        }
        checked = {
            "d_vocab",
            "n_ctx",
            "d_model",
            "n_layers",
            "n_heads",
            "d_head",
            "d_mlp",
            "n_kv_heads",
            "rope_original_n_ctx",
        }  # these have their own checks, with their own messages
        for name, (kind, nullable) in field_types(type(self)).items():
            value = getattr(self, name)
            if name in checked or kind not in described or (value is None and nullable):
                continue
            if kind is bool:
                ok = isinstance(value, bool)
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif kind is float:
                ok = (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and math.isfinite(value)
                )
            else:
                ok = isinstance(value, str)
            if not ok:
                allowed = described[kind] + (" (or null)" if nullable else "")
                raise UserError(f"{name} must be {allowed}, got {value!r}")

    def _resolve_sizes(self) -> None:
        """d_head, n_kv_heads and d_mlp given as None take their defaults here (d_model // n_heads,
        n_heads, 4 * d_model), so that every reader has one name for each size, the glossary's."""
        defaults = {
            "d_head": self.d_model // self.n_heads,
            "n_kv_heads": self.n_heads,
            "d_mlp": 4 * self.d_model,
        }
        # which were left to their defaults: `replace` derives them again, and `to_dict` (a config
        # file) and equality keep them as None, as they were given
        derived = frozenset(name for name in defaults if getattr(self, name) is None)
        for name in derived:
            object.__setattr__(self, name, defaults[name])
        object.__setattr__(self, "_derived", derived)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelConfig):
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(tuple(self._compared().values()))

    def _compared(self) -> dict[str, Any]:
        # extra: compare=False
        return {name: value for name, value in self.given().items() if name != "extra"}

    @property
    def wiring(self) -> str:
        """How each block joins its attention and MLP to the residual stream: the one description of
        the block that Block.forward, the kernel decode program (attnlab.generate.kernel_decoder)
        and the explorer's stages read.
        pre (GPT-2, LLaMA): resid_mid = resid_pre + attn(ln1(resid_pre));
            resid_post = resid_mid + mlp(ln2(resid_mid))
        post (original Transformer, BERT): resid_mid = ln1(resid_pre + attn(resid_pre));
            resid_post = ln2(resid_mid + mlp(resid_mid))
        parallel (GPT-J, GPT-NeoX/Pythia):
            resid_post = resid_pre + attn(ln1(resid_pre)) + mlp(ln2(resid_pre)),
            no resid_mid (hook_resid_mid never fires, as in TransformerLens).
        An attention-only block (attn_only) stops at resid_mid, which is its resid_post.
        With sandwich_norm (pre only, Gemma): attn_out = ln1_post(attn(ln1(resid_pre))) and
            mlp_out = ln2_post(mlp(ln2(resid_mid))), the hooks' attn_out and mlp_out being what
            joins the residual stream (as TransformerLens's ln1_post / ln2_post); without
            input_norms (OLMo 2) ln1 and ln2 are absent: attn_out = ln1_post(attn(resid_pre)),
            mlp_out = ln2_post(mlp(resid_mid))."""
        return "parallel" if self.parallel_residual else self.norm_placement

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block `layer`, None where it sees every earlier key: the one place
        that says which blocks are windowed (llama.cpp's swa pattern: with N, block i is global
        when i % N == N − 1)."""
        pattern = self.sliding_window_pattern
        if pattern is not None and layer % pattern == pattern - 1:
            return None
        return self.sliding_window

    def layer_rope_local(self, layer: int) -> bool:
        """Whether block `layer` rotates by the windowed blocks' RoPE (rope_theta_local)."""
        return self.rope_theta_local is not None and self.layer_window(layer) is not None

    @property
    def gated_mlp(self) -> bool:
        """act(W_gate x) ⊙ W_in x (SwiGLU, GeGLU), where the plain MLP is act(W_in x)."""
        return self.mlp in GATED_MLPS

    @property
    def use_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def rotary_dim(self) -> int:
        return int(round(self.d_head * self.rotary_fraction))

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.d_head)

    def given(self) -> dict[str, Any]:
        """The fields as given: None for the sizes left to their defaults."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {**values, **{name: None for name in self._derived}}

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with `changes`; a size left to its default is derived again (replace(d_model=256)
        doubles it)."""
        return type(self)(**{**self.given(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.given())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"unknown model config keys {unknown}; known keys: {sorted(names)}")
        return cls(**data)


PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's CPU Shakespeare configuration (its README's "baby GPT on a MacBook").
    "nano": dict(n_layers=4, n_heads=4, d_model=128, n_ctx=64),
    # nanoGPT's shakespeare_char GPU config.
    "shakespeare": dict(n_layers=6, n_heads=6, d_model=384, n_ctx=256),
    "gpt2-small": dict(
        n_layers=12, n_heads=12, d_model=768, n_ctx=1024, d_vocab=50257, mlp="gelu_tanh"
    ),
    # A modern small decoder: the LLaMA recipe at toy size.
    "llama-tiny": dict(
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_model=128,
        d_mlp=344,
        n_ctx=256,
        positional="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tie_embeddings=False,
    ),
    # MiniLM-L6's shape: a post-norm BERT-style encoder.
    "bert-mini": dict(
        n_layers=6,
        n_heads=12,
        d_model=384,
        d_mlp=1536,
        n_ctx=512,
        d_vocab=30522,
        causal=False,
        norm_placement="post",
        final_norm=False,
        embed_norm=True,
        n_token_types=2,
        norm_eps=1e-12,
        tie_embeddings=False,
    ),
    # Attention-only models for induction-head studies (Olsson et al. 2022).
    "attn-only-2l": dict(
        n_layers=2, n_heads=8, d_model=256, n_ctx=256, attn_only=True, positional="learned"
    ),
}
"""The named presets `preset` starts from: name -> the ModelConfig fields it sets."""


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset, with any field overridden: `preset("nano", d_vocab=65)`."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
