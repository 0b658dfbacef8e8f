"""One token through one block, stage by stage (the trace view): each stage's equation, hook, full
shape and this token's values, in the order the block computes them (ModelConfig.wiring).

Design choices:
- The stages are a table (STAGES), one row per stage: its key and title, its equation, the hook it
  reads (or how it is computed from the cache where the block has no hook for it), the names of the
  tensor's dimensions, and the blocks it belongs to (`when`: pre-norm, post-norm, parallel, RoPE,
  with an MLP). `block_stages` reads the table; nothing else decides what the trace shows.
- A row's title and equation are strings, or functions of the block where the words depend on its
  config (the norm's name, the mask's band).
- A mixture of experts' block shows its router (the scores over every expert, the chosen ones)
  where a dense block shows its MLP's hidden layer: each expert sees only its own tokens, so no
  [pos, d_mlp] tensor exists to show.
- A skipped stage (RoPE on a model without it, the MLP of an attention-only model) has no tensor
  (`dims` None): the page shows the equation alone, saying why.
- The token's values are the full tensor at the token's position: its `pos` axis, or its
  `query_pos` axis for the [head, query_pos, key_pos] scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..model.attention import attention_scores
from .encoding import finite
from .models import ModelEntry


@dataclass(frozen=True)
class TracedBlock:
    """What a stage reads: one block of the model and the cache of one pass through it."""

    cfg: Any  # the model's ModelConfig
    module: torch.nn.Module  # model.blocks[layer]
    cache: Any
    prefix: str  # "blocks.{layer}."
    q: torch.Tensor  # [head, pos, d_head], as the scores used them (after qk-norm and RoPE)
    k: torch.Tensor  # [head, pos, d_head], one row per query head

    @property
    def pre_norm(self) -> bool:
        return self.cfg.wiring in ("pre", "parallel")

    @property
    def parallel(self) -> bool:
        return self.cfg.wiring == "parallel"

    @property
    def has_mlp(self) -> bool:
        return self.module.mlp is not None

    @property
    def normalized(self) -> str:
        """The norm's equation, without its weight (hook_normalized is TransformerLens's: the
        normalized input before the norm's weight and bias)."""
        return "(x − mean) / scale" if self.cfg.norm == "layernorm" else "x / scale"

    def hooked(self, hook: str) -> torch.Tensor:
        return self.cache[self.prefix + hook][0]  # the batch's one text


Text = str | Callable[[TracedBlock], str]


@dataclass(frozen=True)
class Stage:
    """One row of the trace: what it shows (title, equation), where its numbers come from (`hook`
    under blocks.{layer}., or `compute` from the cache where the block has no hook for it), the
    tensor's dimensions (None: a skipped stage, equation only), and which blocks have it."""

    key: str
    title: Text
    equation: Text
    hook: str | None
    dims: tuple[str, ...] | None
    when: Callable[[TracedBlock], bool] = lambda b: True
    compute: Callable[[TracedBlock], torch.Tensor] | None = None

    def show(self, block: TracedBlock, token: int) -> dict[str, Any]:
        title, equation = (
            t if isinstance(t, str) else t(block) for t in (self.title, self.equation)
        )
        if self.dims is None:
            return {
                "key": self.key,
                "title": title,
                "hook": None,
                "shape": None,
                "dims": None,
                "values": None,
                "equation": equation,
            }
        full = block.hooked(self.hook) if self.compute is None else self.compute(block)
        at = self.dims.index("pos" if "pos" in self.dims else "query_pos")
        return {
            "key": self.key,
            "title": title,
            "equation": equation,
            "hook": None if self.hook is None else block.prefix + self.hook,
            "shape": list(full.shape),
            "dims": list(self.dims),
            "values": finite(full.select(at, token).float().tolist()),
        }


RESID = ("pos", "d_model")
HEADS = ("pos", "head", "d_head")
SCORES = ("head", "query_pos", "key_pos")
HIDDEN = ("pos", "d_mlp")


def pre_norm(b: TracedBlock) -> bool:
    return b.pre_norm


def post_norm(b: TracedBlock) -> bool:
    return not b.pre_norm


def sequential_pre_norm(b: TracedBlock) -> bool:
    return b.pre_norm and not b.parallel


def with_rope(b: TracedBlock) -> bool:
    return b.cfg.positional == "rope"


def with_mlp(b: TracedBlock) -> bool:
    return b.has_mlp


def with_dense_mlp(b: TracedBlock) -> bool:
    return b.has_mlp and not b.cfg.n_experts


def with_experts(b: TracedBlock) -> bool:
    """A mixture of experts (attnlab.model.moe): its router's stages replace the dense MLP's."""
    return b.has_mlp and bool(b.cfg.n_experts)


def projection(name: str, label: str) -> Stage:
    """q, k or v of every head."""
    return Stage(
        name,
        label,
        lambda b: (
            f"{name} = (x̂ ⊙ w + b) W_{name.upper()}"
            if b.pre_norm
            else f"{name} = x W_{name.upper()}"
        ),
        f"attn.hook_{name}",
        HEADS,
    )


def rotation(name: str) -> Stage:
    return Stage(
        f"rot_{name}",
        f"RoPE on {name}",
        f"{name} ← rotate({name}, pos · θ)",
        f"attn.hook_rot_{name}",
        HEADS,
        when=with_rope,
    )


def no_rope_equation(b: TracedBlock) -> str:
    added = " (added to the embeddings)" if b.cfg.positional in ("learned", "sinusoidal") else ""
    return f"skipped: positions are {b.cfg.positional}{added}"


def mask_equation(b: TracedBlock) -> str:
    window = b.module.attn.window  # this block's own (Gemma 3 windows 5 blocks in 6)
    band = f" and more than {window - 1} keys back (sliding window {window})" if window else ""
    return (
        f"s ← −∞ above the diagonal{band}"
        if b.cfg.causal
        else "no mask (encoder: every key visible)"
    )


def ln2_equation(b: TracedBlock) -> str:
    source = "x" if b.parallel else "resid_mid"
    equation = f"m̂ = {b.normalized.replace('x', source)}, before its weight"
    if b.parallel:
        equation += "  (parallel block: the MLP reads resid_pre)"
    return equation


def norm_title(n: int) -> Callable[[TracedBlock], str]:
    return lambda b: f"{b.cfg.norm} {n}"


# The block's stages in the order it computes them; each row says which blocks have it.
STAGES: tuple[Stage, ...] = (
    Stage("resid_pre", "residual stream in", "x = resid_pre", "hook_resid_pre", RESID),
    Stage(
        "ln1",
        norm_title(1),
        lambda b: f"x̂ = {b.normalized}, before its weight",
        "ln1.hook_normalized",
        RESID,
        when=lambda b: pre_norm(b) and b.cfg.input_norms,  # (OLMo 2 has none before attention)
    ),
    projection("q", "queries"),
    projection("k", "keys"),
    projection("v", "values"),
    rotation("q"),
    rotation("k"),
    Stage("rope", "RoPE", no_rope_equation, None, None, when=lambda b: not with_rope(b)),
    Stage(
        "scores",
        "scores",
        "s = q kᵀ / √d_head",
        None,
        SCORES,
        compute=lambda b: attention_scores(b.q, b.k, b.cfg.scale, b.cfg.attn_softcap),
    ),
    # the model's own masked scores: apply_mask(raw) in the layer
    Stage("masked", "mask", mask_equation, "attn.hook_attn_scores", SCORES),
    Stage("pattern", "softmax", "a = softmax(s)", "attn.hook_pattern", SCORES),
    Stage("z", "weighted sum", "z = a v", "attn.hook_z", HEADS),
    Stage("attn_out", "W_O", "attn_out = concat(z) W_O", "hook_attn_out", RESID),
    # a parallel block has no resid_mid: the MLP reads x too (as in TransformerLens)
    Stage(
        "resid_mid",
        "residual",
        "resid_mid = x + attn_out",
        "hook_resid_mid",
        RESID,
        when=sequential_pre_norm,
    ),
    Stage(
        "add1",
        "residual",
        "x + attn_out",
        None,
        RESID,
        when=post_norm,
        compute=lambda b: b.hooked("hook_resid_pre") + b.hooked("hook_attn_out"),
    ),
    Stage(
        "resid_mid",
        norm_title(1),
        "resid_mid = norm(x + attn_out)",
        "hook_resid_mid",
        RESID,
        when=post_norm,
    ),
    Stage(
        "mlp", "MLP", "skipped: attention-only model", None, None, when=lambda b: not with_mlp(b)
    ),
    Stage(
        "ln2",
        norm_title(2),
        ln2_equation,
        "ln2.hook_normalized",
        RESID,
        when=lambda b: with_mlp(b) and b.pre_norm and b.cfg.input_norms,
    ),
    Stage(
        "mlp_pre",
        "MLP in",
        lambda b: "h = (m̂ ⊙ w + b) W_in" if b.cfg.mlp != "swiglu" else "h = (m̂ ⊙ w) W_gate",
        "mlp.hook_pre",
        HIDDEN,
        when=with_dense_mlp,
    ),
    Stage(
        "mlp_post",
        "MLP activation",
        lambda b: f"{b.cfg.mlp}(h)",
        "mlp.hook_post",
        HIDDEN,
        when=with_dense_mlp,
    ),
    Stage(
        "router",
        "router",
        "p = softmax((m̂ ⊙ w) W_gate), over every expert",
        "mlp.hook_expert_weights",
        ("pos", "n_experts"),
        when=with_experts,
    ),
    Stage(
        "experts",
        "chosen experts",
        lambda b: f"e = top-{b.cfg.experts_per_token} of p, best first",
        "mlp.hook_expert_indices",
        ("pos", "experts_per_token"),
        when=with_experts,
    ),
    Stage(
        "mlp_out",
        "MLP out",
        lambda b: (
            "mlp_out = act(h) W_out"
            if not b.cfg.n_experts
            else "mlp_out = Σ_j w_j expert_{e_j}(m̂ ⊙ w), w: p at e"
            + (" renormalised" if b.cfg.norm_topk_prob else "")
            + (" + σ(g · m̂) shared(m̂)" if b.cfg.d_shared_expert else "")
        ),
        "hook_mlp_out",
        RESID,
        when=with_mlp,
    ),
    Stage(
        "resid_post",
        "residual",
        "resid_post = x + attn_out + mlp_out",
        "hook_resid_post",
        RESID,
        when=lambda b: with_mlp(b) and b.parallel,
    ),
    Stage(
        "resid_post",
        "residual",
        "resid_post = resid_mid + mlp_out",
        "hook_resid_post",
        RESID,
        when=lambda b: with_mlp(b) and sequential_pre_norm(b),
    ),
    Stage(
        "add2",
        "residual",
        "resid_mid + mlp_out",
        None,
        RESID,
        when=lambda b: with_mlp(b) and post_norm(b),
        compute=lambda b: b.hooked("hook_resid_mid") + b.hooked("hook_mlp_out"),
    ),
    Stage(
        "resid_post",
        norm_title(2),
        "resid_post = norm(resid_mid + mlp_out)",
        "hook_resid_post",
        RESID,
        when=lambda b: with_mlp(b) and post_norm(b),
    ),
)


def block_stages(
    entry: ModelEntry, qkv: tuple[torch.Tensor, ...], cache, layer: int, token: int
) -> list[dict[str, Any]]:
    """The stages of one block for one token, in the order the block computes them (its
    ModelConfig.wiring): the rows of STAGES that this block has."""
    q, k, _ = qkv  # [head, pos, d_head]
    model = entry.model
    block = TracedBlock(model.config, model.blocks[layer], cache, f"blocks.{layer}.", q, k)
    return [stage.show(block, token) for stage in STAGES if stage.when(block)]
