"""A GGUF model in attnlab and in llama.cpp on the same file and text: perplexity, top-1 agreement
and KL divergence of the next-token distributions, and the tokenizer's ids.

.venv/bin/python benchmarks/gguf_vs_llama_cpp.py --llama-cpp anchors/build/bin [--model smollm2]
[--n-ctx 512]
.venv/bin/python benchmarks/gguf_vs_llama_cpp.py --llama-cpp anchors/build/bin --model gemma3-270m

llama.cpp is never a dependency: --llama-cpp (or $ATTNLAB_LLAMA_CPP) names a folder with
`llama-perplexity` and `llama-tokenize`, built from the sources in the PyPI sdist of
llama-cpp-python (benchmarks/README.md has the commands). The text is the first 24,000 characters of
attnlab's built-in corpus (Python's bundled documentation: prose, code and 158 blank lines), or
--text FILE.

Design choices:
- Perplexity exactly as llama-perplexity computes it: the tokens cut into chunks of n_ctx, each
  chunk run alone, the second half of each scored. llama-perplexity --kl-divergence-base writes
  llama.cpp's log-probabilities of every scored position (16 bits each, over the top 16 nats); this
  script reads that file, so both sides are compared position by position: KL(llama.cpp || attnlab)
  and whether the most likely next token is the same. (llama.cpp rounds activations to 8 bits for
  its quantized products and keeps an F16 cache, so single-token agreement and KL are the fair
  measure, not equal logits.)
- The tokens llama-perplexity used are in the same file: the script checks attnlab's tokenizer gives
  the same ids. The file holds the text's tokens as they are; where the tokenizer adds a BOS,
  llama-perplexity replaces each chunk's first token by it (without it Gemma 3's perplexity read
  20.6 where llama.cpp's is 13.6), and so does this script.
- The file is read as a memory map and attnlab's log-probabilities a few positions at a time: with
  Gemma 3's 262,144 tokens each scored position is 0.5 MB there and 2 MB here in float64.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_results_argument, figure, write_result  # noqa: E402
from _llama_cpp import tokenize  # noqa: E402

import attnlab  # noqa: E402
from attnlab.data import builtin_corpus  # noqa: E402


def read_log_probs(path: Path):
    """llama-perplexity --kl-divergence-base's file: n_ctx, n_vocab, the chunks' tokens, and for
    each scored position log p = scale * q + min_log_prob (q: uint16, after two float32 (scale,
    min_log_prob))."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(raw[:8]) != b"_logits_":
        raise SystemExit(f"{path}: not a llama-perplexity --kl-divergence-base file")
    n_ctx, n_vocab, n_chunk = (int(v) for v in raw[8:20].view(np.int32))
    end = 20 + 4 * n_chunk * n_ctx
    tokens = np.array(raw[20:end].view(np.int32)).reshape(n_chunk, n_ctx)
    width = 2 * ((n_vocab + 1) // 2) + 4
    records = raw[end:].view(np.uint16).reshape(n_chunk, n_ctx - 1 - n_ctx // 2, width)
    return n_ctx, n_vocab, tokens, records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-cpp",
        default=os.environ.get("ATTNLAB_LLAMA_CPP"),
        help="folder of llama.cpp's tools",
    )
    parser.add_argument("--model", default="smollm2", help="a GGUF file or a bundled GGUF name")
    parser.add_argument(
        "--text", default=None, help="a UTF-8 text file (default: 24,000 characters of the corpus)"
    )
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    add_results_argument(parser)
    args = parser.parse_args()
    if not args.llama_cpp:
        raise SystemExit(
            "--llama-cpp DIR (or $ATTNLAB_LLAMA_CPP): the folder with llama-perplexity and "
            "llama-tokenize"
        )
    tools = Path(args.llama_cpp)
    from attnlab.formats import model_dir

    path = model_dir(args.model)
    model = attnlab.load(path)
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(args.text) if args.text else Path(tmp) / "text.txt"
        if not args.text:
            text_file.write_text(builtin_corpus()[:24000], encoding="utf-8")
        text = text_file.read_text(encoding="utf-8")
        base = Path(tmp) / "base.kld"
        done = subprocess.run(
            [
                str(tools / "llama-perplexity"),
                "-m",
                str(path),
                "-f",
                str(text_file),
                "-c",
                str(args.n_ctx),
                "-b",
                str(args.n_ctx),
                "-t",
                str(args.threads),
                "--kl-divergence-base",
                str(base),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"llama-perplexity failed:\n{done.stderr[-2000:]}")
        reported = re.search(r"Final estimate: PPL = ([0-9.]+ \+/- [0-9.]+)", done.stderr).group(1)
        build = re.search(r"build: (\d+) \((\w+)\)", done.stderr)
        n_ctx, n_vocab, tokens, records = read_log_probs(base)
        theirs_ids = tokenize(tools, path, text_file)
    ours_ids = model.tokenizer.encode(text)
    same_ids = ours_ids == theirs_ids
    first, agree, count, nll_ours, nll_theirs, kls = n_ctx // 2, 0, 0, 0.0, 0.0, []
    # the file holds the text's tokens; where the tokenizer adds a BOS (Gemma), llama-perplexity
    # puts it in the first place of every chunk, and so does this
    bos = model.tokenizer.encode("")
    with torch.no_grad():
        for c in range(tokens.shape[0]):
            chunk = tokens[c : c + 1].astype(np.int64)
            if bos:
                chunk[0, 0] = bos[0]
            logits = model(torch.from_numpy(chunk))[0]
            # scale, min_log_prob
            head = np.array(records[c, :, :4]).view(np.float32).astype(np.float64)
            for i in range(records.shape[1]):
                t = first + i
                log_p = torch.log_softmax(logits[t].double(), -1).numpy()
                base_log_p = head[i, 0] * records[c, i, 4 : 4 + n_vocab] + head[i, 1]
                p = np.exp(base_log_p)
                p /= p.sum()
                kls.append(float((p * (np.log(p) - log_p)).sum()))
                agree += int(base_log_p.argmax() == log_p.argmax())
                nll_ours -= log_p[tokens[c, t + 1]]
                nll_theirs -= base_log_p[tokens[c, t + 1]]
                count += 1
    kls = np.array(kls)
    print(
        f"model {path.name}; text {len(text):,} characters, {len(ours_ids):,} tokens; chunks of "
        f"{n_ctx}, {count:,} positions scored"
    )
    print(
        f"tokenizer: attnlab's ids {'equal' if same_ids else 'DIFFER FROM'} llama-tokenize's "
        f"({len(ours_ids):,} vs {len(theirs_ids):,} tokens)"
    )
    print(
        f"perplexity: attnlab {math.exp(nll_ours / count):.4f}, llama.cpp "
        f"{math.exp(nll_theirs / count):.4f} (llama-perplexity reports {reported})"
    )
    print(
        f"top-1 agreement {agree / count:.2%}; KL(llama.cpp || attnlab) mean {kls.mean():.4f}, "
        f"median {np.median(kls):.4f}, 99th percentile {np.quantile(kls, 0.99):.4f}, max "
        f"{kls.max():.4f}"
    )
    write_result(
        args.results,
        "gguf_vs_llama_cpp",
        measures="The same GGUF file and text in attnlab and in llama.cpp: perplexity on the "
        "second half of each chunk (as llama-perplexity scores), the top-1 agreement and the KL "
        "divergence of the next-token distributions, and the tokenizer's token count.",
        anchor="llama.cpp's llama-perplexity",
        anchor_version=f"b{build.group(1)} ({build.group(2)})" if build else None,
        figures=[
            figure("perplexity", "", math.exp(nll_ours / count), math.exp(nll_theirs / count), ""),
            figure("tokens of the text", "tokens", len(ours_ids), len(theirs_ids), ""),
            figure("top-1 agreement with llama.cpp", "%", 100 * agree / count),
            figure("KL(llama.cpp || attnlab), mean", "nats", float(kls.mean()), None, "lower"),
        ],
        setup=f"{path.name}, chunks of {n_ctx}, {args.threads} threads",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
