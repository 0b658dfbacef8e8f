"""The model as TransformerLens shows it: stacked weights, QK/OV circuits, composition scores,
tokens.

Design choices (names, shapes and definitions from TransformerLens's HookedTransformer /
TransformerBridge):
- Weights are stacked over layers and split by head: W_Q, W_K, W_V [layer, head, d_model, d_head],
  W_O [layer, head, d_head, d_model], b_Q/b_K/b_V [layer, head, d_head], b_O [layer, d_model], W_E
  [d_vocab, d_model], W_U [d_model, d_vocab], b_U [d_vocab], W_pos [n_ctx, d_model] (learned
  positions only). Grouped-query key/value heads are expanded to every query head (query head h
  reads key/value head
  h // (n_heads / n_kv_heads), repeat_interleave), as TransformerLens's GroupedQueryAttention does.
  A bias the model lacks reads as zeros, as in TransformerLens. These are read-only views of the raw
  parameters:
  attnlab never folds norms into weights (TransformerLens's fold_ln), so W_U is the unembedding as
  trained.
- QK = W_Q W_Kᵀ and OV = W_V W_O as FactoredMatrix [layer, head, d_model, d_model]; composition
  scores between every head and every head of a later layer ([layer, head, layer, head], zero where
  the first head is not earlier), Q-, K- and V-composition as in Elhage et al. 2021
  (TransformerLens's all_composition_scores).
- `tokens_to_residual_directions(token)` is W_U[:, token] with the final norm's weight folded in (w
  ⊙ W_U[:, token]): the direction in the normalized stream that raises the token's logit, which is
  what TransformerLens's W_U is after fold_ln; so direct logit attribution matches its processed
  models.
- Tokens: `to_tokens(text, prepend_bos)`, `to_str_tokens`, `to_string`, `to_single_token`, on the
model's
  own tokenizer. prepend_bos=None follows the tokenizer's own rule (a LLaMA tokenizer adds <s>,
  GPT-2's adds
  nothing), True puts the tokenizer's BOS token first, False adds no special tokens.
  (TransformerLens's
  default prepends GPT-2's <|endoftext|>; pass prepend_bos=True for that.)
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UserError
from .factored_matrix import FactoredMatrix, composition_scores
from .names import check_one_token

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "[CLS]", "<bos>")


class TransformerLensViews:
    """Mixed into attnlab.Transformer: TransformerLens's weight, circuit and token views of the
    model."""

    # Stacked weights
    # -------------------------------------------------------------------------------
    def _split_heads(self, name: str, n: int) -> torch.Tensor:
        """[layer, n, d_model, d_head] from each block's attn.{name} Linear (weight [n · d_head,
        d_model])."""
        D = self.config.d_head
        return torch.stack(
            [getattr(b.attn, name).weight.T.reshape(-1, n, D).transpose(0, 1) for b in self.blocks]
        )

    def _expand_kv(self, w: torch.Tensor) -> torch.Tensor:
        return w.repeat_interleave(self.config.n_heads // self.config.n_kv_heads, dim=1)

    def _head_bias(self, name: str, n: int) -> torch.Tensor:
        D = self.config.d_head
        biases = [getattr(b.attn, name).bias for b in self.blocks]
        return torch.stack(
            [b.view(n, D) if b is not None else self.embed.weight.new_zeros(n, D) for b in biases]
        )

    @property
    def W_Q(self) -> torch.Tensor:
        """[layer, head, d_model, d_head]"""
        return self._split_heads("W_Q", self.config.n_heads).detach()

    @property
    def W_K(self) -> torch.Tensor:
        """[layer, head, d_model, d_head] (grouped key heads repeated for each query head)"""
        return self._expand_kv(self._split_heads("W_K", self.config.n_kv_heads)).detach()

    @property
    def W_V(self) -> torch.Tensor:
        """[layer, head, d_model, d_head] (grouped value heads repeated for each query head)"""
        return self._expand_kv(self._split_heads("W_V", self.config.n_kv_heads)).detach()

    @property
    def W_O(self) -> torch.Tensor:
        """[layer, head, d_head, d_model]"""
        H, D = self.config.n_heads, self.config.d_head
        return torch.stack([b.attn.W_O.weight.T.reshape(H, D, -1) for b in self.blocks]).detach()

    @property
    def b_Q(self) -> torch.Tensor:
        """[layer, head, d_head]"""
        return self._head_bias("W_Q", self.config.n_heads).detach()

    @property
    def b_K(self) -> torch.Tensor:
        """[layer, head, d_head]"""
        return self._expand_kv(self._head_bias("W_K", self.config.n_kv_heads)).detach()

    @property
    def b_V(self) -> torch.Tensor:
        """[layer, head, d_head]"""
        return self._expand_kv(self._head_bias("W_V", self.config.n_kv_heads)).detach()

    @property
    def b_O(self) -> torch.Tensor:
        """[layer, d_model]"""
        zeros = self.embed.weight.new_zeros(self.config.d_model)
        return torch.stack(
            [b.attn.W_O.bias if b.attn.W_O.bias is not None else zeros for b in self.blocks]
        ).detach()

    @property
    def W_E(self) -> torch.Tensor:
        """[d_vocab, d_model]"""
        return self.embed.weight.detach()

    @property
    def W_pos(self) -> torch.Tensor:
        """[n_ctx, d_model] (learned positions only)"""
        if self.pos_embed is None:
            raise UserError(
                f"this model has no learned position table (positions: {self.config.positional}); "
                "W_pos exists only for positional='learned'"
            )
        return self.pos_embed.weight.detach()

    @property
    def W_U(self) -> torch.Tensor:
        """[d_model, d_vocab]"""
        return self._unembedding().weight.T.detach()

    @property
    def b_U(self) -> torch.Tensor:
        """[d_vocab]"""
        bias = self._unembedding().bias
        return (
            bias.detach() if bias is not None else self.embed.weight.new_zeros(self.config.d_vocab)
        )

    def _unembedding(self):
        if self.unembed is None:
            raise UserError(
                "this model is an encoder with no unembedding (no W_U, no logits); use a causal LM"
            )
        return self.unembed

    # Circuits
    # ---------------------------------------------------------------------------------------
    @property
    def QK(self) -> FactoredMatrix:
        """W_Q W_Kᵀ per head: [layer, head, d_model, d_model], kept factored."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """W_V W_O per head: [layer, head, d_model, d_model], kept factored."""
        return FactoredMatrix(self.W_V, self.W_O)

    def all_composition_scores(self, mode: str) -> torch.Tensor:
        """[layer, head, layer, head]: how much head (l1, h1)'s output is read by head (l2, h2)'s
        query (mode "Q"), key ("K") or value ("V"), for l1 < l2 (zero elsewhere)."""
        if mode not in ("Q", "K", "V"):
            raise UserError(f"mode must be 'Q', 'K' or 'V', got {mode!r}")
        left = self.OV
        right = {"Q": self.QK, "K": self.QK.T, "V": self.OV}[mode]
        scores = composition_scores(left, right, broadcast_dims=True).to(self.W_O.dtype)
        layers = torch.arange(self.config.n_layers)
        earlier = (layers[:, None, None, None] < layers[None, None, :, None]).to(scores.device)
        return torch.where(earlier, scores, torch.zeros_like(scores))

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> torch.Tensor:
        """[d_model] the biases added to the residual stream before `layer`: each attention's b_O
        and (with include_mlp_biases) each MLP's output bias; mlp_input adds layer `layer`'s own
        b_O."""
        total = self.embed.weight.new_zeros(self.config.d_model).detach()
        for i in range(layer + (1 if mlp_input else 0)):
            block = self.blocks[i]
            if block.attn.W_O.bias is not None:
                total = total + block.attn.W_O.bias.detach()
            # a mixture of experts (attnlab.model.moe) has no W_out of its own, and no biases
            out = getattr(block.mlp, "W_out", None)
            if include_mlp_biases and i < layer and out is not None and out.bias is not None:
                total = total + out.bias.detach()
        return total

    def tokens_to_residual_directions(self, tokens: Any) -> torch.Tensor:
        """The unembedding direction of each token, with the final norm's weight folded in: [...,
        d_model]."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        tokens = torch.as_tensor(tokens, device=self.device)
        directions = self.W_U[:, tokens].movedim(0, -1)  # [..., d_model]
        if self.ln_final is not None:
            directions = directions * self.ln_final.weight.detach()
        return directions

    # Tokens
    # -----------------------------------------------------------------------------------------
    def _tokenizer(self):
        if self.tokenizer is None:
            raise UserError(
                "this model has no tokenizer; load it from a directory with tokenizer.json "
                "(attnlab.load) or set model.tokenizer"
            )
        return self.tokenizer

    def _bos_id(self) -> int:
        tok = self._tokenizer()
        for name in _BOS_NAMES:
            index = tok.backend.token_to_id(name)
            if index is not None:
                return index
        raise UserError(
            "this tokenizer has no beginning-of-sequence token; use prepend_bos=False (or None)"
        )

    def to_tokens(self, text: str | list[str], prepend_bos: bool | None = None) -> torch.Tensor:
        """Token ids [batch, pos] of a text or a list of texts (which must tokenize to the same
        length)."""
        tok = self._tokenizer()
        texts = [text] if isinstance(text, str) else list(text)
        rows = [tok.encode(t, add_special_tokens=prepend_bos is None) for t in texts]
        if prepend_bos:
            bos = self._bos_id()
            rows = [r if r[:1] == [bos] else [bos, *r] for r in rows]
        if len({len(r) for r in rows}) > 1:
            raise UserError(
                f"the texts tokenize to different lengths {[len(r) for r in rows]}; give texts of "
                "the "
                "same number of tokens (or run them one at a time)"
            )
        if not rows[0]:
            raise UserError("the text has no tokens; give a non-empty text")
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def to_str_tokens(
        self, text: str | torch.Tensor | list[int], prepend_bos: bool | None = None
    ) -> list[str]:
        """Each token as its own string: to_str_tokens("Hello world") -> ['Hello', ' world']."""
        ids = (
            self.to_tokens(text, prepend_bos)[0] if isinstance(text, str) else torch.as_tensor(text)
        )
        if ids.dim() > 1:
            if ids.shape[0] != 1:
                raise UserError(f"to_str_tokens takes one sequence, got a batch of {ids.shape[0]}")
            ids = ids[0]
        tok = self._tokenizer()
        return [tok.decode([i]) for i in ids.tolist()]

    def to_string(self, tokens: torch.Tensor | list[int]) -> str | list[str]:
        """Decode ids [pos] to a string, or [batch, pos] to a list of strings."""
        ids = torch.as_tensor(tokens)
        tok = self._tokenizer()
        if ids.dim() > 1:
            return [tok.decode(row) for row in ids.tolist()]
        return tok.decode(ids.reshape(-1).tolist())

    def to_single_token(self, text: str) -> int:
        """The id of a text that is exactly one token (UserError naming the pieces otherwise)."""
        return check_one_token(self, text, what="the text")
