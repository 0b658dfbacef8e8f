"""Activation patching sweeps: which activations, moved from a clean run into a corrupted one,
restore the answer.

Design choices (TransformerLens's transformer_lens/patching.py, and the "Interpretability in the
Wild" (IOI) patching plots of Wang et al. 2022):
- One loop, `generic_activation_patch`: for every index (layer first, then position and/or head) it
  runs the model on the corrupted tokens with that slice of one activation replaced by the clean
  run's, and records `patching_metric(logits)`. The named sweeps (TransformerLens's names) differ
  only in the activation and the slice:
      resid_pre / resid_mid / attn_out / mlp_out     [layer, pos]        one position of the stream
      attn_head_{out,q,k,v}_all_pos                   [layer, head]       one head at every position
      attn_head_pattern_all_pos                       [layer, head]
      attn_head_{out,q,k,v}_by_pos                    [layer, pos, head]  one head at one position
      attn_head_pattern_by_pos                        [layer, head, dest_pos]
  A head's "out" is its z (hook_z: before W_O mixes the heads). Grouped-query models have fewer
  key/value
  heads: their k and v sweeps run over those (and read NaN for the others in the stacked "every"
  sweeps).
- Each sweep returns a PatchingResult: the values, the names of the axes, labels for each axis
  (layer numbers, "L0H3", and the clean run's tokens for positions), the clean and corrupted metrics
  when known, and `plot(path)`, a red-blue heat map (PNG) centred on zero, as the IOI figures are.
- Patch everything and the corrupted run becomes the clean one (the clean metric); patch nothing and
  it stays the corrupted one; both are tested. A sweep never writes into the activations it is
  given.
- Two paths give the same values (tested against each other on every model style). The reference
  path runs the whole model once per index, as TransformerLens does. The fast path does not
  recompute what a patch cannot change: a patch in block L leaves the residual stream going into
  block L as the corrupted run had it, so each patched run starts there (`start_at_layer`, from the
  corrupted run's cached resid_pre), and the patched runs of one layer go through the model
  together, `batch_size` of them stacked along the batch axis (each a copy of the corrupted input,
  with its own slice patched, and the metric read on its own rows). A metric that reads the logits
  at one position and says so (`logits_position`, as `logit_diff_metric` does) gets that
  position's logits only, unembedded for it alone (the other positions of the tensor it gets are
  views of the same row); any other metric gets every position's. It applies to this module's
  setters on an eval-mode model with no hooks attached to any of its modules; anything else (a
  caller's own setter, attached hooks, training mode) takes the reference path, and the result
  says which (`notes["path"]`, `notes["why"]`, a log line); `path="fast"` refuses instead.
- Every pass of a sweep needs no gradients and runs in the C kernels' layers
  (attnlab.generate.fast_layers.inference_layers, entered here for each pass with its own input),
  whichever Transformer class the model has.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..generate.fast_layers import inference_layers
from ..lens.names import get_act_name
from .experiments.common import new_figure, save_figure

Metric = Callable[[torch.Tensor], torch.Tensor]
Setter = Callable[[torch.Tensor, tuple[int, ...], torch.Tensor], torch.Tensor]
PATHS = ("auto", "fast", "reference")
# the fast path stacks patched runs until their logits would pass this many bytes, or their
# tokens this many
LOGITS_BUDGET = 256 * 2**20
STACK_TOKENS = 4096

logger = logging.getLogger(__name__)


@dataclass
class PatchingResult:
    """The metric after each patch: `values` with one axis per name in `axis_names`."""

    values: torch.Tensor
    axis_names: tuple[str, ...]
    labels: dict[str, list[str]]
    activation: str
    clean: float | None = None  # the metric on the clean run
    corrupted: float | None = None  # the metric on the corrupted run (no patch)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def __getitem__(self, index) -> torch.Tensor:
        return self.values[index]

    def normalized(self) -> torch.Tensor:
        """(value − corrupted) / (clean − corrupted): 0 = no effect, 1 = the patch restores the
        clean run."""
        if self.clean is None or self.corrupted is None:
            raise UserError(
                "normalized() needs the clean and corrupted metrics; pass clean_metric= to the "
                "sweep"
            )
        return (self.values - self.corrupted) / (self.clean - self.corrupted)

    def to_dict(self) -> dict[str, Any]:
        return {
            "activation": self.activation,
            "axes": list(self.axis_names),
            "labels": self.labels,
            "values": [None if v != v else v for v in self.values.flatten().tolist()],
            "shape": list(self.values.shape),
            "clean": self.clean,
            "corrupted": self.corrupted,
            "path": self.notes.get("path"),  # the sweep's path: fast or reference (or mixed)
        }

    def plot(
        self, path: str | Path, title: str | None = None, normalize: bool | None = None
    ) -> Path:
        """Write the heat map(s) as a PNG: one panel per leading 'activation' entry, rows and
        columns labelled."""
        normalize = (
            self.clean is not None and self.corrupted is not None
            if normalize is None
            else normalize
        )
        values = self.normalized() if normalize else self.values
        panels = _panels(self, values)
        cols = len(panels)
        rows_max = max(len(p[1]) for p in panels)
        cols_max = max(len(p[2]) for p in panels)
        size = (max(4.0, 1.6 + 0.38 * cols_max) * cols, max(2.6, 1.4 + 0.3 * rows_max))
        fig, axes = new_figure(1, cols, size)
        finite = values[torch.isfinite(values)]
        limit = float(finite.abs().max()) if finite.numel() else 1.0
        limit = 1.0 if normalize and limit <= 1.0 else (limit or 1.0)
        for ax, (name, row_labels, col_labels, matrix, row_axis, col_axis) in zip(axes[0], panels):
            image = ax.imshow(
                matrix.float().numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto"
            )
            ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7)
            ax.set_xticks(
                range(len(col_labels)),
                col_labels,
                fontsize=7,
                rotation=90 if col_axis == "pos" else 0,
            )
            ax.set_xlabel(col_axis)
            ax.set_ylabel(row_axis)
            ax.set_title(name, fontsize=9)
            fig.colorbar(image, ax=ax, shrink=0.8)
        what = "(patched − corrupted) / (clean − corrupted)" if normalize else "metric"
        fig.suptitle(
            title or f"activation patching: {self.activation}; {what}", fontsize=10, y=1.04
        )
        path = Path(path)
        save_figure(fig, path)
        return path


def _panels(result: PatchingResult, values: torch.Tensor):
    """(title, row labels, column labels, 2-D matrix, row axis, column axis) per panel of the
    plot."""
    axes = list(result.axis_names)
    if axes[0] == "activation":  # one panel per stacked sweep
        inner = [
            PatchingResult(v, tuple(axes[1:]), result.labels, name)
            for v, name in zip(values, result.labels["activation"])
        ]
        return [panel for r in inner for panel in _panels(r, r.values)]
    if len(axes) == 2:
        return [
            (
                result.activation,
                result.labels[axes[0]],
                result.labels[axes[1]],
                values,
                axes[0],
                axes[1],
            )
        ]
    # three axes: rows are the heads of every layer ("L1H3"), columns the position
    if axes == ["layer", "pos", "head"]:
        matrix = values.permute(0, 2, 1).flatten(0, 1)  # [layer · head, pos]
        col_axis, cols = "pos", result.labels["pos"]
    else:  # ["layer", "head", "dest_pos"]
        matrix = values.flatten(0, 1)
        col_axis, cols = "dest_pos", result.labels["dest_pos"]
    heads = len(result.labels["head"])
    rows = [f"L{l}H{h}" for l in range(values.shape[0]) for h in range(heads)]
    return [(result.activation, rows, cols, matrix, "head", col_axis)]


# The one loop
# --------------------------------------------------------------------------------------------------
def generic_activation_patch(
    model,
    corrupted_tokens: torch.Tensor,
    clean_cache,
    patching_metric: Metric,
    patch_setter: Setter,
    activation_name: str,
    index_axis_names: Sequence[str],
    *,
    clean_metric: float | None = None,
    pos_labels: list[str] | None = None,
    progress: bool = False,
    path: str = "auto",
    batch_size: int | None = None,
) -> PatchingResult:
    """Patch `activation_name` of every layer, at every index over `index_axis_names` (layer first),
    from clean_cache into the run on corrupted_tokens; record patching_metric(logits) (a scalar) for
    each.
    clean_metric: the metric on the clean run (for normalized()); pos_labels: the positions' tick
    labels (default: the corrupted tokens).
    path: "auto" (the fast path where it applies, else the reference one), "fast" (refuse where it
    does not apply) or "reference" (one whole forward pass per index, as TransformerLens runs).
    batch_size: patched runs per forward pass on the fast path (default: as many of one layer's as
    keep their logits under LOGITS_BUDGET bytes and their tokens under STACK_TOKENS)."""
    if path not in PATHS:
        raise UserError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    cfg = model.config
    if corrupted_tokens.dim() == 1:
        corrupted_tokens = corrupted_tokens[None]
    T = corrupted_tokens.shape[-1]
    clean_T = (
        clean_cache["resid_pre", 0].shape[-2] if "blocks.0.hook_resid_pre" in clean_cache else T
    )
    if clean_T != T:
        raise UserError(
            f"the clean run has {clean_T} tokens and the corrupted one {T}; patching needs inputs "
            "of the "
            "same length (pad or reword the prompts)"
        )
    n_heads = cfg.n_kv_heads if activation_name in ("k", "v") else cfg.n_heads
    ranges = {"layer": cfg.n_layers, "pos": T, "dest_pos": T, "head": n_heads}
    shape = [ranges[a] for a in index_axis_names]
    values = torch.full(shape, float("nan"), dtype=torch.float64)
    if activation_name == "resid_mid" and cfg.wiring == "parallel":
        raise UserError(
            "this model's blocks run attention and MLP in parallel: there is no resid_mid to "
            "patch; "
            "patch resid_pre, attn_out or mlp_out"
        )
    names = [get_act_name(activation_name, l) for l in range(cfg.n_layers)]
    for name in names:
        model._resolve(name)  # an unknown activation: one line naming the nearest
        if name not in clean_cache:
            raise UserError(
                f"the clean cache has no {name}; run the clean input with run_with_cache() "
                "and no names_filter (or one that keeps it)"
            )
    from tqdm.auto import tqdm

    def scalar(logits: torch.Tensor) -> float:
        out = torch.as_tensor(patching_metric(logits))
        if out.numel() != 1:
            raise UserError(
                "the patching metric must return one number, got a tensor of shape "
                f"{tuple(out.shape)}"
            )
        return float(out)

    indices = list(itertools.product(*(range(n) for n in shape)))
    why = _why_not_fast(model, patch_setter)
    if why is not None and path == "fast":
        raise UserError(f"the fast patching path does not apply: {why}; pass path='auto'")
    fast = why is None and path != "reference"
    if path == "reference":
        why = "path='reference' was asked for"
    bar = tqdm(
        total=len(indices), desc=f"patch {activation_name}", disable=not progress, leave=False
    )
    with torch.no_grad(), bar:
        if fast:
            corrupted = _fast_sweep(
                model,
                corrupted_tokens,
                clean_cache,
                scalar,
                patch_setter,
                activation_name,
                indices,
                values,
                batch_size,
                logits_position(patching_metric, T),
                bar,
            )
        else:
            with inference_layers(model, corrupted_tokens):
                logits = model(corrupted_tokens)
            corrupted = scalar(logits)
            for index in indices:
                name = get_act_name(activation_name, index[0])
                clean = clean_cache[name]

                def hook(activation: torch.Tensor, hook, index=index, clean=clean) -> torch.Tensor:
                    return patch_setter(activation.clone(), index, clean.to(activation.dtype))

                with model.hooks([(name, hook)]), inference_layers(model, corrupted_tokens):
                    logits = model(corrupted_tokens)
                values[index] = scalar(logits)
                bar.update()
    notes = {"path": "fast" if fast else "reference"}
    if fast and logits_position(patching_metric, T) is not None:
        notes["logits"] = f"position {patching_metric.logits_position} only"
    if not fast:
        notes["why"] = why
    logger.info(
        "patch %s: %s path%s", activation_name, notes["path"], f" ({why})" if not fast else ""
    )
    labels = axis_labels(model, corrupted_tokens, n_heads, pos_labels)
    return PatchingResult(
        values, tuple(index_axis_names), labels, activation_name, clean_metric, corrupted, notes
    )


def _why_not_fast(model, patch_setter: Setter) -> str | None:
    """Why the fast path cannot stand in for the reference one here, or None when it can."""
    if patch_setter not in SETTERS:
        # a caller's setter may read or write across the batch, which the stacked runs share
        name = getattr(patch_setter, "__name__", patch_setter)
        return f"patch_setter {name!r} is the caller's own"
    if model.training:
        return "the model is in training mode (dropout would differ between the paths)"
    hooked = [
        name
        for name, module in model.named_modules()
        if module._forward_hooks or module._forward_pre_hooks
    ]
    if hooked:
        # such a hook would run once for all the stacked runs, and not at all before the patch
        return f"hooks are attached to the model ({', '.join(hooked[:3])})"
    return None


def _fast_sweep(
    model,
    corrupted_tokens: torch.Tensor,
    clean_cache,
    scalar: Callable[[torch.Tensor], float],
    patch_setter: Setter,
    activation_name: str,
    indices: list[tuple[int, ...]],
    values: torch.Tensor,
    batch_size: int | None,
    position: int | None,
    bar,
) -> float:
    """The fast path (module docstring): fill `values` at `indices`; return the corrupted metric.

    Patched run i of a stack holds batch rows i·B ... (i+1)·B − 1, B the corrupted batch."""
    cfg = model.config
    resid_names = [get_act_name("resid_pre", l) for l in range(cfg.n_layers)]
    with inference_layers(model, corrupted_tokens):
        logits, corrupted_cache = model.run_with_cache(corrupted_tokens, names_filter=resid_names)
    corrupted = scalar(logits)
    B, T = corrupted_tokens.shape
    if batch_size is None:
        logits_bytes = B * (T if position is None else 1) * logits.shape[-1] * logits.element_size()
        batch_size = max(1, min(LOGITS_BUDGET // logits_bytes, STACK_TOKENS // (B * T)))
    del logits
    for layer, group in itertools.groupby(indices, key=lambda index: index[0]):
        group = list(group)
        name = get_act_name(activation_name, layer)
        clean = clean_cache[name]
        # [B, T, d_model]: no patch in `layer` alters it
        resid = corrupted_cache[resid_names[layer]]
        for start in range(0, len(group), batch_size):
            stack = group[start : start + batch_size]

            def hook(activation: torch.Tensor, hook, stack=stack, clean=clean) -> torch.Tensor:
                activation = activation.clone()  # [len(stack) · B, ...]
                patch = clean.to(activation.dtype)
                for i, index in enumerate(stack):
                    rows = activation[i * B : (i + 1) * B]
                    patched = patch_setter(rows, index, patch)
                    if patched is not rows:
                        rows.copy_(patched)
                return activation

            stacked = resid.repeat(len(stack), *([1] * (resid.dim() - 1)))
            with model.hooks([(name, hook)]), inference_layers(model, stacked, layer):
                if position is None:
                    logits = model(stacked, start_at_layer=layer)
                else:
                    final = model(stacked, start_at_layer=layer, stop_at_layer=cfg.n_layers)
            if position is not None:
                # [len(stack) · B, d_vocab]: the one position the metric reads, seen at every
                # position of a [len(stack) · B, T, d_vocab] view (no copy)
                row = model.logits_from_resid(final[:, position])
                logits = row[:, None, :].expand(-1, T, -1)
            for i, index in enumerate(stack):
                values[index] = scalar(logits[i * B : (i + 1) * B])
            bar.update(len(stack))
    return corrupted


def axis_labels(
    model, tokens: torch.Tensor, n_heads: int, shown: list[str] | None = None
) -> dict[str, list[str]]:
    """Tick labels: layers and heads as numbers, positions as "i: 'token'" (of `shown`, else of
    `tokens`)."""
    T = tokens.shape[-1]
    if shown is None and getattr(model, "tokenizer", None) is not None:
        shown = [model.tokenizer.decode([i]) for i in tokens[0].tolist()]
    pos = [f"{i}: {shown[i]!r}"[:18] if shown else str(i) for i in range(T)]
    return {
        "layer": [str(l) for l in range(model.config.n_layers)],
        "pos": pos,
        "dest_pos": pos,
        "head": [str(h) for h in range(n_heads)],
    }


# What each sweep replaces
# ------------------------------------------------------------------------------------
def layer_pos_patch_setter(activation, index, clean):
    """[batch, pos, ...] at one position."""
    _, pos = index
    activation[:, pos] = clean[:, pos]
    return activation


def layer_head_vector_patch_setter(activation, index, clean):
    """[batch, pos, head, d_head] of one head at every position."""
    _, head = index
    activation[:, :, head] = clean[:, :, head]
    return activation


def layer_pos_head_vector_patch_setter(activation, index, clean):
    """[batch, pos, head, d_head] of one head at one position."""
    _, pos, head = index
    activation[:, pos, head] = clean[:, pos, head]
    return activation


def layer_head_pattern_patch_setter(activation, index, clean):
    """[batch, head, dest_pos, src_pos] of one head."""
    _, head = index
    activation[:, head] = clean[:, head]
    return activation


def layer_head_pos_pattern_patch_setter(activation, index, clean):
    """[batch, head, dest_pos, src_pos] of one head's row for one destination position."""
    _, head, dest = index
    activation[:, head, dest] = clean[:, head, dest]
    return activation


# the setters the fast path knows: each writes rows [batch, ...] of its own index, nothing else
SETTERS = (
    layer_pos_patch_setter,
    layer_head_vector_patch_setter,
    layer_pos_head_vector_patch_setter,
    layer_head_pattern_patch_setter,
    layer_head_pos_pattern_patch_setter,
)


def _sweep(activation: str, setter, axes: tuple[str, ...], doc: str):
    def sweep(model, corrupted_tokens, clean_cache, patching_metric, **kwargs) -> PatchingResult:
        return generic_activation_patch(
            model,
            corrupted_tokens,
            clean_cache,
            patching_metric,
            setter,
            activation,
            axes,
            **kwargs,
        )

    sweep.__doc__ = f"{doc} -> PatchingResult [{', '.join(axes)}] (see generic_activation_patch)."
    return sweep


get_act_patch_resid_pre = _sweep(
    "resid_pre",
    layer_pos_patch_setter,
    ("layer", "pos"),
    "The residual stream into each layer, one position at a time",
)
get_act_patch_resid_mid = _sweep(
    "resid_mid",
    layer_pos_patch_setter,
    ("layer", "pos"),
    "The residual stream between attention and MLP",
)
get_act_patch_attn_out = _sweep(
    "attn_out", layer_pos_patch_setter, ("layer", "pos"), "Each attention layer's output"
)
get_act_patch_mlp_out = _sweep(
    "mlp_out", layer_pos_patch_setter, ("layer", "pos"), "Each MLP's output"
)
get_act_patch_attn_head_out_all_pos = _sweep(
    "z", layer_head_vector_patch_setter, ("layer", "head"), "Each head's output z, all positions"
)
get_act_patch_attn_head_q_all_pos = _sweep(
    "q", layer_head_vector_patch_setter, ("layer", "head"), "Each head's queries, all positions"
)
get_act_patch_attn_head_k_all_pos = _sweep(
    "k",
    layer_head_vector_patch_setter,
    ("layer", "head"),
    "Each (key/value) head's keys, all positions",
)
get_act_patch_attn_head_v_all_pos = _sweep(
    "v",
    layer_head_vector_patch_setter,
    ("layer", "head"),
    "Each (key/value) head's values, all positions",
)
get_act_patch_attn_head_pattern_all_pos = _sweep(
    "pattern", layer_head_pattern_patch_setter, ("layer", "head"), "Each head's attention pattern"
)
get_act_patch_attn_head_out_by_pos = _sweep(
    "z",
    layer_pos_head_vector_patch_setter,
    ("layer", "pos", "head"),
    "Each head's output z at each position",
)
get_act_patch_attn_head_q_by_pos = _sweep(
    "q",
    layer_pos_head_vector_patch_setter,
    ("layer", "pos", "head"),
    "Each head's query at each position",
)
get_act_patch_attn_head_k_by_pos = _sweep(
    "k",
    layer_pos_head_vector_patch_setter,
    ("layer", "pos", "head"),
    "Each (key/value) head's key at each position",
)
get_act_patch_attn_head_v_by_pos = _sweep(
    "v",
    layer_pos_head_vector_patch_setter,
    ("layer", "pos", "head"),
    "Each (key/value) head's value at each position",
)
get_act_patch_attn_head_pattern_by_pos = _sweep(
    "pattern",
    layer_head_pos_pattern_patch_setter,
    ("layer", "head", "dest_pos"),
    "Each head's pattern row for each destination position",
)


def _stack(
    results: list[PatchingResult], names: list[str], n_heads: int | None = None
) -> PatchingResult:
    """Stack sweeps along a leading 'activation' axis (head axes padded with NaN to n_heads)."""
    values = []
    for r in results:
        v = r.values
        if (
            n_heads is not None
            and "head" in r.axis_names
            and v.shape[r.axis_names.index("head")] < n_heads
        ):
            axis = r.axis_names.index("head")
            pad = list(v.shape)
            pad[axis] = n_heads - v.shape[axis]
            v = torch.cat([v, torch.full(pad, float("nan"), dtype=v.dtype)], dim=axis)
        values.append(v)
    first = results[0]
    labels = dict(first.labels, activation=names)
    if n_heads is not None:
        labels["head"] = [str(h) for h in range(n_heads)]
    paths = {name: r.notes.get("path") for name, r in zip(names, results)}
    notes = {"path": paths[names[0]] if len(set(paths.values())) == 1 else "mixed", "paths": paths}
    whys = {name: r.notes["why"] for name, r in zip(names, results) if "why" in r.notes}
    if whys:
        notes["why"] = "; ".join(f"{name}: {why}" for name, why in whys.items())
    return PatchingResult(
        torch.stack(values),
        ("activation", *first.axis_names),
        labels,
        ", ".join(names),
        first.clean,
        first.corrupted,
        notes,
    )


def get_act_patch_block_every(
    model, corrupted_tokens, clean_cache, patching_metric, **kwargs
) -> PatchingResult:
    """resid_pre, attn_out and mlp_out (mlp_out only with MLPs): [activation, layer, pos]."""
    sweeps = [("resid_pre", get_act_patch_resid_pre), ("attn_out", get_act_patch_attn_out)]
    if not model.config.attn_only:
        sweeps.append(("mlp_out", get_act_patch_mlp_out))
    results = [
        fn(model, corrupted_tokens, clean_cache, patching_metric, **kwargs) for _, fn in sweeps
    ]
    return _stack(results, [name for name, _ in sweeps])


def get_act_patch_attn_head_all_pos_every(
    model, corrupted_tokens, clean_cache, patching_metric, **kwargs
) -> PatchingResult:
    """Each head's output, query, key, value and pattern at all positions: [activation, layer,
    head]."""
    sweeps = [
        ("output", get_act_patch_attn_head_out_all_pos),
        ("query", get_act_patch_attn_head_q_all_pos),
        ("key", get_act_patch_attn_head_k_all_pos),
        ("value", get_act_patch_attn_head_v_all_pos),
        ("pattern", get_act_patch_attn_head_pattern_all_pos),
    ]
    results = [
        fn(model, corrupted_tokens, clean_cache, patching_metric, **kwargs) for _, fn in sweeps
    ]
    return _stack(results, [name for name, _ in sweeps], n_heads=model.config.n_heads)


def logit_diff_metric(answer: int, wrong: int, pos: int = -1) -> Metric:
    """logits[:, pos, answer] − logits[:, pos, wrong], averaged over the batch. It reads the
    logits at `pos` only, and says so (`metric.logits_position`), so the fast path unembeds that
    position only."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, pos, answer] - logits[:, pos, wrong]).mean()

    metric.logits_position = pos
    return metric


def logits_position(metric: Metric, T: int) -> int | None:
    """The one position of the logits that `metric` reads, when it says so (an int attribute
    `logits_position`, as logit_diff_metric's), else None: the metric gets the logits of every
    position."""
    position = getattr(metric, "logits_position", None)
    if position is None:
        return None
    if not isinstance(position, int) or not -T <= position < T:
        raise UserError(
            f"the metric's logits_position ({position!r}) is not a position of the {T} tokens; "
            f"give an int from {-T} to {T - 1}"
        )
    return position
