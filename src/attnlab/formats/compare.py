"""Compare attnlab with Hugging Face transformers on the same checkpoint, layer by layer.

Design choices:
- transformers is the reference and an optional dependency: it is imported only here, inside the
  function, and its absence is a UserError that says how to install it.
- transformers runs with eager attention, so its `output_attentions` are the softmax patterns
  themselves, in float32.
- Layers line up as the residual stream: transformers' hidden_states[0] is attnlab's
  blocks.0.hook_resid_pre, hidden_states[i + 1] is blocks.i.hook_resid_post, except that decoders
  with a final norm (GPT-2, LLaMA) report the last one after that norm.
- An attnlab checkpoint is first written in Hugging Face format to a temporary directory, so the
  same comparison checks attnlab's writer too.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from . import load, model_dir
from .hf import save_hf
from .native import is_native

SAMPLE_TEXT = "The cat sat on the mat because it was tired."


@dataclass
class Comparison:
    tokens: int  # length of the sample input
    embed: float  # max |Δ| of the residual stream entering block 0
    # per layer: max |Δ| of the residual stream after the block
    resid: list[float] = field(default_factory=list)
    # per layer: max |Δ| of the attention pattern
    pattern: list[float] = field(default_factory=list)
    output: float = 0.0  # max |Δ| of the logits (decoder) or last hidden states (encoder)
    output_scale: float = 1.0  # max |output| of transformers, for the relative difference

    @property
    def output_relative(self) -> float:
        return self.output / max(self.output_scale, 1e-12)

    def table(self) -> str:
        lines = [
            f"{'layer':>8}  {'resid max|Δ|':>14}  {'pattern max|Δ|':>14}",
            f"{'embed':>8}  {self.embed:14.3e}  {'':>14}",
        ]
        lines += [
            f"{i:>8}  {r:14.3e}  {p:14.3e}"
            for i, (r, p) in enumerate(zip(self.resid, self.pattern))
        ]
        lines.append(f"{'output':>8}  {self.output:14.3e}  (relative {self.output_relative:.3e})")
        return "\n".join(lines)


def sample_ids(model, text: str | None = None) -> torch.Tensor:
    """The sample input (1, T): the text through the model's tokenizer, else fixed pseudo-random
    ids."""
    if model.tokenizer is not None:
        try:
            ids = model.tokenizer.encode(text or SAMPLE_TEXT)
        # a character model may lack the default text's characters: not the user's mistake
        except UserError:
            if text is not None:
                raise
            ids = []
        if ids:
            return torch.tensor([ids[: model.config.n_ctx]])
    generator = torch.Generator().manual_seed(0)
    return torch.randint(
        0, model.config.d_vocab, (1, min(16, model.config.n_ctx)), generator=generator
    )


def load_transformers(path: str | Path, causal: bool):
    """The reference model, eager attention, float32; a UserError when transformers is not
    installed. A GGUF file is read by transformers' own GGUF reader (it needs the gguf package and
    accelerate)."""
    try:
        import transformers
    except ImportError:
        raise UserError(
            "transformers is not installed, so there is nothing to compare against; "
            "install it with: pip install transformers"
        ) from None
    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    path = Path(path)
    where = (
        {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
        if path.is_file()
        else {"pretrained_model_name_or_path": str(path)}
    )
    try:
        return cls.from_pretrained(
            **where, attn_implementation="eager", dtype=torch.float32, local_files_only=True
        ).eval()
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise UserError(
            f"{path}: transformers cannot load it ({str(exc).splitlines()[0]})"
        ) from None


@torch.no_grad()
def compare(
    path: str | Path,
    text: str | None = None,
    ids: torch.Tensor | None = None,
    revision: str | None = None,
    model=None,
    reference=None,
) -> Comparison:
    """Run attnlab and transformers on the same input; the largest differences, layer by layer.
    `model` / `reference`: the two already loaded from `path` (a test that goes on using them)."""
    path = model_dir(path, revision)
    model = load(path) if model is None else model
    if ids is None:
        ids = sample_ids(model, text)
    with tempfile.TemporaryDirectory() as tmp:
        if reference is None:
            hf_dir = save_hf(model, tmp) if is_native(path) else path
            reference = load_transformers(hf_dir, model.config.causal)
        theirs = reference(ids, output_attentions=True, output_hidden_states=True)
    names = lambda name: (
        name == "blocks.0.hook_resid_pre" or name.endswith(("hook_resid_post", "hook_pattern"))
    )
    ours, cache = model.run_with_cache(ids, names_filter=names)
    reference_out = theirs.logits if model.config.causal else theirs.last_hidden_state
    result = Comparison(
        tokens=ids.shape[-1],
        embed=_max_diff(cache["blocks.0.hook_resid_pre"], theirs.hidden_states[0]),
        output=_max_diff(ours, reference_out),
        output_scale=float(reference_out.abs().max()),
    )
    n_layers = model.config.n_layers
    for i in range(n_layers):
        resid = cache[f"blocks.{i}.hook_resid_post"]
        if i == n_layers - 1 and model.ln_final is not None:
            # transformers reports the last hidden state after the final norm
            resid = model.ln_final(resid)
        result.resid.append(_max_diff(resid, theirs.hidden_states[i + 1]))
        result.pattern.append(
            _max_diff(cache[f"blocks.{i}.attn.hook_pattern"], theirs.attentions[i])
        )
    return result


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise UserError(
            f"attnlab and transformers disagree on a shape: {tuple(a.shape)} vs {tuple(b.shape)}"
        )
    return float((a.float() - b.float()).abs().max())
