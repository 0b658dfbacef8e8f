"""ActivationCache: a run's activations by hook name, with TransformerLens's views of the residual
stream.

Design choices (definitions from TransformerLens's ActivationCache,
transformer_lens/ActivationCache.py):
- A dict of hook name -> tensor (so `for name in cache`, `cache.items()` work), whose `[...]` also
  takes
  TransformerLens's short keys: `cache["pattern", 0]`, `cache["q", 1, "attn"]`, `cache["resid_pre",
  -1]`, `cache["scale"]` (via attnlab.lens.names.get_act_name). A missing name suggests the nearest
  cached ones.
- The residual stream of a pre-norm model is a sum of what each part wrote into it:
      resid_final = embed + pos_embed + Σ_l (attn_out_l + mlp_out_l),   attn_out_l = Σ_h result_l,h
      + b_O,l
  `decompose_resid` stacks those terms, `accumulated_resid` the partial sums (resid_pre of each
  layer), `stack_head_results` the per-head terms, `get_full_resid_decomposition` every head, every
  neuron (or MLP), the embeddings and the summed biases; each stack sums to the residual stream it
  decomposes (tested). A post-norm model (BERT) has no such sum: these views refuse it with a
  UserError. A model whose blocks run attention and MLP in parallel (GPT-NeoX, Pythia) is the same
  sum without resid_mid: there the MLP reads resid_pre, so "the MLP's input" (mlp_input=True) holds
  nothing of its own layer's attention.
- Per-head results are computed only when asked: from hook_z and W_O when
  `blocks.L.attn.hook_result` is
  not cached (TransformerLens's `compute_head_results`), so the forward pass never builds them by
  default.
- `apply_ln_to_stack` freezes a norm at its cached scale (`ln*.hook_scale`): each term is centred
  (LayerNorm only; RMSNorm does not centre) and divided by the scale the whole stream had, so the
  normalized terms still sum to the normalized stream. As in TransformerLens, the result is BEFORE
  the norm's weight and bias (TransformerLens folds them into the next weights; attnlab keeps raw
  weights and folds the final norm's weight into the token directions instead,
  `model.tokens_to_residual_directions`).
- `logit_attrs(stack, tokens, incorrect_tokens)`: direct logit attribution, each term's
  apply_ln_to_stack dotted with the token's residual direction (minus the incorrect token's). Summed
  over a full decomposition it is the logit (difference) up to the final norm's bias and the
  unembedding bias, which
  no term carries: exactly the logit difference for models without them (LLaMA-style), as in
  TransformerLens.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import torch

from ..errors import UserError
from .names import apply_slice, get_act_name


class ActivationCache(dict):
    """Activations by hook name (a dict), with TransformerLens's keys and residual-stream views."""

    def __init__(
        self, data: dict[str, torch.Tensor], model=None, has_batch_dim: bool = True
    ) -> None:
        super().__init__(data)
        self.model = model
        self.has_batch_dim = has_batch_dim

    # Keys
    # ------------------------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> torch.Tensor:
        if isinstance(key, str) and dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        name = self._name(key)
        if dict.__contains__(self, name):
            return dict.__getitem__(self, name)
        close = difflib.get_close_matches(name, list(self), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        shown = f"{key!r}" + (f" ({name})" if name != key else "")
        raise KeyError(f"{shown} is not in the cache (was it excluded by names_filter?){hint}")

    def _name(self, key: Any) -> str:
        if isinstance(key, str):
            return get_act_name(key)
        if isinstance(key, tuple) and key and isinstance(key[0], str):
            if len(key) > 1 and isinstance(key[1], int) and key[1] < 0:  # cache["resid_post", -1]
                key = (key[0], self._cfg.n_layers + key[1], *key[2:])
            return get_act_name(*key)
        raise KeyError(
            f"cache keys are hook names or (name, layer[, layer_type]) tuples, got {key!r}"
        )

    def __repr__(self) -> str:
        return f"ActivationCache with keys {list(self)}"

    def stack(self, pattern: str) -> torch.Tensor:
        """Stack the entries whose names match a regex with one `{}` for the layer:
        `stack('blocks.{}.attn.hook_pattern')`."""
        regex = re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")
        found = sorted((int(m.group(1)), v) for k, v in self.items() if (m := regex.match(k)))
        if not found:
            raise KeyError(f"no cached names match {pattern!r}")
        return torch.stack([v for _, v in found])

    def remove_batch_dim(self) -> "ActivationCache":
        """Drop the batch axis of a batch-of-one cache (in place, as TransformerLens does); returns
        self."""
        if not self.has_batch_dim:
            return self
        sizes = {v.shape[0] for v in self.values() if v.dim() > 0}
        if sizes - {1}:
            raise UserError(
                f"cannot remove the batch dimension: the cache holds a batch of {max(sizes)}; "
                "run with one sequence, or index the batch yourself"
            )
        for name in list(self):
            dict.__setitem__(self, name, dict.__getitem__(self, name)[0])
        self.has_batch_dim = False
        return self

    def to(self, device: torch.device | str) -> "ActivationCache":
        """Move every activation to `device` (in place); returns self."""
        for name in list(self):
            dict.__setitem__(self, name, dict.__getitem__(self, name).to(device))
        return self

    # The model behind the cache
    # ----------------------------------------------------------------------
    @property
    def _cfg(self):
        if self.model is None:
            raise UserError("this cache has no model; make it with model.run_with_cache(...)")
        return self.model.config

    def _check_residual_sum(self) -> None:
        cfg = self._cfg
        if cfg.norm_placement != "pre" or cfg.embed_norm:
            raise UserError(
                "this model normalises inside its residual stream (post-norm, as BERT), so the "
                "stream is "
                "not a sum of its parts: residual-stream decompositions need a pre-norm model"
            )

    def _check_parts_sum(self, parts: str) -> None:
        """Heads and neurons add up to the stream only where nothing norms them before it: with
        sandwich norms (Gemma) a norm takes each attention and MLP output first."""
        if self._cfg.sandwich_norm:
            raise UserError(
                "this model norms each attention and MLP output before it joins the residual "
                f"stream (sandwich norms, as Gemma), so {parts} do not add up to the stream; "
                "decompose it by layer instead (decompose_resid)"
            )

    def _layer(self, layer: int | None) -> int:
        n = self._cfg.n_layers
        layer = n if layer is None or layer == -1 else layer
        if not 0 <= layer <= n:
            raise UserError(
                f"layer {layer} is out of range; use 0..{n} (or -1/None for the final stream)"
            )
        return layer

    # Residual-stream views
    # ---------------------------------------------------------------------------
    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: Any = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ):
        """The residual stream after each layer, up to the input of `layer` (all: up to ln_final's
        input):
        [component, batch, pos, d_model], labels "0_pre", "0_mid", ..., "final_post"."""
        self._check_residual_sum()
        layer, n = self._layer(layer), self._cfg.n_layers
        if incl_mid and self._cfg.wiring == "parallel":
            raise UserError(
                "this model's blocks run attention and MLP in parallel: there is no resid_mid; "
                "use incl_mid=False"
            )
        mlp_input = mlp_input and self._cfg.wiring != "parallel"  # a parallel MLP reads resid_pre
        parts, labels = [], []
        for l in range(layer + 1):
            if l == n:
                parts.append(self["resid_post", n - 1])
                labels.append("final_post")
                continue
            parts.append(self["resid_pre", l])
            labels.append(f"{l}_pre")
            if (incl_mid and l < layer) or (mlp_input and l == layer):
                parts.append(self["resid_mid", l])
                labels.append(f"{l}_mid")
        stack = torch.stack([apply_slice(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack, layer, mlp_input=mlp_input, pos_slice=pos_slice, recompute_ln=layer == n
            )
        return (stack, labels) if return_labels else stack

    def _embeddings(self, pos_slice: Any) -> tuple[list[torch.Tensor], list[str]]:
        parts, labels = [], []
        for name, label in (
            ("hook_embed", "embed"),
            ("hook_pos_embed", "pos_embed"),
            ("hook_token_type_embed", "token_type_embed"),
        ):
            if name in self:
                parts.append(apply_slice(self[name], pos_slice, -2))
                labels.append(label)
        return parts, labels

    def decompose_resid(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice: Any = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ):
        """The terms that sum to the residual stream into `layer` (all: ln_final's input): embed,
        pos_embed, then each layer's attn_out and mlp_out; mode "attn" / "mlp" keeps only those."""
        self._check_residual_sum()
        if mode not in ("all", "attn", "mlp"):
            raise UserError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        layer = self._layer(layer)
        incl_attn, incl_mlp = mode != "mlp", mode != "attn" and not self._cfg.attn_only
        parts, labels = self._embeddings(pos_slice) if incl_embeds else ([], [])
        for l in range(layer):
            if incl_attn:
                parts.append(apply_slice(self["attn_out", l], pos_slice, -2))
                labels.append(f"{l}_attn_out")
            if incl_mlp:
                parts.append(apply_slice(self["mlp_out", l], pos_slice, -2))
                labels.append(f"{l}_mlp_out")
        # a parallel MLP reads resid_pre
        if mlp_input and incl_attn and self._cfg.wiring != "parallel":
            parts.append(apply_slice(self["attn_out", layer], pos_slice, -2))
            labels.append(f"{layer}_attn_out")
        stack = torch.stack(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def compute_head_results(self) -> None:
        """Fill in `blocks.L.attn.hook_result` [batch, pos, head, d_model] = z_h W_O^h from hook_z,
        where missing."""
        W_O = self.model.W_O  # [layer, head, d_head, d_model]
        for l in range(self._cfg.n_layers):
            name = f"blocks.{l}.attn.hook_result"
            if name not in self:
                z = self["z", l]
                dict.__setitem__(
                    self, name, torch.einsum("...hd,hdm->...hm", z, W_O[l].to(z.dtype))
                )

    def stack_head_results(
        self,
        layer: int | None = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: Any = None,
        apply_ln: bool = False,
    ):
        """Every head's output into the residual stream, for the layers before `layer`:
        [layer · head, batch, pos, d_model], labels "L0H0", "L0H1", ...; `incl_remainder` adds the
        rest of
        the stream (resid_post of layer − 1 minus the heads) as a last term."""
        self._check_parts_sum("the heads' outputs")
        layer = self._layer(layer)
        self.compute_head_results()
        parts, labels = [], []
        for l in range(layer):
            result = apply_slice(self["result", l], pos_slice, -3)  # [..., head, d_model]
            parts.append(result.movedim(-2, 0))
            labels += [f"L{l}H{h}" for h in range(self._cfg.n_heads)]
        reference = apply_slice(self["hook_embed"], pos_slice, -2)
        stack = torch.cat(parts) if parts else reference.new_zeros(0, *reference.shape)
        if incl_remainder:
            total = (
                apply_slice(self["resid_post", layer - 1], pos_slice, -2) if layer else reference
            )
            stack = torch.cat([stack, (total - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def stack_neuron_results(
        self,
        layer: int | None = -1,
        pos_slice: Any = None,
        return_labels: bool = False,
        apply_ln: bool = False,
    ):
        """Every MLP neuron's output (post_n · W_out[n]) for the layers before `layer`:
        [layer · d_mlp, batch, pos, d_model], labels "L0N0", ... (memory: d_mlp times mlp_out)."""
        self._check_parts_sum("the neurons' outputs")
        layer = self._layer(layer)
        parts, labels = [], []
        for l in range(layer):
            post = apply_slice(self["post", l], pos_slice, -2)  # [..., d_mlp]
            W_out = self.model.blocks[l].mlp.W_out.weight.T.to(post.dtype)  # [d_mlp, d_model]
            parts.append((post[..., None] * W_out).movedim(-2, 0))
            labels += [f"L{l}N{n}" for n in range(W_out.shape[0])]
        reference = apply_slice(self["hook_embed"], pos_slice, -2)
        stack = torch.cat(parts) if parts else reference.new_zeros(0, *reference.shape)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def get_full_resid_decomposition(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice: Any = None,
        return_labels: bool = False,
    ):
        """Every term of the stream into `layer`: each head, each neuron (or each MLP with
        expand_neurons=False), the embeddings, and the summed biases (attention's b_O, and the MLPs'
        b_out when neurons are expanded), in TransformerLens's order. Sums to the stream."""
        self._check_residual_sum()
        layer = self._layer(layer)
        own_heads = mlp_input and self._cfg.wiring != "parallel"  # a parallel MLP reads resid_pre
        stack, labels = self.stack_head_results(
            layer + (1 if own_heads else 0), pos_slice=pos_slice, return_labels=True
        )
        parts = [stack]
        if not self._cfg.attn_only and layer > 0:
            if expand_neurons:
                neurons, names = self.stack_neuron_results(
                    layer, pos_slice=pos_slice, return_labels=True
                )
            else:
                neurons, names = self.decompose_resid(
                    layer, pos_slice=pos_slice, incl_embeds=False, mode="mlp", return_labels=True
                )
            parts.append(neurons)
            labels += names
        embeds, names = self._embeddings(pos_slice)
        parts += [e[None] for e in embeds]
        labels += names
        bias = self.model.accumulated_bias(layer, own_heads, include_mlp_biases=expand_neurons)
        parts.append(bias.to(stack.dtype).expand(1, *stack.shape[1:]))
        labels.append("bias")
        stack = torch.cat(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(
        self,
        residual_stack: torch.Tensor,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: Any = None,
        batch_slice: Any = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
    ) -> torch.Tensor:
        """Treat each term of `residual_stack` [component, batch, pos, d_model] as input to the norm
        before
        `layer` (ln1, or ln2 with mlp_input; ln_final for the final layer) frozen at its cached
        scale:
        (x − mean(x)) / scale for LayerNorm, x / scale for RMSNorm, before the norm's weight and
        bias.
        recompute_ln (final layer only): ln_final applied to each term with its own statistics,
        weight and
        bias included (the logit lens: `accumulated_resid(apply_ln=True) @ model.W_U + model.b_U`
        are the logits each layer would give), as TransformerLens does on raw weights."""
        cfg = self._cfg
        layer = self._layer(layer)
        if has_batch_dim and self.has_batch_dim:
            residual_stack = apply_slice(residual_stack, batch_slice, 1)
        norm = (
            self.model.ln_final
            if layer == cfg.n_layers
            else getattr(self.model.blocks[layer], "ln2" if mlp_input else "ln1")
        )
        if norm is None:
            return residual_stack
        # the logit lens: ln_final itself, weight and bias included
        if recompute_ln and layer == cfg.n_layers:
            return norm(residual_stack)
        if cfg.norm == "layernorm":
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        if layer == cfg.n_layers:
            name = "ln_final.hook_scale"
        else:
            name = f"blocks.{layer}.{'ln2' if mlp_input else 'ln1'}.hook_scale"
        scale = apply_slice(self[name], pos_slice, -2)
        if self.has_batch_dim:
            scale = apply_slice(scale, batch_slice, 0)
        return residual_stack / scale.to(residual_stack.dtype)

    def logit_attrs(
        self,
        residual_stack: torch.Tensor,
        tokens: Any,
        incorrect_tokens: Any = None,
        pos_slice: Any = None,
        batch_slice: Any = None,
        has_batch_dim: bool = True,
    ) -> torch.Tensor:
        """Direct logit attribution: apply_ln_to_stack(term) · direction(token) [−
        direction(incorrect)] for
        each term: [component, batch, pos] (or as the stack's slicing left it). tokens: a string, an
        id, ids per batch row [batch], or per row and position [batch, pos]."""
        directions = self.model.tokens_to_residual_directions(tokens)
        if incorrect_tokens is not None:
            wrong = self.model.tokens_to_residual_directions(incorrect_tokens)
            if wrong.shape != directions.shape:
                raise UserError(
                    "tokens and incorrect_tokens must have the same shape, got "
                    f"{tuple(directions.shape)[:-1]} "
                    f"and {tuple(wrong.shape)[:-1]}"
                )
            directions = directions - wrong
        scaled = self.apply_ln_to_stack(
            residual_stack,
            -1,
            pos_slice=pos_slice,
            batch_slice=batch_slice,
            has_batch_dim=has_batch_dim,
        )
        if (
            has_batch_dim
            and scaled.dim() == 4
            and directions.dim() == 2
            # one token per batch row: the same at every position
            and directions.shape[0] == scaled.shape[1]
        ):
            directions = directions[:, None]
        return (scaled * directions.to(scaled.dtype)).sum(-1)
