"""Generation speed: attnlab's generate against Hugging Face transformers' and llama.cpp on the same
weights.

    .venv/bin/python benchmarks/generate_speed.py                 # both architectures, B = 1, 8, 32
    .venv/bin/python benchmarks/generate_speed.py --arch gpt2 --new-tokens 100 --only variants   #
    quick look
    .venv/bin/python benchmarks/generate_speed.py --llama-cpp DIR --only llama-cpp ttft batches

Design choices:
- The model is nanoGPT's shakespeare_char shape (6 layers, d_model 384, 6 heads, 65 tokens),
  GPT-2-style (learned positions, LayerNorm, GELU) and LLaMA-style (RoPE, RMSNorm, SwiGLU, 2
  key/value heads), with random weights. attnlab writes it with attnlab.save(model, dir,
  format="hf"); both libraries then load that one directory, so they run the same weights.
- Greedy decoding of 500 new tokens after a 16-token prompt; tokens/s counts new tokens (prompt
  included in the time). Each figure is the median of --repeats runs after a warm-up run (which also
  compiles), and every ratio is to transformers measured in the same process.
- The optimisations are switched on one at a time: the foundation's decode loop (cache slices that
  grow each step), then the static decode step (tensor slot, key mask, whole buffer), then
  torch.compile of that step, then bf16 (the whole model), then bf16 weights with float32
  activations.
- Memory-bandwidth limit: a batch-1 step reads every weight once, so tokens/s can't exceed
  bandwidth / bytes of weights; the bandwidth is a 256 MB copy measured here (read + write bytes).
- `--device cuda` runs the same table on a GPU (both libraries, same weights); times end with a
  synchronize, and the bandwidth limit uses the GPU's own copy bandwidth.
- bf16 accuracy: teacher-forced logits of the bf16 model against float32 on one 516-token sequence
  (max |difference| relative to the logits' spread, top-1 agreement) and the greedy tokens it
  shares.
- Weights are drawn from N(0, 0.1) rather than GPT-2's N(0, 0.02) so that greedy choices are not
  near-ties, where two correct implementations may legitimately pick different tokens.
- llama.cpp (`--llama-cpp DIR`, see _llama_cpp.py): the issue's two LLaMA-style models written as
  GGUF, float32 and Q8_0, `llama-bench -p 0 -n N` against attnlab's default path (float32 and int8),
  alternating run by run within each of --repeats rounds, from one token and an empty cache as
  llama-bench does; medians and ratios; attnlab's greedy tokens against transformers' on the same
  weights, over at least GREEDY_CHECK (500) tokens.
- Batches (`--only batches`, B = --batches): left-padded prompts of 8..16 tokens on the --batch-arch
  model, the default path, compile=True and transformers alternating within each round; greedy
  tokens checked against transformers'.
- Time to first token: a fresh Python process per measurement (imports, load, first and second
  token), with
  empty caches (cold: the kernels compile, inductor compiles) and then with the caches of the first
  run (warm).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_results_argument,
    benchmark_device,
    copy_bandwidth,
    figure,
    machine_description,
    machine_line,
    median_time,
    write_result,
)
from _llama_cpp import BUILDS, bench, find_tools, quantize_q8_0  # noqa: E402

import attnlab  # noqa: E402
from attnlab.generate.kv_cache import KVCache
from attnlab.generate.loop import generate, prefill  # noqa: E402
from attnlab.generate.sampling import filter_logits, sample_next
from attnlab.quant.quantize import store_weights_as  # noqa: E402

SHAPE = dict(n_layers=6, d_model=384, n_heads=6, d_vocab=65, n_ctx=1024)
ARCHS = {
    "gpt2": dict(SHAPE, mlp="gelu_tanh"),
    "llama": dict(
        SHAPE,
        n_kv_heads=2,
        d_mlp=1024,
        positional="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tie_embeddings=False,
    ),
}
PROMPT = 16
# tokens of greedy output compared with transformers' in the llama.cpp table, at least
GREEDY_CHECK = 500


def build(arch: str, directory: Path, seed: int = 0, device: torch.device | str = "cpu"):
    """(attnlab model, transformers model), both loaded from one Hugging Face-format directory onto
    `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = attnlab.Transformer(attnlab.ModelConfig(**ARCHS[arch]))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    attnlab.save(model, directory, format="hf")
    ours = attnlab.load(directory, device=str(device)).eval()
    theirs = AutoModelForCausalLM.from_pretrained(directory).to(device).eval()
    return ours, theirs


def weight_bytes(model) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter, and the int8 weights and
    scales `attnlab.quantize` keeps as buffers, except the embedding tables it reads one row of (the
    tied LM head still reads the whole token embedding)."""
    quantized = [b for name, b in model.named_buffers() if name.endswith((".weight", ".scale"))]
    total = sum(p.numel() * p.element_size() for p in [*model.parameters(), *quantized])
    tables = [model.pos_embed] if model.pos_embed is not None else []
    if model.unembed is None or model.unembed.weight is not model.embed.weight:
        tables.append(model.embed)
    return total - sum(t.weight.numel() * t.weight.element_size() for t in tables)


@torch.no_grad()
def generate_foundation(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """The foundation's greedy decode loop: a preallocated cache returned as slices [0, pos] that
    grow
    each step (so every step has new shapes), and Python-int positions."""
    B, T = ids.shape  # batch, prompt positions
    cache = KVCache.for_model(model, B, T + new)
    logits = prefill(model, ids, cache)
    out = [ids]
    for i in range(new):
        token = logits.argmax(-1, keepdim=True)
        out.append(token)
        if i < new - 1:
            logits = model(token, kv_cache=cache, start_pos=T + i)[:, -1]
    return torch.cat(out, dim=-1)


def hf_generate(
    theirs, ids: torch.Tensor, new: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    with torch.no_grad():
        return theirs.generate(
            ids,
            attention_mask=attention_mask if attention_mask is not None else torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two (1, n) sequences share."""
    differ = (a != b).nonzero()
    return int(differ[0, -1]) if len(differ) else a.shape[-1]


def bf16_accuracy(ours, ours_bf16, sequence: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        full = ours(sequence).float()
        half = ours_bf16(sequence).float()
    return {
        "max_rel": float((full - half).abs().max() / full.std()),
        "top1": float((full.argmax(-1) == half.argmax(-1)).float().mean()),
    }


def padded_batch(
    B: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts of 8..16 random tokens, left-padded to 16, and their attention mask."""
    lengths = torch.randint(8, PROMPT + 1, (B,), generator=generator)
    ids = torch.randint(0, SHAPE["d_vocab"], (B, PROMPT), generator=generator)
    mask = (torch.arange(PROMPT) >= PROMPT - lengths[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


def run_arch(arch: str, args, bandwidth: float, figures: list[dict]) -> list[str]:
    """The variants' table of one architecture; each variant's tokens/s beside transformers' goes
    into `figures`."""
    lines = []
    device = args.device
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = build(arch, Path(tmp), device=device)
    new, reps = args.new_tokens, args.repeats
    timed = dict(clock=args.clock, device=device)
    ids = torch.randint(
        0, SHAPE["d_vocab"], (1, PROMPT), generator=torch.Generator().manual_seed(1)
    ).to(device)
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    # bf16 weights, float32 activations
    ours_bf16w = store_weights_as(copy.deepcopy(ours), torch.bfloat16)

    reference = hf_generate(theirs, ids, new)
    hf_s = median_time(lambda: hf_generate(theirs, ids, new), reps, **timed)
    ours_int8 = attnlab.quantize(copy.deepcopy(ours), "int8")
    variants = {
        "KV cache, eager (foundation loop)": lambda: generate_foundation(ours, ids, new),
        "+ static decode step (slot tensor, key mask), modules": lambda: generate(
            ours, ids, new, temperature=0, use_kernels=False
        ),
        "C kernels, eager (KernelDecoder: the default generate())": lambda: generate(
            ours, ids, new, temperature=0
        ),
        '+ int8 weights (quantize(model, "int8"), kernels)': lambda: generate(
            ours_int8, ids, new, temperature=0
        ),
        "+ torch.compile of the decode step": lambda: generate(
            ours, ids, new, temperature=0, compile=True
        ),
        "+ bf16 weights (compiled)": lambda: generate(
            ours_bf16, ids, new, temperature=0, compile=True
        ),
        "+ bf16 weights, float32 activations (compiled)": lambda: generate(
            ours_bf16w, ids, new, temperature=0, compile=True
        ),
    }
    limit_fp32 = bandwidth / weight_bytes(ours)
    limit_bf16 = bandwidth / weight_bytes(ours_bf16)
    limit_bf16w = bandwidth / weight_bytes(ours_bf16w)
    lines.append(
        f"\n## {arch}-style: {ours.num_params() / 1e6:.1f}M parameters, "
        f"{weight_bytes(ours) / 1e6:.1f} MB of "
        f"float32 weights read per token; bandwidth limit {limit_fp32:.0f} tokens/s (bf16: "
        f"{limit_bf16:.0f})"
    )
    lines.append(
        f"| variant (B=1, {new} new tokens) | tokens/s | × transformers | of bandwidth limit | "
        "greedy = transformers |"
    )
    lines.append("|---|---:|---:|---:|---|")
    lines.append(
        f"| transformers {__import__('transformers').__version__} generate | {new / hf_s:.0f} | "
        "1.00 | "
        f"{new / hf_s / limit_fp32:.0%} | (reference) |"
    )
    for name, fn in variants.items():
        out = fn()  # warm-up (compiles), and the tokens to compare
        seconds = median_time(fn, reps, warmup=0, **timed)
        limit = (
            limit_bf16w
            if "float32 activations" in name
            else limit_bf16
            if "bf16" in name
            else bandwidth / weight_bytes(ours_int8)
            if "int8" in name
            else limit_fp32
        )
        same = shared_prefix(out, reference) - PROMPT
        agree = "yes" if same == new else f"first {same} of {new}"
        figures.append(figure(f"{arch}-style, {name}", "tok/s", new / seconds, new / hf_s))
        lines.append(
            f"| {name} | {new / seconds:.0f} | {hf_s / seconds:.2f} | {new / seconds / limit:.0%} "
            f"| {agree} |"
        )
        print(lines[-1], flush=True)
    for label, narrow in (
        ("bf16", ours_bf16),
        ("bf16 weights, float32 activations", ours_bf16w),
        ("int8 weights, float32 activations", ours_int8),
    ):
        acc = bf16_accuracy(ours, narrow, reference)
        narrow_tokens = generate(narrow, ids, new, temperature=0, compile=narrow is not ours_int8)
        lines.append(
            f"\n{label} accuracy: teacher-forced logits differ by at most {acc['max_rel']:.3f} × "
            "their std, "
            f"top-1 agrees at {acc['top1']:.1%} of {reference.shape[-1]} positions; greedy shares "
            "its first "
            f"{shared_prefix(narrow_tokens, reference) - PROMPT} of {new} tokens with float32"
        )

    # Sampling cost per token, B=1: the exponential race (no host read) against torch.multinomial.
    logits = torch.randn(1, SHAPE["d_vocab"], device=device)
    g = torch.Generator(device=device).manual_seed(0)
    race = (
        median_time(
            lambda: [sample_next(logits, 0.8, 50, 0.95, g) for _ in range(1000)], reps, **timed
        )
        / 1000
    )
    multi = (
        median_time(
            lambda: [
                torch.multinomial(
                    torch.softmax(filter_logits(logits, 0.8, 50, 0.95), -1), 1, generator=g
                )
                for _ in range(1000)
            ],
            reps,
            **timed,
        )
        / 1000
    )
    lines.append(
        "\nsampling (temperature 0.8, top-k 50, top-p 0.95), per token: exponential race "
        f"{race * 1e6:.0f} µs, "
        f"torch.multinomial {multi * 1e6:.0f} µs"
    )
    return lines


def run_batches(args) -> list[str]:
    """Batched generation (left-padded prompts of 8..16 tokens): the default path, compile=True and
    transformers, on the --batch-arch model; alternating within each of --repeats rounds,
    medians."""
    device, new = args.device, args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = build(args.batch_arch, Path(tmp), device=device)
    lines = [
        f"\n## Batches, {args.batch_arch}-style 6 x 384, left-padded prompts of 8..16 tokens, "
        f"{new} new tokens, "
        f"{torch.get_num_threads()} threads, clock: {args.clock} (tokens/s, median of "
        f"{args.repeats} alternating rounds)",
        "| batch | default (kernels) | compiled | transformers | default × transformers | "
        "compiled × transformers |"
        " greedy: default = transformers |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    once = dict(repeats=1, warmup=0, clock=args.clock, device=device)
    for B in args.batches:
        bids, mask = padded_batch(B, torch.Generator().manual_seed(B), device)
        runs = {
            "ours": lambda: generate(ours, bids, new, temperature=0, attention_mask=mask),
            "compiled": lambda: generate(
                ours, bids, new, temperature=0, attention_mask=mask, compile=True
            ),
            "hf": lambda: hf_generate(theirs, bids, new, mask),
        }
        same = torch.equal(runs["ours"](), runs["hf"]())  # and the warm-up (compiles)
        runs["compiled"]()
        seconds = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                seconds[name].append(median_time(run, **once))
        med = {name: statistics.median(values) for name, values in seconds.items()}
        lines.append(
            f"| B={B} | {B * new / med['ours']:.0f} | {B * new / med['compiled']:.0f} | "
            f"{B * new / med['hf']:.0f} | "
            f"**{med['hf'] / med['ours']:.2f}** | {med['hf'] / med['compiled']:.2f} | "
            f"{'yes' if same else 'no'} |"
        )
        print(lines[-1], flush=True)
    return lines


LLAMA_CPP_MODELS = {  # the two models: label -> (LLaMA-style config, new tokens)
    "6 layers x 384, vocab 65 (the LLaMA-style model above)": (ARCHS["llama"], 500),
    "SmolLM2-135M shape (30 x 576, 9 heads / 3 kv, vocab 49,152, tied)": (
        dict(
            n_layers=30,
            d_model=576,
            n_heads=9,
            n_kv_heads=3,
            d_mlp=1536,
            d_vocab=49152,
            n_ctx=2048,
            positional="rope",
            rope_theta=100000.0,
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            tie_embeddings=True,
        ),
        128,
    ),
}


def run_llama_cpp(args, tools, figures: list[dict]) -> list[str]:
    """llama.cpp F32 and Q8_0 against attnlab's default path (float32 and int8), compiled path and
    transformers, on the same random weights, alternating within each round; medians over --repeats
    rounds. attnlab's float32 beside llama.cpp's F32 and its int8 beside Q8_0 go into `figures`."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    lines = [
        f"\n## Side by side with llama.cpp: B=1, greedy, {threads} threads; llama-bench -p 0 -n N "
        f"-t {threads}, "
        f"median of {args.repeats} alternating rounds (tokens/s; clock: {args.clock})",
        "| model | llama.cpp F32 | llama.cpp Q8_0 | attnlab `generate()` (default, float32) | × "
        "F32 | "
        "attnlab int8 (default) | × Q8_0 | attnlab `compile=True` | transformers | greedy = "
        "transformers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for index, (label, (overrides, new)) in enumerate(LLAMA_CPP_MODELS.items()):
        if args.llama_new_tokens:
            new = args.llama_new_tokens[min(index, len(args.llama_new_tokens) - 1)]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            torch.manual_seed(0)
            model = attnlab.Transformer(attnlab.ModelConfig(**overrides)).eval()
            # confident greedy choices on the small model (see the docstring)
            if model.num_params() < 50e6:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.dim() > 1:
                            p.normal_(0.0, 0.1)
            f32 = attnlab.save(model, tmp / "f32.gguf")
            q8 = quantize_q8_0(tools, f32, tmp / "q8_0.gguf")
            attnlab.save(model, tmp / "hf", format="hf")
            theirs = AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
            int8 = attnlab.quantize(copy.deepcopy(model), "int8")
            ids = torch.randint(
                0, model.config.d_vocab, (1, 1), generator=torch.Generator().manual_seed(1)
            )
            once = dict(repeats=1, warmup=0, clock=args.clock)
            runs = {  # llama-bench starts from one token and an empty cache: so do these
                "f32": lambda: bench(tools, f32, new, threads, 1, args.clock),
                "ours": lambda: (
                    new / median_time(lambda: generate(model, ids, new, temperature=0), **once)
                ),
                "q8": lambda: bench(tools, q8, new, threads, 1, args.clock),
                "int8": lambda: (
                    new / median_time(lambda: generate(int8, ids, new, temperature=0), **once)
                ),
                "hf": lambda: new / median_time(lambda: hf_generate(theirs, ids, new), **once),
            }
            if args.llama_compile:
                runs["compiled"] = lambda: (
                    new
                    / median_time(
                        lambda: generate(model, ids, new, temperature=0, compile=True), **once
                    )
                )
                generate(model, ids, new, temperature=0, compile=True)  # compiles
            generate(model, ids, new, temperature=0)
            generate(int8, ids, new, temperature=0)
            rates = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    rates[name].append(run())
            med = {name: statistics.median(values) for name, values in rates.items()}
            # the promise: identical greedy tokens for 500 of them
            check = max(new, GREEDY_CHECK)
            same = (
                shared_prefix(
                    generate(model, ids, check, temperature=0), hf_generate(theirs, ids, check)
                )
                - 1
            )
            figures += [
                figure(f"{label}, {new} tokens, float32 (F32)", "tok/s", med["ours"], med["f32"]),
                figure(f"{label}, {new} tokens, int8 (Q8_0)", "tok/s", med["int8"], med["q8"]),
            ]
            compiled = f"{med['compiled']:.1f}" if "compiled" in med else "-"
            lines.append(
                f"| {label}, {new} tokens | {med['f32']:.1f} | {med['q8']:.1f} | "
                f"**{med['ours']:.1f}** | "
                f"**{med['ours'] / med['f32']:.2f}** | **{med['int8']:.1f}** | "
                f"**{med['int8'] / med['q8']:.2f}** | "
                f"{compiled} | {med['hf']:.1f} | "
                f"{f'yes ({check})' if same == check else f'first {same} of {check}'} |"
            )
            print(lines[-1], flush=True)
            print(
                "   rounds: "
                + "; ".join(
                    f"{k} " + " ".join(f"{v:.1f}" for v in vals) for k, vals in rates.items()
                ),
                flush=True,
            )
    return lines


TTFT_CHILD = """
import sys, time
import torch, attnlab
model = attnlab.load(sys.argv[1])
if sys.argv[2] == "int8":
    attnlab.quantize(model, "int8")
ids = torch.randint(0, model.config.d_vocab, (1, 16), generator=torch.Generator().manual_seed(0))
seen = []
def on_token(token):
    seen.append(time.time())
    if len(seen) == 2:
        print(*seen, flush=True)
        import os; os._exit(0)
model.generate(ids, 8, temperature=0, compile=sys.argv[2] == "compile", on_token=on_token)
"""


def time_to_first_token(model_dir: Path, mode: str, env: dict[str, str]) -> tuple[float, float]:
    """Seconds from starting a fresh Python process (which imports torch and attnlab, loads the
    model and, for mode "compile", compiles) to its first and its second generated token (the second
    is the first decode step)."""
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-c", TTFT_CHILD, str(model_dir), mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    first, second = map(float, result.stdout.split()[-2:])
    return first - start, second - start


def run_ttft(args, tools) -> list[str]:
    """Time to first token in a fresh process, cold (empty kernel / inductor caches) and warm, for
    the 6 x 384 LLaMA-style model; and llama-bench's whole process for one token, which loads its
    model the same way."""
    lines = [
        "\n## Time to first token in a fresh process (6 x 384 LLaMA-style model, 16-token "
        "prompt): seconds from "
        "process start (imports and load included) to the first generated token / the second (the "
        "first decode "
        "step); warm: median of 3",
        "| path | cold caches | warm caches |",
        "|---|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        model = attnlab.Transformer(attnlab.ModelConfig(**ARCHS["llama"])).eval()
        attnlab.save(model, tmp / "model")
        modes = ["default", "int8"] + (["compile"] if args.ttft_compile else [])
        for mode in modes:
            env = {
                "ATTNLAB_CACHE": str(tmp / f"cold-{mode}"),
                "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{mode}"),
            }
            cold = time_to_first_token(tmp / "model", mode, env)
            warm = [time_to_first_token(tmp / "model", mode, env) for _ in range(3)]
            warm = [statistics.median(times) for times in zip(*warm)]
            name = {
                "default": "`generate()` (kernels, float32)",
                "int8": "int8 (kernels)",
                "compile": "`compile=True`",
            }[mode]
            lines.append(
                f"| attnlab {name} | {cold[0]:.2f} / {cold[1]:.2f} | {warm[0]:.2f} / "
                f"{warm[1]:.2f} |"
            )
            print(lines[-1], flush=True)
        if tools is not None:
            f32 = attnlab.save(model, tmp / "f32.gguf")
            start = time.time()
            subprocess.run(
                [
                    str(tools["bench"]),
                    "-m",
                    str(f32),
                    "-p",
                    "0",
                    "-n",
                    "1",
                    "-r",
                    "1",
                    "--no-warmup",
                ],
                check=True,
                capture_output=True,
            )
            lines.append(
                "| llama-bench -n 1 --no-warmup, the whole process (load, one token, exit) | | "
                f"{time.time() - start:.2f} |"
            )
            print(lines[-1], flush=True)
        python_only = time.time()
        subprocess.run([sys.executable, "-c", "import torch, attnlab"], check=True)
        lines.append(
            f"| (of which `import torch, attnlab` alone) | | {time.time() - python_only:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument("--new-tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 32])
    parser.add_argument(
        "--batch-arch", default="gpt2", help="architecture of the batched table (compiles per B)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (use with --threads 1 on a crowded machine)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--llama-cpp",
        default=None,
        metavar="DIR",
        help="folder with llama-bench and llama-quantize (or $ATTNLAB_LLAMA_CPP): adds the "
        "side-by-side table",
    )
    parser.add_argument(
        "--llama-new-tokens",
        type=int,
        nargs="+",
        default=None,
        help="override the side-by-side token counts (one per model, in the table's order)",
    )
    parser.add_argument(
        "--llama-compile", action="store_true", help="add compile=True to the side-by-side table"
    )
    sections = ["variants", "llama-cpp", "ttft", "batches"]
    parser.add_argument(
        "--only",
        choices=sections,
        nargs="+",
        default=None,
        help="which sections to run (default: all; llama-cpp only with --llama-cpp)",
    )
    parser.add_argument(
        "--ttft-compile",
        action="store_true",
        help="time to first token with compile=True too (slow)",
    )
    add_results_argument(parser)
    args = parser.parse_args()
    args.device = benchmark_device(args.device)
    tools = find_tools(args.llama_cpp)
    if args.only and "llama-cpp" in args.only and tools is None:
        raise SystemExit(
            "--only llama-cpp needs llama.cpp's tools: --llama-cpp DIR (or $ATTNLAB_LLAMA_CPP), a "
            "folder "
            "with llama-bench and llama-quantize (benchmarks/README.md shows how to build them)"
        )
    args.only = args.only or sections
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# Generation speed\n{machine_line(args.device)}, clock: {args.clock}", flush=True)
    bandwidth = statistics.median(
        copy_bandwidth(clock=args.clock, device=args.device) for _ in range(3)
    )
    print(f"copy bandwidth (256 MB, read + write): {bandwidth / 1e9:.1f} GB/s", flush=True)
    machine = machine_description(args.device, copy_bandwidth=bandwidth)
    threads = f"{torch.get_num_threads()} threads, clock {args.clock}"
    if tools is not None and "llama-cpp" in args.only:
        figures: list[dict] = []
        print("\n".join(run_llama_cpp(args, tools, figures)), flush=True)
        write_result(
            args.results,
            "generate_speed",
            measures="Greedy generation, B = 1, from one token and an empty cache: attnlab's "
            "generate() against llama-bench on the same random weights written as GGUF (F32, and "
            "Q8_0 beside attnlab's int8), alternating rounds.",
            anchor="llama.cpp's llama-bench",
            anchor_version=", ".join(sorted(BUILDS)) or None,
            figures=figures,
            setup=f"against llama.cpp, {threads}",
            machine=machine,
        )
    if "ttft" in args.only:
        print("\n".join(run_ttft(args, tools)), flush=True)
    if "batches" in args.only:
        print("\n".join(run_batches(args)), flush=True)
    if "variants" in args.only:
        figures = []
        for arch in args.arch:
            print("\n".join(run_arch(arch, args, bandwidth, figures)), flush=True)
        write_result(
            args.results,
            "generate_speed",
            measures="Greedy generation, B = 1, of nanoGPT's shakespeare_char shape (random "
            "weights, GPT-2 and LLaMA styles): attnlab's generate() paths against Hugging Face "
            "transformers' generate() on the same weights.",
            anchor="transformers",
            anchor_version=__import__("transformers").__version__,
            figures=figures,
            setup=f"against transformers, {args.new_tokens} new tokens, {threads}",
            machine=machine,
        )
    print(f"\nend: {machine_line(args.device)}")


if __name__ == "__main__":
    main()
