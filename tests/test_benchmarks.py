"""The benchmark scripts still run: a tiny attention sweep end to end, and --device refusals in one
line; and each wired benchmark's quick run writes a results record (into a temporary folder, never
into benchmarks/results/) that benchmarks/render_results.py accepts.

The full runs take minutes to hours (benchmarks/README.md) and their numbers are never asserted;
these tests only keep the scripts from rotting as the library changes under them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True, timeout=600
    )


def rendered_record(folder: Path, benchmark: str, script: str | None = None) -> dict:
    """The one record in `folder`, checked as the results page reads it and rendered into a table
    of `benchmark` that shows each of its figures; its command runs `script` when given."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from render_results import load_records, render
    finally:
        sys.path.remove(str(BENCHMARKS))
    (record,) = load_records(folder)
    page = render([record])
    assert record["benchmark"] == benchmark and f"## {benchmark}" in page
    assert all(f"| {figure['name']} |" in page for figure in record["figures"])
    assert script is None or f"python benchmarks/{script} " in record["command"]
    assert record["versions"]["torch"] == torch.__version__
    return record


@pytest.mark.parametrize("window", [None, 16])
def test_attention_sweep_writes_its_table_json_and_plots(tmp_path, window):
    done = run_script(
        "attention_speed.py",
        "--min-t",
        "64",
        "--max-t",
        "64",
        "--paths",
        "chunked",
        # a memory probe is a process: 4 here
        "--repeats",
        "1",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
        "--results",
        str(tmp_path / "results"),
        *(["--window", str(window)] if window else []),
    )
    assert done.returncode == 0, done.stderr
    record = rendered_record(tmp_path / "results", "attention_speed", "attention_speed.py")
    assert [f["name"] for f in record["figures"]] == [
        f"chunked, {p}, T=64, {what}" for p in ("forward", "forward+backward")
        for what in ("time", "peak memory")
    ]  # fmt: skip
    assert record["anchor"] == "torch's SDPA" and record["figures"][0]["anchor"] > 0
    results = record["details"]
    assert (
        results["device"] == "cpu" and results["dtype"] == "float32" and results["window"] == window
    )
    assert [row["T"] for row in results["rows"]] == [64]
    for row in results["rows"]:
        for pass_ in ("forward", "forward+backward"):
            assert set(row["time"][pass_]) == {"sdpa", "chunked"}
            assert all(t > 0 for t in row["time"][pass_].values())
            assert all(m is not None and m >= 0 for m in row["memory"][pass_].values())
    assert (tmp_path / "attention_time.png").stat().st_size > 0 and (
        tmp_path / "attention_memory.png"
    ).stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("script", ["attention_speed.py", "train_speed.py", "generate_speed.py"])
def test_device_cuda_without_a_gpu_is_one_line(script):
    done = run_script(script, "--device", "cuda")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "no CUDA GPU" in lines[0], (
        done.stderr
    )


@pytest.mark.parametrize("name", ["foo", "mps"])
def test_a_device_the_benchmarks_do_not_run_on_is_one_line(name):
    done = run_script("attention_speed.py", "--device", name)
    lines = done.stderr.strip().splitlines()
    assert (
        done.returncode != 0 and len(lines) == 1 and "the benchmarks run on cpu or cuda" in lines[0]
    ), done.stderr


def test_speedrun_without_a_prepared_nanogpt_is_one_line(tmp_path):
    done = run_script(
        "speedrun.py", "--nanogpt", str(tmp_path), "--data", str(tmp_path / "input.txt")
    )
    lines = done.stderr.strip().splitlines()
    assert (
        done.returncode != 0 and len(lines) == 1 and "no data/shakespeare_char/val.bin" in lines[0]
    ), done.stderr


def test_a_llama_cpp_folder_without_its_tools_is_one_line(tmp_path):
    done = run_script("generate_speed.py", "--llama-cpp", str(tmp_path), "--only", "llama-cpp")
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "llama-bench" in lines[0], done.stderr


def test_the_gguf_writing_benchmark_without_llama_cpp_tools_is_one_line(tmp_path):
    done = run_script("gguf_write_llama_cpp.py", "--llama-cpp", str(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "llama-simple" in lines[0], done.stderr


@pytest.mark.slow
@pytest.mark.browser
def test_explorer_long_text_benchmark_runs_both_encodings(tmp_path):
    """benchmarks/explorer_long_text.py, small (a 600-token text, one round): both encodings reach
    the page, and float16 with a causal pattern's triangle is under 40 % of float32's bytes (the
    times are reported, not checked)."""
    out = tmp_path / "long.json"
    result = run_script(
        "explorer_long_text.py",
        "--rounds",
        "1",
        "--tokens",
        "600",
        "--no-machine",
        "--json",
        str(out),
        "--results",
        str(tmp_path / "results"),
    )
    assert result.returncode == 0, result.stderr
    record = rendered_record(tmp_path / "results", "explorer_long_text", "explorer_long_text.py")
    assert record["figures"][0]["ratio"] > 1  # float16's bytes are fewer
    medians = json.loads(out.read_text())["medians"]
    assert medians["f16"]["bytes"] < 0.4 * medians["f32"]["bytes"], medians
    assert "| f16 / f32 |" in result.stdout


@pytest.mark.slow
@pytest.mark.browser
def test_explorer_full_context_benchmark_times_each_step(tmp_path):
    """benchmarks/explorer_full_context.py, small (the browser tests' LLaMA, a 700-token text): it
    processes the text, paints the first head, switches heads and zooms down to single cells, and
    reports each (the times are reported, not checked)."""
    sys.path.insert(0, str(BENCHMARKS.parent / "tests"))
    from explorer_models import small_models

    import attnlab

    attnlab.save(small_models()["llama"], tmp_path / "llama")
    source = tmp_path / "text.txt"
    source.write_text("the cat sat on the mat.\n" * 100)
    out = tmp_path / "full.json"
    result = run_script(
        "explorer_full_context.py",
        "--model",
        str(tmp_path / "llama"),
        "--text",
        str(source),
        "--tokens",
        "700",
        "--switches",
        "3",
        "--zoom-steps",
        "12",
        "--no-machine",
        "--json",
        str(out),
        "--screenshot",
        str(tmp_path / "shot.png"),
        "--shot-head",
        "1.2",
        "--results",
        str(tmp_path / "results"),
    )
    assert result.returncode == 0, result.stderr
    record = rendered_record(
        tmp_path / "results", "explorer_full_context", "explorer_full_context.py"
    )
    assert record["anchor"] is None and len(record["figures"]) == 4
    numbers = json.loads(out.read_text())
    assert numbers["tokens"] == 696 and numbers["characters"] == 696  # whole lines of 24
    assert numbers["processing_ms"] > 0 and numbers["first_picture_ms"] > 0
    assert len(numbers["switches"]) == 3 and numbers["zooms"][-1]["level"] == 0
    assert numbers["memory_end"]["VmRSS"] > 0 and numbers["kept_bytes"] > 0
    assert (tmp_path / "shot.png").stat().st_size > 0 and (tmp_path / "shot-zoomed.png").exists()
    assert "| a zoom step" in result.stdout


def test_speedrun_table_states_every_seed_the_mean_and_the_goal():
    sys.path.insert(0, str(BENCHMARKS))
    from speedrun import markdown_table

    def row(seed, nano_wall, ours_wall, ours_val):
        return {
            "seed": seed,
            "first": "nanogpt",
            "load_before": 0.5,
            "load_after": 1.5,
            "nanogpt": {
                "wall_s": nano_wall,
                "cpu_s": 2 * nano_wall,
                "iter": 2000,
                "val_loss_full": 1.898,
            },
            "attnlab": {
                "wall_s": ours_wall,
                "cpu_s": 2 * ours_wall,
                "iter": 300,
                "val_loss_full": ours_val,
            },
        }

    def mean(rows):
        return {
            name: {
                key: sum(r[name][key] for r in rows) / len(rows)
                for key in ("wall_s", "cpu_s", "val_loss_full")
            }
            for name in ("nanogpt", "attnlab")
        }

    args = SimpleNamespace(concurrent=False, attnlab_flags="")
    rows = [row(1337, 60.0, 18.0, 1.874), row(2, 60.0, 18.0, 1.863), row(3, 60.0, 18.0, 1.857)]
    table = markdown_table(rows, mean(rows), "a machine", args)
    assert (
        "| 1337 | nanogpt | 0.5 -> 1.5 | 1.8980 | 60.0 (120.0) | 1.8740 | 18.0 (36.0) | 300 | "
        "0.300 | 0.300 |" in table
    )
    assert (
        "| mean | | | 1.8980 | 60.0 (120.0) | **1.8647** | 18.0 (36.0) | | **0.300** | 0.300 |"
        in table
    )
    assert ": met (worst seed 1.8740)" in table and "a machine" in table
    # each condition of the goal on its own: the first seed's time, the first seed's loss, any seed
    # above 1.90
    for rows in (
        [row(1337, 60.0, 21.0, 1.874), *rows[1:]],
        [row(1337, 60.0, 18.0, 1.887), *rows[1:]],
        [*rows[:2], row(3, 60.0, 18.0, 1.901)],
    ):
        assert "NOT met" in markdown_table(rows, mean(rows), "a machine", args)


def test_the_speedrun_record_holds_both_programs_means_and_every_seed(tmp_path):
    """speedrun.write_record (a full run takes ten minutes and nanoGPT): the mean wall and CPU
    times and losses beside nanoGPT's, each seed in the details, the ratio nanoGPT's time over
    attnlab's."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from speedrun import write_record
    finally:
        sys.path.remove(str(BENCHMARKS))
    sides = {"nanogpt": (60.0, 120.0, 1.898), "attnlab": (20.0, 36.0, 1.874)}
    rows = [{"seed": 1337, **{k: dict(zip(("wall_s", "cpu_s", "val_loss_full"), v))
                              for k, v in sides.items()}}]  # fmt: skip
    mean = {name: dict(side) for name, side in rows[0].items() if name != "seed"}
    args = SimpleNamespace(results=tmp_path, nanogpt=tmp_path, concurrent=False)
    write_record(args, rows, mean, 1e11, 2e10)
    record = rendered_record(tmp_path, "speedrun")
    wall, cpu, loss = record["figures"]
    assert (wall["attnlab"], wall["anchor"], wall["ratio"]) == (20.0, 60.0, 3.0)
    assert cpu["ratio"] == pytest.approx(120 / 36) and loss["ratio"] is None
    assert record["details"]["rows"] == rows and record["machine"]["copy_bandwidth"] == 2e10


def test_every_break_of_break_promises_still_matches_the_code_exactly_once():
    """benchmarks/break_promises.py's edits against today's code: a refactor that moves what a break
    edits shows here, in the suite, instead of as a NOT SEEN in the next long run of the script."""
    sys.path.insert(0, str(BENCHMARKS))
    from break_promises import BREAKS, edits_of

    root = BENCHMARKS.parent
    stale = [
        (item.name, file, old.strip()[:60])
        for item in BREAKS
        for file, old, _ in edits_of(item)
        if (root / file).read_text(encoding="utf-8").count(old) != 1
    ]
    assert not stale, stale
    assert len({item.name for item in BREAKS}) == len(BREAKS)
    tests = [node.split("::")[0].split(" -k ")[0] for item in BREAKS for node in item.tests]
    assert all((root / test).is_file() for test in tests), [
        t for t in tests if not (root / t).is_file()
    ]
    assert all((root / test).is_file() for test in tests), [
        t for t in tests if not (root / t).is_file()
    ]


def test_gguf_benchmark_reads_llama_perplexity_log_probabilities(tmp_path):
    """The file llama-perplexity --kl-divergence-base writes (format read in its perplexity.cpp),
    made up here: log p = scale * q + min_log_prob for each scored position of each chunk."""
    import numpy as np

    sys.path.insert(0, str(BENCHMARKS))
    from gguf_vs_llama_cpp import read_log_probs

    n_ctx, n_vocab, n_chunk = 8, 5, 2
    tokens = np.arange(n_chunk * n_ctx, dtype=np.int32) % n_vocab
    width = 2 * ((n_vocab + 1) // 2) + 4
    records = np.zeros((n_chunk, n_ctx - 1 - n_ctx // 2, width), dtype=np.uint16)
    records[..., :4] = np.array([0.5, -3.0], dtype=np.float32).view(np.uint16)
    records[..., 4 : 4 + n_vocab] = np.arange(n_vocab)
    path = tmp_path / "base.kld"
    path.write_bytes(
        b"_logits_"
        + np.array([n_ctx, n_vocab, n_chunk], dtype=np.int32).tobytes()
        + tokens.tobytes()
        + records.tobytes()
    )
    got_ctx, got_vocab, got_tokens, got_records = read_log_probs(path)
    assert (got_ctx, got_vocab) == (n_ctx, n_vocab) and got_tokens.shape == (n_chunk, n_ctx)
    head = got_records[1, 2, :4].copy().view(np.float32)
    assert list(head) == [0.5, -3.0] and list(got_records[1, 2, 4 : 4 + n_vocab]) == [0, 1, 2, 3, 4]


def test_the_bandwidth_limit_counts_the_bytes_an_int8_model_reads():
    """generate_speed's "of bandwidth limit" divides by weight_bytes: an int8 model keeps its
    weights as buffers, which it once left out (its rows read 0-1 % of the limit)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from generate_speed import weight_bytes
    finally:
        sys.path.remove(str(BENCHMARKS))
    import attnlab

    model = attnlab.Transformer(
        attnlab.ModelConfig(d_vocab=64, n_ctx=16, d_model=64, n_layers=2, n_heads=4)
    )
    float_bytes, int8_bytes = weight_bytes(model), weight_bytes(attnlab.quantize(model, "int8"))
    # the blocks' matrices in one byte each plus a float32 scale per row; norms and the tied
    # embedding stay float32
    assert 0.25 * float_bytes < int8_bytes < 0.6 * float_bytes, (float_bytes, int8_bytes)


def test_patching_benchmark_without_transformer_lens_is_one_line():
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("TransformerLens is installed here: the benchmark would run in full")
    done = run_script("patching_speed.py", "--model", "tiny")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "this benchmark needs TransformerLens, which attnlab does not depend on: run it with a "
        "throwaway venv that has it (see this script's docstring)"
    ]


def test_decode_ab_times_both_layouts_and_both_loops_on_the_shipped_file():
    """benchmarks/decode_ab.py end to end on SmolLM2's shipped Q4_1 file, one round: a table row
    with the three variants and their two ratios."""
    done = run_script("decode_ab.py", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    (row,) = [line for line in done.stdout.splitlines() if "| q4_1 |" in line]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 7 and all(float(c) > 0 for c in cells[2:])


@pytest.mark.parametrize("script", ["decode_ab.py", "decode_profile.py"])
def test_the_decode_benchmarks_name_a_file_that_is_no_model_in_one_line(script):
    """--files with a path that is no model: one line naming it, exit 1, no traceback."""
    done = run_script(script, "--files", "x=/nonexistent.gguf", "--rounds", "1")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"{script}: --files x=/nonexistent.gguf: /nonexistent.gguf: no such model directory (the "
        "name is spelled as a path, so it is not looked up on the Hugging Face Hub); check the path"
    ]


def test_amx_products_writes_its_table_or_says_why_not():
    """benchmarks/amx_products.py, one round: every product's row (times, ratio, errors of both
    within float32's) where AMX runs; elsewhere one line naming why, exit 1."""
    from attnlab.generate import kernels

    done = run_script("amx_products.py", "--repeats", "1")
    why = kernels.amx_unusable()
    if why is not None:
        assert (
            done.returncode == 1
            and done.stderr.strip() == f"amx_products: no AMX product here: {why}"
        )
        return
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "x" in line]
    rows = [row.split("|")[1:-1] for row in rows if row.split("|")[2].strip()[0].isdigit()]
    assert [row[0].strip() for row in rows] == [
        "q or o", "k or v alone", "q, k, v in one call", "gate or up alone",
        "gate, up in one call", "down", "LM head",
    ]  # fmt: skip
    for row in rows:
        amx, mkl, ratio, error_amx, error_mkl = (float(cell) for cell in row[2:])
        assert amx > 0 and mkl > 0 and abs(ratio - mkl / amx) < 0.02 * ratio + 0.01
        assert 0 < error_amx < 1e-5 and 0 < error_mkl < 1e-5


def test_blocks_quality_cuts_chunks_as_llama_perplexity_and_states_their_spread():
    """blocks_speed's quality chunks: consecutive 512-token pieces, the first token of each
    replaced by BOS where the tokenizer puts one first (llama-perplexity's chunks; Gemma 3 scored
    without it read 38.0 instead of 15.5); a text too short is one line; a difference carries the
    chunks' standard error."""
    import math

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from blocks_speed import difference, quality_chunks
    finally:
        sys.path.remove(str(BENCHMARKS))
    text = "".join(chr(33 + i % 90) for i in range(3 * 512 + 7))
    ids = [ord(c) for c in text]
    for bos in ([], [2]):
        model = SimpleNamespace(
            tokenizer=SimpleNamespace(encode=lambda t, b=bos: b + [ord(c) for c in t])
        )
        chunks = quality_chunks(model, text, 3)
        stream = bos + ids
        assert [c.shape for c in chunks] == [(1, 512)] * 3
        for i, chunk in enumerate(chunks):
            assert chunk[0, 1:].tolist() == stream[i * 512 + 1 : (i + 1) * 512]
            assert chunk[0, 0].item() == (bos[0] if bos else stream[i * 512])
        with pytest.raises(SystemExit, match="fewer than --chunks 4 x 512"):
            quality_chunks(model, text, 4)
    floats = [torch.full((511,), 2.0, dtype=torch.float64) for _ in range(4)]
    ours = [f + math.log1p(0.01 * k) for k, f in zip((1, 2, 3, 4), floats)]
    # each chunk +1..+4 %: their geometric mean (1.01 x 1.02 x 1.03 x 1.04) ** (1/4) - 1, and their
    # spread: stdev(1, 2, 3, 4) = 1.291 over sqrt(4)
    assert difference(ours, floats) == "+2.494 ± 0.645 %"
    for o in ours:  # the first 256 positions unchanged: the second halves (llama-perplexity's) as
        o[:256] = 2.0  # before, every position 255/511 of the logs: expm1(255/511 log1p(k/100))
    assert difference(ours, floats, slice(256, None)) == "+2.494 ± 0.645 %"
    assert difference(ours, floats) == "+1.237 ± 0.318 %"
