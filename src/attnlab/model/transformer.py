"""The Transformer: embeddings, N blocks, a final norm and an LM head; decoder or encoder by config.

Design choices:
- One class reads top to bottom, as in nanoGPT: `Block` (norm, attention, residual; norm, MLP,
  residual) and `Transformer` (embeddings, blocks, head). Decoder-only language models (GPT-2,
  LLaMA, Qwen2) and BERT-style encoders are settings of `ModelConfig`, not separate code.
- A block is wired one of three ways, `ModelConfig.wiring` (pre-norm, post-norm, parallel), a
  pre-norm one with or without sandwich norms: its docstring holds the equations, and the kernel
  decode program and the explorer's stages read the same description.
- Gemma 3's other parts are settings too: the embedding times √d_model (`scale_embed`), windowed
  and global blocks (`ModelConfig.layer_window`), each kind with its own RoPE base
  (`rope_theta_local`: the angles are computed once per forward for each kind).
- Hook names are TransformerLens's (see attnlab.lens.hooks); every hook point carries its shape in a
  comment.
- TransformerLens's views of the weights (W_Q ... W_U, QK/OV circuits) and its token helpers
  (to_tokens, ...) come from attnlab.lens.weights, mixed in, so this file stays the forward pass.
- A causal model returns logits (B, T, d_vocab); an encoder returns the last hidden states (B, T,
  d_model). `logit_softcap` c bounds the logits smoothly to (−c, c): c·tanh(logits / c) (Gemma 2;
  modded-nanogpt).
- `zero_init_projections` starts W_O and W_out at zero (modded-nanogpt, after Kaplan's "zero-init
  the last layer of each residual branch"): every block starts as the identity, and the gradient
  still reaches them.
- `attention_mask` (B, S) marks real tokens (1) and padding (0); positions may be given per row so
  that left-padded batches generate correctly.
- `forward` runs the model's own modules and nothing else, with or without gradients. The code
  that wants attnlab's C kernels swaps its fast layers in around a pass (attnlab.generate.
  fast_layers); the Transformer you get from `attnlab.Transformer` and `attnlab.load`
  (attnlab.workbench) adds `generate` and a fast `run_with_cache` on top of this class.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..lens.hooks import HookedModule, HookPoint
from ..lens.weights import TransformerLensViews
from .attention import Attention
from .config import ModelConfig
from .layers import MLP, Linear, make_norm
from .moe import MoE
from .positions import Rotary, sinusoidal_positions


class Block(nn.Module):
    """One Transformer block: attention then MLP, each wrapped in a residual connection and a
    norm."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.wiring = config.wiring  # pre, post or parallel: ModelConfig.wiring
        # the norms before the sublayers; none without input_norms (OLMo 2: ModelConfig.wiring)
        self.ln1 = make_norm(config) if config.input_norms else None
        self.attn = Attention(config, layer)
        self.ln2 = None if config.attn_only or not config.input_norms else make_norm(config)
        # the dense MLP, or a mixture of experts (attnlab.model.moe)
        self.mlp = None if config.attn_only else (MoE if config.n_experts else MLP)(config)
        # sandwich_norm: the sublayers' outputs normed before the residual add (ModelConfig.wiring)
        self.ln1_post = make_norm(config) if config.sandwich_norm else None
        self.ln2_post = make_norm(config) if config.sandwich_norm else None
        # the RoPE angles this block rotates by: the windowed blocks' own (rope_theta_local) or not
        self.rope_local = config.layer_rope_local(layer)
        # Granite: each sublayer's output scaled before the residual add (hooks see it scaled)
        self.residual_multiplier = config.residual_multiplier
        self.dropout = nn.Dropout(config.dropout)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]

    def forward(self, resid_pre: torch.Tensor, **attn_kwargs: Any) -> torch.Tensor:
        resid_pre = self.hook_resid_pre(resid_pre)
        # both branches read resid_pre (config: pre-norm, with an MLP)
        if self.wiring == "parallel":
            attn_out = self.hook_attn_out(
                self._scaled(self.attn(self.ln1(resid_pre), **attn_kwargs))
            )
            mlp_out = self.hook_mlp_out(self._scaled(self.mlp(self.ln2(resid_pre))))
            return self.hook_resid_post(resid_pre + self.dropout(attn_out) + self.dropout(mlp_out))
        if self.wiring == "pre":
            attn_out = self.attn(_normed(self.ln1, resid_pre), **attn_kwargs)
            if self.ln1_post is not None:
                attn_out = self.ln1_post(attn_out)
            attn_out = self.hook_attn_out(self._scaled(attn_out))
            resid_mid = self.hook_resid_mid(resid_pre + self.dropout(attn_out))
            if self.mlp is None:
                return self.hook_resid_post(resid_mid)
            mlp_out = self.mlp(_normed(self.ln2, resid_mid))
            if self.ln2_post is not None:
                mlp_out = self.ln2_post(mlp_out)
            mlp_out = self.hook_mlp_out(self._scaled(mlp_out))
            return self.hook_resid_post(resid_mid + self.dropout(mlp_out))
        attn_out = self.hook_attn_out(self._scaled(self.attn(resid_pre, **attn_kwargs)))
        resid_mid = self.hook_resid_mid(self.ln1(resid_pre + self.dropout(attn_out)))
        if self.mlp is None:
            return self.hook_resid_post(resid_mid)
        mlp_out = self.hook_mlp_out(self._scaled(self.mlp(resid_mid)))
        return self.hook_resid_post(self.ln2(resid_mid + self.dropout(mlp_out)))

    def _scaled(self, sublayer_out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output times residual_multiplier (Granite), where it is not 1."""
        m = self.residual_multiplier
        return sublayer_out if m == 1.0 else sublayer_out * m


def _normed(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """norm(x), or x where the block has no such norm (input_norms False)."""
    return x if norm is None else norm(x)


class Transformer(HookedModule, TransformerLensViews):
    """Token embedding (+ positions, + token types) -> N blocks -> final norm -> LM head (causal) or
    hidden states."""

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        # set by attnlab.load / training when a tokenizer.json comes with the model
        self.tokenizer = None
        # "int8", "q8_0", ... once attnlab.quantize has run (saved with the model)
        self.quantization: str | None = None
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.embed = nn.Embedding(config.d_vocab, config.d_model)
            self.pos_embed = (
                nn.Embedding(config.n_ctx, config.d_model)
                if config.positional == "learned"
                else None
            )
            self.token_type_embed = (
                nn.Embedding(config.n_token_types, config.d_model) if config.n_token_types else None
            )
            self.ln_embed = make_norm(config) if config.embed_norm else None
            self.rotary = Rotary.for_config(config) if config.positional == "rope" else None
            # the windowed blocks' RoPE where it has a base of its own (Gemma 3), unscaled
            self.rotary_local = (
                Rotary.for_config(config, local=True)
                if config.rope_theta_local is not None
                else None
            )
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
            self.ln_final = make_norm(config) if config.final_norm else None
            self.unembed = (
                Linear(config.d_model, config.d_vocab, bias=config.unembed_bias)
                if config.causal
                else None
            )
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.hook_token_type_embed = HookPoint()  # [batch, pos, d_model]
        if self.unembed is not None and config.tie_embeddings:
            self.unembed.weight = self.embed.weight
        if device is None or torch.device(device).type != "meta":
            self.apply(self._init_weights)
            self._init_residual_projections()
        self.setup_hooks()

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, init_std) weights and zero biases; residual projections get
        1/√(2·n_layers) more (below)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, self.config.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def _init_residual_projections(self) -> None:
        std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            # W_O and every W_out (an MLP's, or each expert's)
            mlp = block.mlp.named_modules() if block.mlp is not None else []
            outs = [module for name, module in mlp if name.rsplit(".", 1)[-1] == "W_out"]
            for projection in [block.attn.W_O] + outs:
                if self.config.zero_init_projections:
                    nn.init.zeros_(projection.weight)
                else:
                    nn.init.normal_(projection.weight, 0.0, std)

    @property
    def device(self) -> torch.device:
        # the embedding's parameter, or its blocks (attnlab.quant.blocks.BlockEmbedding, whose
        # `weight` is made at each read)
        weight = next(self.embed.parameters(), None)
        return (self.embed.blocks if weight is None else weight).device

    @property
    def dtype(self) -> torch.dtype:
        weight = next(self.embed.parameters(), None)
        return torch.float32 if weight is None else weight.dtype  # blocks dequantize to float32

    def embed_tokens(
        self, ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """resid_pre of block 0: token embedding + absolute positions + token types (as
        configured)."""
        cfg = self.config
        x = self.embed(ids)
        if cfg.scale_embed:
            x = x * math.sqrt(cfg.d_model)
        if cfg.embedding_multiplier != 1.0:  # Granite
            x = x * cfg.embedding_multiplier
        x = self.hook_embed(x)
        if cfg.positional == "learned":
            x = x + self.hook_pos_embed(self.pos_embed(positions))
        elif cfg.positional == "sinusoidal":
            x = x + self.hook_pos_embed(sinusoidal_positions(positions, cfg.d_model).to(x.dtype))
        if self.token_type_embed is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(ids)
            x = x + self.hook_token_type_embed(self.token_type_embed(types))
        if self.ln_embed is not None:
            x = self.ln_embed(x)
        return self.drop(x)

    @staticmethod
    def _check_ids(ids: torch.Tensor) -> None:
        """UserError for token ids that are not integers or not there: no host read, so every
        forward runs it."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise UserError(f"token ids must be integers, got dtype {ids.dtype}")
        if ids.shape[-1] == 0:
            raise UserError("the input has no tokens; give at least one")

    def _check_resid(self, resid: torch.Tensor, start_at_layer: int) -> None:
        """UserError for a start_at_layer input that is not a residual stream (B, T, d_model)."""
        d_model, n_layers = self.config.d_model, self.config.n_layers
        if not 0 <= start_at_layer < n_layers:
            raise UserError(
                f"start_at_layer={start_at_layer} is not a block of this model; give 0 to "
                f"{n_layers - 1}"
            )
        if resid.dim() != 3 or resid.shape[-1] != d_model or not resid.is_floating_point():
            raise UserError(
                f"with start_at_layer the input is the residual stream [batch, pos, d_model="
                f"{d_model}] (floats), got {tuple(resid.shape)} of {resid.dtype}; pass "
                f"cache['resid_pre', {start_at_layer}]"
            )

    def _check_values(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """UserError for a token id outside the vocabulary or a position past a learned table, in
        one host read."""
        cfg = self.config
        lowest, highest, last = torch.stack([ids.min(), ids.max(), positions.max()]).tolist()
        if highest >= cfg.d_vocab or lowest < 0:
            raise UserError(
                f"token id {highest if highest >= cfg.d_vocab else lowest} is outside the "
                "vocabulary "
                f"[0, {cfg.d_vocab}); check that the tokenizer matches this model"
            )
        if cfg.positional == "learned" and last >= cfg.n_ctx:
            raise UserError(
                f"sequence reaches position {last} but this model has learned positions for "
                f"n_ctx={cfg.n_ctx} only; shorten the input to at most {cfg.n_ctx} tokens"
            )

    def forward(
        self,
        ids: torch.Tensor,
        *,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_cache=None,
        start_pos: int = 0,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, d_vocab) for a causal model, hidden states (B, T, d_model)
        for an encoder.

        attention_mask: (B, S) with 1 for real tokens and 0 for padding, S = start_pos + T (all keys
        so far).
        positions: (B, T) position of each token; default start_pos, start_pos+1, ...
        kv_cache / start_pos: cached decoding (see attnlab.generate.loop); the new tokens sit at
        start_pos.
        start_at_layer: `ids` is then the residual stream (B, T, d_model) going into that block
        (its resid_pre), and the embeddings are skipped (as TransformerLens does); patching sweeps
        use it to start a patched run where the patch is.
        stop_at_layer: return the residual stream before that block (as TransformerLens does).
        check_inputs: check token ids (and learned positions) against the model's ranges: one host
        read.
        """
        if start_at_layer is None:
            if ids.dim() == 1:
                ids = ids.unsqueeze(0)
            B, T = ids.shape  # batch, query positions
            self._check_ids(ids)
        else:
            self._check_resid(ids, start_at_layer)
            B, T = ids.shape[:2]  # batch, query positions
        if positions is None:
            positions = torch.arange(start_pos, start_pos + T, device=ids.device).expand(B, T)
        if start_at_layer is None:
            # The decode step skips the value checks (check_inputs=False, and always when
            # compiled): its token is an argmax over the vocabulary and generate checked the length
            # up front, so a host read per token would buy nothing, and in a compiled graph it
            # would break the graph.
            if check_inputs and not torch.compiler.is_compiling():
                self._check_values(ids, positions)
            resid = self.embed_tokens(ids, positions, token_type_ids)
        else:
            resid = ids  # [batch, pos, d_model]: resid_pre of block start_at_layer
        rope = self.rotary(positions, resid.dtype) if self.rotary is not None else None
        rope_local = (
            self.rotary_local(positions, resid.dtype) if self.rotary_local is not None else None
        )
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(torch.bool)[:, None, None, :]  # [batch, 1, 1, key_pos]
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(
                resid,
                rope=rope_local if block.rope_local else rope,
                mask=mask,
                kv_cache=kv_cache,
                start_pos=start_pos,
            )
        if stop_at_layer is not None:
            return resid
        return self.logits_from_resid(resid)

    def logits_from_resid(self, resid: torch.Tensor) -> torch.Tensor:
        """The end of the forward pass: final norm, LM head and soft-cap of the residual stream
        after the last block (..., d_model) -> logits (..., d_vocab); an encoder's hidden states."""
        if self.ln_final is not None:
            resid = self.ln_final(resid)
        if self.unembed is None:
            return resid
        logits = self.unembed(resid)
        if self.config.logit_scale != 1.0:  # Granite: 1 / logits_scaling
            logits = logits * self.config.logit_scale
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def loss(
        self, ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """Mean next-token cross-entropy of a causal model: logits at position t predict
        targets[t]."""
        return next_token_loss(self(ids), targets, ignore_index=ignore_index)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel() + (
                self.pos_embed.weight.numel() if self.pos_embed is not None else 0
            )
        return n


def next_token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """The language model's loss, written once: cross-entropy of logits (..., V) against targets
    (...), in float32, the logits at position t predicting targets[t]. reduction as
    F.cross_entropy's ("none": one loss per target, in targets' shape)."""
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        reduction=reduction,
        ignore_index=ignore_index,
    )
    return loss.view(targets.shape) if reduction == "none" else loss
