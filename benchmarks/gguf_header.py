"""The header of a GGUF file read by ggml's gguf-py as it is and by attnlab's checked reader, on the
shipped models (SmolLM2-135M: 49k tokens and 49k merges; Gemma 3 270M: 262k tokens and scores).

.venv/bin/python benchmarks/gguf_header.py [--models smollm2 gemma3-270m] [--repeats 3]

Design choices:
- The same work on both sides: the reader's walk over the header and every key's value as Python
  values (ReaderField.contents(), what attnlab keeps as the metadata); gguf-py's GGUFReader is the
  baseline, timed in the same process.
- attnlab's reader twice: as it runs (string arrays walked in one loop, Python's garbage collector
  off during the read) and with the collector left on, to show what each of the two changes is
  worth.
- The tokenizer built from that metadata (attnlab.formats.gguf_tokenizer) is timed on its own: it is
  not the header, but it is the next thing `attnlab.load` does with it.
- The page cache is warmed by one untimed read first; median of --repeats.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, median_time  # noqa: E402

from attnlab.formats import bundled_path  # noqa: E402
from attnlab.formats.gguf import read_gguf  # noqa: E402
from attnlab.formats.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402


def gguf_py(path: Path) -> dict:
    from gguf import GGUFReader

    return {key: field.contents() for key, field in GGUFReader(path).fields.items()}


def with_collector(path: Path):
    """read_gguf with Python's garbage collector kept on (gc.disable made a no-op)."""
    disable = gc.disable
    gc.disable = lambda: None
    try:
        return read_gguf(path)
    finally:
        gc.disable = disable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# GGUF header\n{machine_line()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"median of {args.repeats}, after one untimed read\n")
    print(
        "| model | gguf-py GGUFReader + contents() | attnlab read_gguf | speed-up "
        "| read_gguf, collector on | tokenizer from the metadata |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models:
        path = bundled_path(name)
        file = read_gguf(path)
        assert file.metadata == {
            k: v for k, v in gguf_py(path).items() if not k.startswith("GGUF.")
        }, "the two readers disagree"
        reference = median_time(lambda: gguf_py(path), args.repeats, warmup=0)
        ours = median_time(lambda: read_gguf(path), args.repeats, warmup=0)
        collecting = median_time(lambda: with_collector(path), args.repeats, warmup=0)
        tokenizer = median_time(lambda: tokenizer_from_gguf(file), args.repeats, warmup=0)
        print(
            f"| {name} | {reference:.2f} s | {ours:.2f} s | {reference / ours:.1f}x "
            f"| {collecting:.2f} s | {tokenizer:.2f} s |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
