"""TransformerLens's everyday helpers: short activation names, position slices, and `test_prompt`.

Design choices:
- `get_act_name` follows TransformerLens's `utils.get_act_name`
  (transformer_lens/utilities/components_utils.py):
  `get_act_name("pattern", 0) == "blocks.0.attn.hook_pattern"`, `get_act_name("k6") ==
  "blocks.6.attn.hook_k"`, `get_act_name("scale") == "ln_final.hook_scale"`, with the same aliases
  ("attn" -> pattern, "a" -> attn).
- `apply_slice` is TransformerLens's `Slice` as a function: None keeps everything, an int picks one
  index and drops the axis, a tuple is `slice(*tuple)`, a list or tensor picks those indices.
- `test_prompt` prints what TransformerLens's prints: the tokenized prompt and answer, then for each
  answer token its rank, logit and probability and the top predictions.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import UserError

_LAYER_TYPE_ALIAS = {
    "a": "attn",
    "m": "mlp",
    "b": "",
    "block": "",
    "blocks": "",
    "attention": "attn",
}
_ACT_NAME_ALIAS = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_mid": "mid",
    "mlp_post": "post",
}
_ATTN_NAMES = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores")
_MLP_NAMES = ("pre", "post", "mid", "pre_linear")
_NORM_NAMES = ("scale", "normalized")


def get_act_name(name: str, layer: int | str | None = None, layer_type: str | None = None) -> str:
    """The full hook name of a short one: ("pattern", 0) -> "blocks.0.attn.hook_pattern",
    ("normalized", 2, "ln1") -> "blocks.2.ln1.hook_normalized", "resid_pre3" ->
    "blocks.3.hook_resid_pre"."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name  # already a full name
    match = re.match(r"([a-z_]*[a-z])(\d+)([a-z]?.*)", name)
    if match is not None:
        name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3) or None
    name = _ACT_NAME_ALIAS.get(name, name)
    full = "" if layer is None else f"blocks.{int(layer)}."
    if name in _ATTN_NAMES:
        layer_type = "attn"
    elif name in _MLP_NAMES:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPE_ALIAS:
        layer_type = _LAYER_TYPE_ALIAS[layer_type]
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in _NORM_NAMES and layer is None:
        full = f"ln_final.{full}"
    return full


def apply_slice(tensor: torch.Tensor, index: Any, dim: int) -> torch.Tensor:
    """TransformerLens's Slice on one axis: None = all, int = that index (axis dropped), tuple =
    slice(*tuple), slice as is, list/tensor = those indices."""
    if index is None:
        return tensor
    if isinstance(index, int):
        return tensor.select(dim, index)
    if isinstance(index, tuple):
        index = slice(*index)
    if isinstance(index, slice):
        return tensor[(slice(None),) * (dim % tensor.dim()) + (index,)]
    index = torch.as_tensor(index, device=tensor.device)
    return tensor.index_select(dim, index % tensor.shape[dim])


def test_prompt(
    prompt: str,
    answer: str | list[str],
    model,
    prepend_space_to_answer: bool = True,
    print_details: bool = True,
    prepend_bos: bool | None = None,
    top_k: int = 10,
) -> list[dict]:
    """Run `prompt` + `answer` and print, for each answer token, its rank, logit and probability and
    the
    top_k predictions (TransformerLens's `utils.test_prompt`). Returns the same numbers as a list of
    dicts."""
    answers = [answer] if isinstance(answer, str) else list(answer)
    results = []
    for text in answers:
        if prepend_space_to_answer and not text.startswith(" "):
            text = " " + text
        prompt_ids = model.to_tokens(prompt, prepend_bos=prepend_bos)[0]
        answer_ids = model.to_tokens(text, prepend_bos=False)[0]
        ids = torch.cat([prompt_ids, answer_ids]).to(model.device)
        with torch.no_grad():
            # as the model's class runs a pass (attnlab.workbench's: in the C kernels' layers)
            logits = model.run_with_hooks(ids[None])[0].float()
        if print_details:
            print("Tokenized prompt:", [model.tokenizer.decode([i]) for i in prompt_ids.tolist()])
            print("Tokenized answer:", [model.tokenizer.decode([i]) for i in answer_ids.tolist()])
        for k, token in enumerate(answer_ids.tolist()):
            row = logits[len(prompt_ids) - 1 + k]  # the position that predicts answer token k
            probs = row.softmax(-1)
            rank = int((row > row[token]).sum())
            top = row.topk(min(top_k, row.numel()))
            entry = {
                "token": model.tokenizer.decode([token]),
                "rank": rank,
                "logit": float(row[token]),
                "prob": float(probs[token]),
                "top": [
                    (model.tokenizer.decode([i]), float(row[i]), float(probs[i]))
                    for i in top.indices.tolist()
                ],
            }
            results.append(entry)
            print(
                f"Performance on answer token:\nRank: {rank:<8} Logit: {entry['logit']:5.2f} "
                f"Prob: {entry['prob']:6.2%} Token: |{entry['token']}|"
            )
            if print_details:
                for i, (tok, logit, prob) in enumerate(entry["top"]):
                    print(f"Top {i}th token. Logit: {logit:5.2f} Prob: {prob:6.2%} Token: |{tok}|")
        ranks = ", ".join(f"{r['token']!r} {r['rank']}" for r in results[-len(answer_ids) :])
        print(f"Ranks of the answer tokens: {ranks}")
    return results


test_prompt.__test__ = False  # TransformerLens's name, not a pytest test


def check_one_token(model, text: str, what: str = "the answer") -> int:
    """The id of `text` if it is exactly one token, else a UserError that shows how it splits."""
    ids = model.to_tokens(text, prepend_bos=False)[0].tolist()
    if len(ids) != 1:
        pieces = [model.tokenizer.decode([i]) for i in ids]
        raise UserError(
            f"{what} {text!r} is {len(ids)} tokens ({pieces}), not one; choose a single-token "
            "answer (a leading space is often part of the token, e.g. ' Paris')"
        )
    return ids[0]
