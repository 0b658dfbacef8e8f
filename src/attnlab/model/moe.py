"""The mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen2-MoE and
Qwen3-MoE): a router picks a few SwiGLU experts for each token, and the token's MLP output is their
outputs weighted by the router.

Design choices:
- One forward, as transformers computes it for Mixtral, Qwen2-MoE and Qwen3-MoE:
      p = softmax(W_gate x)                              (float32, over the n_experts)
      w, e = top-k of p                                  (k = experts_per_token)
      w = w / Σ w                                        (Mixtral always; Qwen's norm_topk_prob)
      out = Σ_j w_j · expert_{e_j}(x),  expert(x) = W_out (silu(W_gate x) ⊙ W_in x)
      out += sigmoid(w_s · x) · shared_expert(x)         (Qwen2-MoE's always-on expert)
  Only the chosen experts compute, each on the tokens routed to it: a decode step reads the
  weights of k experts, not n_experts (the point of a mixture).
- Names and hooks are TransformerLens's (transformer_lens/components/mlps/moe.py, its Mixtral
  support): the router is `W_gate` (d_model -> n_experts, no bias), the experts `experts.{e}`
  with `W_gate`, `W_in`, `W_out` and the hooks of its MoEGatedMLP: hook_gate (W_gate x, before
  silu), hook_pre (W_in x), hook_post (what goes into W_out), each over the tokens routed to that
  expert. `hook_expert_weights` is the router's softmax over every expert (the scores, before the
  top-k: an edit there changes the choice) and `hook_expert_indices` each token's chosen experts;
  attnlab gives both the [batch, pos, ...] shape where TransformerLens flattens batch and pos.
- The experts are a ModuleList of Linears, not one 3-D tensor: each is a Linear the rest of
  attnlab already knows (blocks kept from a GGUF file per expert, the C kernels' fast products,
  quantization), and a state dict names them as TransformerLens does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..lens.hooks import HookPoint
from .config import ModelConfig
from .layers import Linear


def mixing_weights(top: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """The chosen experts' weights in a token's output (the docstring's w): the router's scores of
    the chosen experts [..., experts_per_token], renormalised to sum to 1 (Mixtral; Qwen's
    norm_topk_prob) or as they are."""
    return top / top.sum(-1, keepdim=True) if norm_topk_prob else top


class Expert(nn.Module):
    """One expert: W_out (silu(W_gate x) ⊙ W_in x), SwiGLU (Shazeer 2020), with TransformerLens's
    MoEGatedMLP hooks."""

    def __init__(self, d_model: int, d_mlp: int) -> None:
        super().__init__()
        self.W_gate = Linear(d_model, d_mlp, bias=False)
        self.W_in = Linear(d_model, d_mlp, bias=False)
        self.W_out = Linear(d_mlp, d_model, bias=False)
        self.hook_gate = HookPoint()  # [tokens, d_mlp]: W_gate x, before silu
        self.hook_pre = HookPoint()  # [tokens, d_mlp]: W_in x
        self.hook_post = HookPoint()  # [tokens, d_mlp]: silu(gate) ⊙ pre

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.hook_gate(self.W_gate(x))
        pre = self.hook_pre(self.W_in(x))
        return self.W_out(self.hook_post(F.silu(gate) * pre))


class MoE(nn.Module):
    """A router and n_experts experts (and Qwen2-MoE's gated shared expert): the module
    docstring's equations."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.experts_per_token = config.n_experts, config.experts_per_token
        self.norm_topk_prob = config.norm_topk_prob
        self.W_gate = Linear(config.d_model, config.n_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            Expert(config.d_model, config.d_mlp) for _ in range(config.n_experts)
        )
        shared = config.d_shared_expert
        self.shared_expert = Expert(config.d_model, shared) if shared else None
        self.shared_expert_gate = Linear(config.d_model, 1, bias=False) if shared else None
        self.hook_expert_weights = HookPoint()  # [batch, pos, n_experts]: softmax of the router
        self.hook_expert_indices = HookPoint()  # [batch, pos, experts_per_token]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, d_model = x.shape[:-1], x.shape[-1]  # [batch, pos], d_model
        rows = x.reshape(-1, d_model)  # [tokens, d_model]
        scores = F.softmax(self.W_gate(rows), dim=-1, dtype=torch.float)  # [tokens, n_experts]
        scores = self.hook_expert_weights(scores.view(*lead, self.n_experts))
        top, chosen = torch.topk(scores.reshape(-1, self.n_experts), self.experts_per_token)
        weights = mixing_weights(top, self.norm_topk_prob)
        chosen = self.hook_expert_indices(chosen.view(*lead, self.experts_per_token))
        chosen = chosen.reshape(-1, self.experts_per_token)  # [tokens, experts_per_token]
        weights = weights.to(x.dtype)
        out = torch.zeros_like(rows)
        for expert in chosen.unique().tolist():  # only the experts some token chose
            token, slot = torch.where(chosen == expert)
            y = self.experts[expert](rows[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(rows))  # [tokens, 1]
            out = out + gate * self.shared_expert(rows)
        return out.view(x.shape)
