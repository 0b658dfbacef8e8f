"""Interpretability at speed: a full head-patching sweep and `run_with_cache`, attnlab against
TransformerLens on the same weights, side by side and alternating (run outside the test suite).

    python benchmarks/patching_speed.py                  # SmolLM2-135M (attnlab.load("smollm2"))
    python benchmarks/patching_speed.py --model tiny --tokens 12 --repeats 1   # a check in seconds
    python benchmarks/patching_speed.py --only cache     # run_with_cache and forward (~4 min)

TransformerLens is not a dependency of attnlab; run this with a Python that has both, as
benchmarks/compare_transformer_lens.py says (a throwaway venv that sees attnlab's venv through a
.pth file, plus `pip install transformer_lens`).

What it does:
- The model: attnlab loads it (SmolLM2's GGUF file, float32 after dequantization; or `--model tiny`,
  a random 2-layer LLaMA-style model with grouped key/value heads), writes it as a Hugging Face
  directory (`attnlab.save(model, dir, format="hf")`) and TransformerLens boots its
  TransformerBridge on that directory, so both hold the same float32 weights (the logits are
  compared first).
- The sweep: every head of every layer, its output z patched at all positions from a clean prompt
  into a corrupted one of `--tokens` tokens (random token ids; the corrupted prompt differs in two
  positions), metric the logit difference of two tokens at the last position.
  TransformerLens: `transformer_lens.patching.get_act_patch_attn_head_out_all_pos` (one whole run
  per head); attnlab: the same-named function (its fast path: each run starts at the patched layer,
  a layer's runs stacked in one batch). The two results are compared (largest difference relative
  to the largest value), and `--reference` also times attnlab's reference path (one whole run per
  head, as TransformerLens does).
- run_with_cache: `--cache-batch` x `--cache-tokens` random tokens, every hook cached (both sides'
  defaults), and a plain forward for scale; tokens per second; which products attnlab's forward
  ran (attnlab's C kernels, or torch's and why: fast_layers.inference_kernels_unusable) and its
  logits against TransformerLens's. The caches of the first prompt are compared hook by hook.
- Each measurement is the median of `--repeats`, the two libraries alternating (TransformerLens
  first in odd repeats, attnlab first in even ones), after two untimed runs of each.
- `--profile`: also prints torch.profiler's top operators of attnlab's run_with_cache and forward
  (where the time of caching goes).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_results_argument,
    figure,
    machine_description,
    machine_line,
    write_result,
)
from compare_transformer_lens import boot, build, relative  # noqa: E402

import attnlab  # noqa: E402
from attnlab.inspection import patching  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags() -> str:
    """The vector extensions of FLAGS that /proc/cpuinfo lists (what lscpu's Flags line says)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        flags = []
    return " ".join(f for f in FLAGS if f in flags) or "none of " + " ".join(FLAGS)


FAULTS: dict[str, float] = {}  # run name -> median page faults per call, filled by `alternate`


def page_faults() -> int:
    """This process's minor page faults so far (getrusage): new pages the kernel gave it."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def alternate(
    runs: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds of each run over `repeats` rounds, the order reversed every other round,
    after two untimed rounds (each run's output is kept until its next call returns, as
    `logits, cache = model.run_with_cache(ids)` in a loop keeps it: a library's steady state with
    two outputs alive takes two calls to reach, and after the sweep the first timed call of both
    paid for it, 144,000 and 616,000 page faults); also the last output of each. Each run's median
    page faults go to FAULTS."""
    for _ in range(2):
        outputs = {name: fn() for name, fn in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    faults: dict[str, list[int]] = {name: [] for name in runs}
    for round_ in range(repeats):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            before, start = page_faults(), time.perf_counter()
            outputs[name] = runs[name]()
            times[name].append(time.perf_counter() - start)
            faults[name].append(page_faults() - before)
    FAULTS.update({name: statistics.median(f) for name, f in faults.items()})
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def load(model_name: str, out: Path):
    """attnlab's model and TransformerLens's bridge on the same weights (a Hugging Face directory
    that attnlab wrote)."""
    path = out / model_name
    if model_name == "tiny":
        model = build("llama", path)
    else:
        model = attnlab.load(model_name)
        attnlab.save(model, path, format="hf")
    return model.eval(), boot(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny")
    parser.add_argument("--tokens", type=int, default=64, help="prompt length of the sweep")
    parser.add_argument("--cache-batch", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--reference", action="store_true", help="also time the reference path")
    parser.add_argument("--profile", action="store_true", help="top operators of run_with_cache")
    parser.add_argument(
        "--only",
        choices=["sweep", "cache"],
        help="time only the patching sweep, or only run_with_cache and the forward",
    )
    add_results_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from importlib.metadata import version

    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        raise SystemExit(
            "this benchmark needs TransformerLens, which attnlab does not depend on: run it with a "
            "throwaway venv that has it (see this script's docstring)"
        ) from None

    print(machine_line())
    print(f"CPU flags: {cpu_flags()}")
    print(
        f"attnlab {attnlab.__version__}, TransformerLens {version('transformer_lens')}, "
        f"model {args.model}, float32, {args.repeats} repeats (median), alternating"
    )
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model, bridge = load(args.model, Path(tmp))
        cfg = model.config
        g = torch.Generator().manual_seed(0)
        # token ids below 256 exist in every vocabulary here (the tiny one has 30)
        vocab = min(cfg.d_vocab, 256 if args.model == "tiny" else cfg.d_vocab)
        clean = torch.randint(0, vocab, (1, args.tokens), generator=g)
        corrupted = clean.clone()
        for pos in (1, args.tokens // 2):  # two tokens differ, as a name swap would
            corrupted[0, pos] = (clean[0, pos] + 1) % vocab
        answer, wrong = (int(t) for t in torch.randint(0, vocab, (2,), generator=g))
        metric = patching.logit_diff_metric(answer, wrong)
        logits, cache = model.run_with_cache(clean)
        tl_logits, tl_cache = bridge.run_with_cache(clean)
        print(
            "logits, attnlab vs TransformerLens: relative difference "
            f"{relative(logits, tl_logits):.1e}"
        )
        shared = [name for name in cache.keys() if name in tl_cache]
        worst = max(shared, key=lambda name: relative(cache[name], tl_cache[name]))
        print(
            f"caches, the {len(shared)} hooks both have: largest relative difference "
            f"{relative(cache[worst], tl_cache[worst]):.1e} ({worst})"
        )

        sweep_ratio = cache_ratio = None
        figures = []
        machine = machine_description()  # the load average before the timed runs
        if args.only != "cache":
            times = sweep(args, model, bridge, corrupted, cache, tl_cache, metric)
            sweep_ratio = times["TransformerLens"] / times["attnlab"]
            figures.append(
                figure(
                    "head-patching sweep", "s", times["attnlab"], times["TransformerLens"], "lower"
                )
            )
        if args.only != "sweep":
            rates = cache_and_forward(args, model, bridge, vocab)
            cache_ratio = rates["attnlab run_with_cache"] / rates["TransformerLens run_with_cache"]
            figures += [
                figure(what, "tok/s", rates[f"attnlab {what}"], rates[f"TransformerLens {what}"])
                for what in ("run_with_cache", "forward")
            ]
        write_result(
            args.results,
            "patching_speed",
            measures="A head-patching sweep (every head's z, all positions) and run_with_cache of "
            "every hook, attnlab against TransformerLens on the same float32 weights, alternating.",
            anchor="TransformerLens",
            anchor_version=version("transformer_lens"),
            figures=figures,
            setup=f"{args.model}, sweep {args.tokens} tokens, cache {args.cache_batch} x "
            f"{args.cache_tokens} tokens, {torch.get_num_threads()} threads",
            machine=machine,
        )
        print(
            "\nratios: "
            + ", ".join(
                f"{name} {ratio:.2f}x (goal {goal})"
                for name, ratio, goal in (
                    ("head-patching sweep", sweep_ratio, "5x"),
                    ("run_with_cache", cache_ratio, "2x"),
                )
                if ratio is not None
            )
        )
        if args.profile:
            ids = cache_ids(args, vocab)
            from torch.profiler import ProfilerActivity, profile

            for what, fn in (
                ("run_with_cache", lambda: model.run_with_cache(ids)),
                ("forward", lambda: model(ids)),
            ):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    fn()
                print(f"\nattnlab {what}, top operators by own time:")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


def sweep(args, model, bridge, corrupted, cache, tl_cache, metric) -> dict[str, float]:
    """Time the full head-patching sweep of both libraries (and attnlab's reference path with
    --reference); print the results' differences and the times; return the times (s)."""
    from transformer_lens import patching as tl_patching

    cfg = model.config
    # the full head-patching sweep
    runs = {
        "TransformerLens": lambda: tl_patching.get_act_patch_attn_head_out_all_pos(
            bridge, corrupted, tl_cache, metric
        ),
        "attnlab": lambda: patching.get_act_patch_attn_head_out_all_pos(
            model, corrupted, cache, metric
        ),
    }
    if args.reference:
        runs["attnlab reference path"] = lambda: patching.get_act_patch_attn_head_out_all_pos(
            model, corrupted, cache, metric, path="reference"
        )
    times, outputs = alternate(runs, args.repeats)
    theirs, ours = outputs["TransformerLens"], outputs["attnlab"]
    print(
        f"\nhead-patching sweep: {cfg.n_layers} layers x {cfg.n_heads} heads, "
        f"{args.tokens} tokens, logit difference; attnlab took the {ours.notes['path']} path"
    )
    difference = relative(ours.values, theirs)
    print(
        f"  results, attnlab vs TransformerLens: relative difference {difference:.1e} "
        f"({'equal' if difference < 1e-4 else 'DIFFERENT'})"
    )
    if args.reference:
        reference = outputs["attnlab reference path"].values
        print(
            "  attnlab fast vs reference path: relative difference "
            f"{relative(ours.values, reference):.1e}"
        )
    for name, seconds in times.items():
        print(f"  {name:24} {seconds:8.2f} s")
    sweep_ratio = times["TransformerLens"] / times["attnlab"]
    print(f"  attnlab / TransformerLens speed: {sweep_ratio:.2f}x")
    return times


def cache_ids(args, vocab: int) -> torch.Tensor:
    """The run_with_cache benchmark's random tokens [cache_batch, cache_tokens]."""
    return torch.randint(
        0, vocab, (args.cache_batch, args.cache_tokens), generator=torch.Generator().manual_seed(1)
    )


def cache_and_forward(args, model, bridge, vocab: int) -> dict[str, float]:
    """Time run_with_cache and a plain forward of both libraries on the same tokens; print the
    tokens per second and which path attnlab's forward took; return the tokens per second of
    each ("attnlab forward", "TransformerLens run_with_cache", ...)."""
    from attnlab.generate import kernels
    from attnlab.generate.fast_layers import inference_kernels_unusable

    # run_with_cache and a plain forward
    ids = cache_ids(args, vocab)
    n = ids.numel()
    runs = {
        "TransformerLens run_with_cache": lambda: bridge.run_with_cache(ids),
        "attnlab run_with_cache": lambda: model.run_with_cache(ids),
    }
    cache_times, _ = alternate(runs, args.repeats)
    runs = {
        "TransformerLens forward": lambda: bridge(ids),
        "attnlab forward": lambda: model(ids),
    }
    forward_times, _ = alternate(runs, args.repeats)
    print(
        f"\nrun_with_cache and forward, {args.cache_batch} x {args.cache_tokens} tokens (tok/s; "
        "page faults per call, 4 KiB or 2 MB pages)"
    )
    for name, seconds in {**cache_times, **forward_times}.items():
        print(f"  {name:32} {n / seconds:8.0f}   {FAULTS[name]:9,.0f} faults")
    cache_ratio = (
        cache_times["TransformerLens run_with_cache"] / cache_times["attnlab run_with_cache"]
    )
    forward_ratio = forward_times["TransformerLens forward"] / forward_times["attnlab forward"]
    print(
        f"  attnlab / TransformerLens speed: run_with_cache {cache_ratio:.2f}x, "
        f"forward {forward_ratio:.2f}x"
    )
    why = inference_kernels_unusable()
    if why is None:
        products = {
            "amx": "AMX's tiles at float32's accuracy (kernels.float_products)",
            "c": "the C kernels' float32 tiles",
            "torch": "torch's GEMM (measured faster here: kernels.float_rows)",
        }[kernels.float_products()]
        hooked = (
            "on AMX's tiles"
            if kernels.float_products() == "amx"
            else "the C kernels'"
            if kernels.attention_rows()
            else "torch's (measured faster here: kernels.attention_rows)"
        )
        fused = "the C kernels'" if kernels.float_rows() else "torch's"
        hooked_parts = "hooked or not" if kernels.float_products() != "torch" else "unhooked"
        products += (
            f"; attention with its pattern (hooked) {hooked}, fused (no hooks) {fused}; RoPE in "
            f"C, RMSNorm and SwiGLU in C {hooked_parts}"
        )
    else:
        products = f"torch's ({why})"
    print(f"  attnlab's products and attention: {products}")
    with torch.no_grad():
        fast = model(ids)
        logits = bridge(ids)
    print(f"  logits, attnlab vs TransformerLens: relative difference {relative(fast, logits):.1e}")
    return {name: n / seconds for name, seconds in {**cache_times, **forward_times}.items()}


if __name__ == "__main__":
    raise SystemExit(main())
