"""Models trained by `attnlab train`, written as GGUF by `attnlab convert`, run in llama.cpp: the
same tokens for the same text (llama-tokenize) and the same greedy text (llama-simple) as attnlab.

.venv/bin/python benchmarks/gguf_write_llama_cpp.py --llama-cpp DIR [--iters 300] [--new-tokens 40]
[--rows llama-char:f32 ... gpt2-char:q8_0]

llama.cpp is never a dependency: --llama-cpp (or $ATTNLAB_LLAMA_CPP) names a folder with
`llama-tokenize` and `llama-simple`, built from the sources in the PyPI sdist of llama-cpp-python
(benchmarks/README.md has the commands).

Design choices:
- Everything through the command line, as a user would: `attnlab train` with each recipe llama.cpp
  runs (the llama one with the char and the BPE tokenizer, the gpt2 one), on the first 300,000
  characters of the built-in corpus (or --data), then `attnlab convert RUN out.gguf --dtype
  f32|q8_0`.
- attnlab's side reads the written file back (`attnlab.load("out.gguf")`), so both sides compute
  with the file's values; its greedy text is `generate(..., temperature=0)` decoded. A q8_0 file is
  also read with `keep_blocks=True`, which is what llama.cpp computes: the Q8_0 blocks multiplied
  with activations rounded to 8 bits per block of 32 (in the decode steps; the prompt runs through
  the dequantized float path in attnlab, where llama.cpp rounds it too). The table shows both; the
  exit status counts the blocks column (the float one for f32 files).
- `--rows` runs only some rows (RECIPE:DTYPE), training only the recipes they need.
- llama-simple decodes greedily from the prompt (its own tokenization of it, with the file's
  add_bos) and prints the prompt and the continuation; the script compares that text with attnlab's
  prompt + continuation and reports the first character where they part. llama.cpp keeps an F16
  KV cache, so a near-tie could in principle go the other way: the table says how often it did.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama_cpp import tokenize  # noqa: E402

import attnlab  # noqa: E402
from attnlab.data import builtin_corpus  # noqa: E402
from attnlab.generate.kernel_decoder import KernelDecoder  # noqa: E402
from attnlab.generate.loop import generate  # noqa: E402

# name (for --rows) -> (label, attnlab train flags beyond --max-iters/--out, tokenizer flags)
RECIPES = {
    "llama-char": (
        "llama (--preset cpu --mlp swiglu --n-kv-head 2), char",
        ["--preset", "cpu", "--mlp", "swiglu", "--n-kv-head", "2"],
    ),
    "llama-bpe": (
        "llama (--preset cpu --mlp swiglu), bpe 512",
        ["--preset", "cpu", "--mlp", "swiglu", "--tokenizer", "bpe", "--vocab-size", "512"],
    ),
    "gpt2-char": (
        "gpt2 (--preset nano --mlp gelu_tanh), char",
        ["--preset", "nano", "--mlp", "gelu_tanh"],
    ),
}
DTYPES = ("f32", "q8_0")
ROWS = [f"{recipe}:{dtype}" for recipe in RECIPES for dtype in DTYPES]
PROMPTS = ["The ", "def ", "This module "]
TEXTS = [
    "The cat sat on the mat.",
    "Numbers: 2024, 3.14159 and 1000000.",
    "def f(x):\n    return x * 2\n\n\nclass A:\n\tpass",
    "  leading spaces,   many   spaces\n\n\n",
    "Unicode: naïve café, Zürich",
]


def attnlab_cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"attnlab {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def llama_tokenize(tools: Path, path: Path, text: str, text_file: Path) -> list[int]:
    text_file.write_text(text, encoding="utf-8")
    return tokenize(tools, path, text_file)


def llama_simple(tools: Path, path: Path, prompt: str, new_tokens: int) -> str:
    done = subprocess.run(
        [str(tools / "llama-simple"), "-m", str(path), "-n", str(new_tokens), prompt],
        capture_output=True,
    )
    if done.returncode:
        raise SystemExit(f"llama-simple failed on {path}:\n{done.stderr[-2000:]!r}")
    # the pieces of every token, then one newline of its own
    return done.stdout.decode("utf-8", errors="replace").removesuffix("\n")


def greedy_text(model, prompt: str, new_tokens: int) -> str:
    ids = torch.tensor([model.tokenizer.encode(prompt)])
    out = generate(model, ids, max_new_tokens=new_tokens, temperature=0)
    return model.tokenizer.decode(out[0].tolist())


def agreement(ours: list[str], theirs: list[str], prompts: list[str]) -> str:
    """ "k/n prompts", and where each differing one parts from llama.cpp's text."""
    notes = []
    for prompt, a, b in zip(prompts, ours, theirs):
        where = first_difference(a, b)
        if where is not None:
            notes.append(f"{prompt!r} parts at char {where}: {b[where:][:20]!r}")
    return f"{len(prompts) - len(notes)}/{len(prompts)} prompts" + "".join(
        "; " + note for note in notes
    )


def known(tokenizer, text: str) -> bool:
    try:
        tokenizer.encode(text)
    except attnlab.UserError:
        return False
    return True


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", default=os.environ.get("ATTNLAB_LLAMA_CPP"), metavar="DIR")
    parser.add_argument("--data", default=None, help="training text (default: built-in corpus)")
    parser.add_argument(
        "--corpus-chars", type=int, default=300_000, help="characters of the built-in corpus"
    )
    parser.add_argument("--iters", type=int, default=300, help="training steps per recipe")
    parser.add_argument("--new-tokens", type=int, default=40, help="greedy tokens per prompt")
    parser.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help=f"how many of {PROMPTS} to continue"
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        default=ROWS,
        choices=ROWS,
        metavar="RECIPE:DTYPE",
        help=f"the rows to run (default: all of {' '.join(ROWS)}); a recipe is trained only "
        "for its rows",
    )
    args = parser.parse_args()
    if not args.llama_cpp:
        raise SystemExit("--llama-cpp DIR (or $ATTNLAB_LLAMA_CPP): a folder with llama-simple")
    tools = Path(args.llama_cpp)
    missing = [t for t in ("llama-tokenize", "llama-simple") if not (tools / t).is_file()]
    if missing:
        raise SystemExit(f"--llama-cpp {tools}: no {', '.join(missing)} there; build them")
    prompts = PROMPTS[: args.prompts]

    print(
        f"# attnlab-written GGUF in llama.cpp\n{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.iters} training steps, "
        f"{args.new_tokens} greedy tokens per prompt\n"
    )
    print(
        "| recipe, tokenizer | dtype | token ids = llama-tokenize | greedy text = llama-simple: "
        "attnlab computing with the file's values in float32 | ... with the Q8_0 blocks as "
        "they are (`keep_blocks`) |"
    )
    print("|---|---|---|---|---|")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.txt"  # a part of the built-in corpus: its final evaluation is short
        corpus.write_text(builtin_corpus()[: args.corpus_chars], encoding="utf-8")
        for name, (label, flags) in RECIPES.items():
            dtypes = [dtype for dtype in DTYPES if f"{name}:{dtype}" in args.rows]
            if not dtypes:
                continue
            run = tmp / name
            data = ["--data", args.data or str(corpus)]
            attnlab_cli(
                "train", *flags, *data, "--max-iters", str(args.iters), "--out", str(run), "--quiet"
            )
            for dtype in dtypes:
                path = tmp / f"{name}-{dtype}.gguf"
                attnlab_cli("convert", str(run), str(path), "--dtype", dtype)
                model = attnlab.load(path)
                # a char model's texts: those made of characters it has (llama.cpp's rwkv
                # tokenizer has no unknown token to give the others)
                texts = [text for text in TEXTS if known(model.tokenizer, text)]
                ids_same = sum(
                    model.tokenizer.encode(text)
                    == llama_tokenize(tools, path, text, tmp / "text.txt")
                    for text in texts
                )
                theirs = [llama_simple(tools, path, p, args.new_tokens) for p in prompts]
                floats = [greedy_text(model, p, args.new_tokens) for p in prompts]
                cells = [agreement(floats, theirs, prompts)]
                failures += ids_same < len(texts)
                if dtype == "q8_0":
                    # what llama.cpp computes: the blocks times activations rounded to 8 bits
                    blocks = attnlab.load(path, keep_blocks=True)
                    # every matrix Q8_0; with the embedding kept as blocks too: "gguf:q8_0"
                    assert blocks.quantization in ("q8_0", "gguf:q8_0"), blocks.quantization
                    # the C step is what rounds the activations; the module path would not
                    assert KernelDecoder.unsupported(blocks) is None, KernelDecoder.unsupported(
                        blocks
                    )
                    ours = [greedy_text(blocks, p, args.new_tokens) for p in prompts]
                    cells.append(agreement(ours, theirs, prompts))
                else:
                    ours = floats
                    cells.append("(f32: no blocks)")
                failures += sum(a != b for a, b in zip(ours, theirs))
                print(
                    f"| {label} | {dtype} | {ids_same}/{len(texts)} texts | {' | '.join(cells)} |",
                    flush=True,
                )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
