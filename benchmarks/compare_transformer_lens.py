"""attnlab against TransformerLens itself, side by side on the same weights (run outside the test
suite).

    python benchmarks/compare_transformer_lens.py [--styles gpt2,llama,pythia]

TransformerLens is not a dependency of attnlab (it pulls wandb, datasets, ...); run this script with
a Python that has both, e.g. a throwaway venv that sees attnlab's packages:
    python -m venv /tmp/tl && echo $PWD/.venv/lib/python3.11/site-packages >
    /tmp/tl/lib/python3.11/site-packages/a.pth /tmp/tl/bin/pip install transformer_lens &&
    PYTHONPATH=src /tmp/tl/bin/python benchmarks/compare_transformer_lens.py

For each style it builds a small random attnlab model, writes it as a Hugging Face directory
(attnlab.save format="hf", with a character tokenizer), boots TransformerLens on that directory
(`TransformerBridge.boot_transformers`, raw weights) and compares, on the same tokens, in float32:
  - every hook name both caches hold (max |difference| / max |value|);
  - cache views: accumulated_resid, decompose_resid, stack_head_results,
    get_full_resid_decomposition (expand_neurons=False), apply_ln_to_stack (ln_final and ln1 of
    layer 1), and logit_attrs of the decomposition against TransformerLens's after
    `enable_compatibility_mode()` (which folds the norm's weight into W_U, as attnlab folds it into
    the token direction);
  - stacked weights W_Q W_K W_V W_O b_Q b_O W_E W_U, the QK/OV eigenvalues and norms, the Q/K/V
    composition scores;
  - run_with_cache under a caller's hook that edits an activation (zeroing one head's z): both cache
    the edit;
  - patching: resid_pre by layer x position and head outputs over all positions (logit-difference
    metric).
Prints one line per comparison with the relative difference; a relative difference under 1e-4 is
"equal".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import attnlab  # noqa: E402
from attnlab.inspection import patching  # noqa: E402
from attnlab.model.config import ModelConfig  # noqa: E402
from attnlab.tokenizer import Tokenizer  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
BASE = dict(n_ctx=32, d_model=32, n_layers=2, n_heads=4, d_mlp=64)
STYLES = {
    "gpt2": dict(mlp="gelu_tanh"),
    "llama": dict(
        positional="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        n_kv_heads=2,
        tie_embeddings=False,
        norm_eps=1e-6,
    ),
    "pythia": dict(
        positional="rope",
        rotary_fraction=0.25,
        parallel_residual=True,
        tie_embeddings=False,
        mlp="gelu",
    ),
}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    if a.shape != b.shape:
        return float("inf")
    # a masked score is −∞ in attnlab (and HookedTransformer), the dtype's lowest number in the
    # bridge (HF's mask)
    masked = (a < -1e30) & (b < -1e30)
    a, b = a.masked_fill(masked, 0.0), b.masked_fill(masked, 0.0)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def build(style: str, out: Path):
    tokenizer = Tokenizer.train_char(CHARS)
    torch.manual_seed(0)
    model = attnlab.Transformer(
        ModelConfig(d_vocab=tokenizer.vocab_size, **BASE, **STYLES[style])
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2)
            if name.endswith("weight") and p.dim() == 1:  # norm gains around 1, not 0
                p.add_(1.0)
    model.tokenizer = tokenizer
    attnlab.save(model, out, format="hf")
    return attnlab.load(out)


def boot(path: Path):
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    return TransformerBridge.boot_transformers(str(path), device="cpu", tokenizer=tokenizer)


def compare(style: str, rows: list[tuple[str, str, float]]) -> None:
    from transformer_lens import patching as tl_patching

    def row(what: str, a, b) -> None:
        rows.append((style, what, relative(a, b)))

    def weight(name: str) -> None:
        ours = getattr(model, name)
        try:
            theirs = getattr(bridge, name)
        except Exception as exc:  # the bridge has no stacked bias where the checkpoint has none
            rows.append(
                (
                    style,
                    f"model.{name}: attnlab zeros, the bridge raises {type(exc).__name__}",
                    float("nan"),
                )
            )
            return
        if name in ("W_K", "W_V", "b_K", "b_V") and theirs.shape[1] != ours.shape[1]:
            # the bridge stacks the key/value heads as stored; HookedTransformer (and attnlab)
            # repeat them
            theirs = theirs.repeat_interleave(ours.shape[1] // theirs.shape[1], dim=1)
            name += " (bridge's kv heads repeated as HookedTransformer does)"
        row(f"model.{name}", ours, theirs)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / style
        model = build(style, path)
        bridge = boot(path)
        compat = boot(path)
        compat.enable_compatibility_mode()
        ids = torch.randint(0, len(CHARS), (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits, cache = model.run_with_cache(ids)
            tl_logits, tl_cache = bridge.run_with_cache(ids)
            _, compat_cache = compat.run_with_cache(ids)
        row("logits", logits, tl_logits)
        shared = sorted(set(cache) & set(tl_cache.keys()))
        equal = [n for n in shared if relative(cache[n], tl_cache[n]) < 1e-4]
        rows.append(
            (
                style,
                f"hook names held by both: {len(equal)} of {len(shared)} equal",
                0.0 if len(equal) == len(shared) else 1.0,
            )
        )
        for name in shared:
            if name not in equal:
                row(f"  differs: {name}", cache[name], tl_cache[name])
        # cache views
        row("accumulated_resid()", cache.accumulated_resid(), tl_cache.accumulated_resid())
        row(
            "accumulated_resid(apply_ln=True)",
            cache.accumulated_resid(apply_ln=True),
            tl_cache.accumulated_resid(apply_ln=True),
        )
        row("decompose_resid()", cache.decompose_resid(), tl_cache.decompose_resid())
        row("stack_head_results()", cache.stack_head_results(), tl_cache.stack_head_results())
        row(
            "get_full_resid_decomposition(expand_neurons=False)",
            cache.get_full_resid_decomposition(expand_neurons=False),
            tl_cache.get_full_resid_decomposition(expand_neurons=False),
        )
        stack = cache.decompose_resid()
        row(
            "apply_ln_to_stack(final)",
            cache.apply_ln_to_stack(stack),
            tl_cache.apply_ln_to_stack(stack),
        )
        row(
            "apply_ln_to_stack(layer 1)",
            cache.apply_ln_to_stack(cache.decompose_resid(1), 1),
            tl_cache.apply_ln_to_stack(cache.decompose_resid(1), 1),
        )
        a, b = 3, 7
        ours = cache.logit_attrs(stack, a, b)
        theirs = compat_cache.logit_attrs(compat_cache.decompose_resid(), a, b)
        row("logit_attrs(decompose_resid, a, b) vs TL compatibility mode", ours, theirs)
        # weights and circuits
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_O", "W_E", "W_U"):
            weight(name)
        ours_ov, theirs_ov = model.OV, bridge.OV
        row("OV norm", ours_ov.norm(), theirs_ov.norm())
        row("QK norm", model.QK.norm(), bridge.QK.norm())
        row(
            "OV eigenvalues (|λ| sorted)",
            ours_ov.eigenvalues.abs().sort(-1).values,
            theirs_ov.eigenvalues.abs().sort(-1).values,
        )
        for mode in "QKV":
            theirs = bridge.all_composition_scores(mode)
            theirs = getattr(theirs, "scores", theirs)
            row(f"all_composition_scores({mode!r})", model.all_composition_scores(mode), theirs)

        # a caller's hook that edits an activation: both caches hold what flows on (the edited
        # tensor)
        def zero_head(z, hook):
            z = z.clone()
            z[:, :, 1] = 0.0  # [batch, pos, head, d_head]
            return z

        edit = [("blocks.0.attn.hook_z", zero_head)]
        with torch.no_grad():
            edited_logits, edited = model.run_with_cache(ids, fwd_hooks=edit)
            with bridge.hooks(fwd_hooks=edit):
                tl_edited_logits, tl_edited = bridge.run_with_cache(ids)
        row(
            "run_with_cache with a caller's hook zeroing L0H1's z: logits",
            edited_logits,
            tl_edited_logits,
        )
        row(
            "  ... cached blocks.0.attn.hook_z (edited)",
            edited["blocks.0.attn.hook_z"],
            tl_edited["blocks.0.attn.hook_z"],
        )
        row(
            "  ... cached blocks.1.hook_resid_pre",
            edited["resid_pre", 1],
            tl_edited["blocks.1.hook_resid_pre"],
        )
        # patching
        corrupted = ids.clone()
        corrupted[:, 3] = (ids[:, 3] + 1) % len(CHARS)
        metric = patching.logit_diff_metric(a, b)
        row(
            "patching resid_pre [layer, pos]",
            patching.get_act_patch_resid_pre(model, corrupted, cache, metric).values,
            tl_patching.get_act_patch_resid_pre(bridge, corrupted, tl_cache, metric),
        )
        row(
            "patching head out, all pos [layer, head]",
            patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric).values,
            tl_patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, tl_cache, metric),
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--styles", default=",".join(STYLES))
    args = parser.parse_args()
    from importlib.metadata import version

    print(
        f"attnlab {attnlab.__version__}, TransformerLens {version('transformer_lens')}, "
        f"torch {torch.__version__}, float32"
    )
    rows: list[tuple[str, str, float]] = []
    for style in args.styles.split(","):
        try:
            compare(style, rows)
        except Exception as exc:  # report what TransformerLens could not do and go on
            rows.append(
                (
                    style,
                    f"stopped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
                    float("nan"),
                )
            )
    for style, what, value in rows:
        verdict = "equal" if value < 1e-4 else ("n/a" if value != value else "DIFFERENT")
        print(f"{style:7} {what:60} {value:10.2e}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
