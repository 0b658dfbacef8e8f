"""llama.cpp as the anchor of the generation benchmark: attnlab's LLaMA-style weights written as
GGUF by attnlab.save (attnlab.formats.gguf_write), then `llama-bench -p 0 -n N -t THREADS` on them
in float32 and in Q8_0 (made by `llama-quantize`).

llama.cpp is never a dependency: point `--llama-cpp DIR` (or $ATTNLAB_LLAMA_CPP) at a folder holding
the `llama-bench` and `llama-quantize` binaries, built from the sources inside the PyPI sdist of
llama-cpp-python (benchmarks/README.md, "Generation at llama.cpp's speed", has the commands).

Design choices:
- The GGUF holds the very tensors of the attnlab model, float32 (`attnlab.save(model, "x.gguf")`,
  which permutes W_Q and W_K rows as llama.cpp's converter does); the models have no tokenizer, so
  the file's is "none" and llama-bench feeds token ids.
- llama-bench's JSON output gives the mean of tokens/s over its repetitions.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path

# llama.cpp's build ("b1234 (abcdef0)", as llama-bench's JSON gives it) of every llama-bench run of
# this process: the anchor's version in the results record
BUILDS: set[str] = set()


def note_build(row: dict) -> None:
    """Keep the build of one row of llama-bench's JSON output in BUILDS."""
    BUILDS.add(f"b{row.get('build_number')} ({row.get('build_commit')})")


def find_tools(directory: str | None) -> dict[str, Path] | None:
    """{"bench": llama-bench, "quantize": llama-quantize} in `directory` (or $ATTNLAB_LLAMA_CPP), or
    None."""
    directory = directory or os.environ.get("ATTNLAB_LLAMA_CPP")
    if not directory:
        return None
    tools = {
        "bench": Path(directory) / "llama-bench",
        "quantize": Path(directory) / "llama-quantize",
    }
    missing = [str(p) for p in tools.values() if not p.is_file()]
    if missing:
        raise SystemExit(
            f"--llama-cpp {directory}: no {', '.join(missing)}; build llama-bench and "
            "llama-quantize there"
        )
    return tools


def tokenize(tools: Path, model_file: Path, text_file: Path) -> list[int]:
    """The ids llama.cpp's `llama-tokenize` (in the folder `tools`) gives the text of `text_file`
    with the model's vocabulary (and its add_bos)."""
    done = subprocess.run(
        [
            str(tools / "llama-tokenize"),
            "-m",
            str(model_file),
            "-f",
            str(text_file),
            "--no-escape",
            "--ids",
            "--log-disable",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"llama-tokenize failed on {model_file}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # --ids: [1, 2, 3]


def quantize(tools: Path, source: Path, target: Path, kind: str) -> Path:
    """`llama-quantize SOURCE TARGET KIND` from the folder `tools`; its output's end if it fails."""
    done = subprocess.run(
        [str(tools / "llama-quantize"), str(source), str(target), kind],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"llama-quantize {kind} failed on {source}:\n{done.stderr[-2000:]}")
    return target


def quantize_q8_0(tools: dict[str, Path], source: Path, target: Path) -> Path:
    return quantize(tools["quantize"].parent, source, target, "Q8_0")


def bench(
    tools: dict[str, Path],
    model_file: Path,
    new_tokens: int,
    threads: int,
    repetitions: int = 3,
    clock: str = "wall",
) -> float:
    """llama-bench's generation figure, tokens/s (its mean over `repetitions`).

    clock "cpu": the CPU time llama-bench used for the tokens (with one thread, what an idle core
    would take),
    from getrusage of the child: an N-token run less a 1-token one (both load the model and warm up
    once). The 1-token run is repeated with every N-token one, not measured once: on a shared
    machine the load, and so the cost of loading, changes from round to round."""

    def run(n: int) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(
            [
                str(tools["bench"]),
                "-m",
                str(model_file),
                "-p",
                "0",
                "-n",
                str(n),
                "-t",
                str(threads),
                "-r",
                str(repetitions),
                "-o",
                "json",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        (row,) = json.loads(result.stdout)
        note_build(row)
        return row["avg_ts"], (after.ru_utime + after.ru_stime) - (
            before.ru_utime + before.ru_stime
        )

    rate, seconds = run(new_tokens)
    if clock == "cpu":
        _, one = run(1)
        rate = repetitions * (new_tokens - 1) / (seconds - one)
    return rate
