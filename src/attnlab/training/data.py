"""Training data: text -> tokenizer -> one memory-mapped token file -> random batches.

Design choices:
- The text (a file, a folder of .txt files, or the built-in corpus) is read in ~1 MB chunks, checked
  (missing, empty, binary, not UTF-8 are UserErrors), tokenized chunk by chunk and appended to
  `tokens.bin` next to the run (uint16 when the vocabulary fits, else uint32). Training reads it
  through np.memmap, so RAM does not grow with the corpus, and the file is reused on --resume or a
  rerun with the same data and tokenizer (`tokens.json` records what it was made from).
- The split is nanoGPT's: the first 90% of the token stream trains, the last 10% validates.
- A batch is B random windows of block_size + 1 tokens, gathered from the memmap with one fancy
  index; x is the first block_size tokens, y the same shifted by one. The offsets come from a
  torch.Generator owned by the trainer, so the data position is part of the checkpoint and resuming
  is exact.
- Sharding by rank happens on the rows of a batch (attnlab.training.trainer): every rank draws the
  same global offsets and keeps its own rows, so N processes see exactly the batch one process
  would.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..data import builtin_corpus
from ..errors import UserError
from ..files import atomic_write, atomic_write_text
from ..tokenizer import Tokenizer

CHUNK_BYTES = 1 << 20
TRAIN_FRACTION = 0.9


def find_sources(data: str | None) -> list[Path]:
    """The files to read: [] for the built-in corpus, one file, or every .txt under a folder
    (sorted)."""
    if data is None:
        return []
    path = Path(data).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise UserError(
                f"--data {path}: the folder has no .txt files; put text files in it or pass one "
                "file"
            )
        return files
    if not path.exists():
        raise UserError(
            f"--data {path}: no such file or folder; pass a text file or a folder of .txt files"
        )
    return [path]


def iter_text(sources: list[Path]) -> Iterator[str]:
    """The text in chunks that end at a newline where possible (so BPE never sees a word cut in
    two)."""
    if not sources:
        yield builtin_corpus()
        return
    for path in sources:
        decoder = codecs.getincrementaldecoder("utf-8")()
        carry = ""
        with open(path, "rb") as f:
            while True:
                raw = f.read(CHUNK_BYTES)
                if b"\x00" in raw:
                    raise UserError(
                        f"--data {path}: looks binary (it contains NUL bytes); train on plain "
                        "text files"
                    )
                try:
                    text = carry + decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"--data {path}: not UTF-8 text (bad byte at offset {exc.start} of a "
                        "chunk); "
                        "convert it to UTF-8 or pass another file"
                    ) from None
                if not raw:
                    if text:
                        yield text
                    break
                cut = text.rfind("\n") + 1
                if cut:
                    yield text[:cut]
                    carry = text[cut:]
                else:
                    carry = text


def _fingerprint(sources: list[Path]) -> list:
    if not sources:
        return [f"builtin:pydoc_data:python{sys.version_info.major}.{sys.version_info.minor}"]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in sources]


def train_tokenizer(kind: str, sources: list[Path], vocab_size: int) -> Tokenizer:
    if kind == "char":
        chars: set[str] = set()
        for chunk in iter_text(sources):
            chars.update(chunk)
        if not chars:
            raise _empty_text(sources)
        return Tokenizer.train_char("".join(sorted(chars)))
    # BPE training wants the text twice; keep it short-lived
    chunks = list(_nonempty(iter_text(sources), sources))
    return Tokenizer.train_bpe(chunks, vocab_size)


def _nonempty(chunks: Iterator[str], sources: list[Path]) -> Iterator[str]:
    seen = False
    for chunk in chunks:
        seen = seen or bool(chunk)
        yield chunk
    if not seen:
        raise _empty_text(sources)


def _empty_text(sources: list[Path]) -> UserError:
    return UserError(
        f"--data {_describe(sources)}: the text is empty; give it some text to learn from"
    )


def _describe(sources: list[Path]) -> str:
    return (
        "built-in corpus"
        if not sources
        else str(sources[0])
        if len(sources) == 1
        else f"{sources[0].parent}"
    )


class TokenData:
    """The memory-mapped token stream of a run and its 90/10 split."""

    def __init__(self, path: Path, dtype: str, n_tokens: int) -> None:
        self.path = path
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=(n_tokens,))
        self.n_train = int(n_tokens * TRAIN_FRACTION)

    @classmethod
    def open(cls, out: Path) -> "TokenData":
        """The token file a run has written into `out` (tokens.bin, described by tokens.json)."""
        meta = json.loads((out / "tokens.json").read_text())
        return cls(out / "tokens.bin", meta["dtype"], meta["n_tokens"])

    def split(self, name: str) -> np.ndarray:
        return self.tokens[: self.n_train] if name == "train" else self.tokens[self.n_train :]

    def check_block_size(self, block_size: int) -> None:
        shortest = min(len(self.split("train")), len(self.split("val")))
        if shortest <= block_size:
            longest_ok = max(shortest - 1, 0)
            raise UserError(
                f"the corpus has {len(self.tokens)} tokens, so its "
                f"{'validation' if len(self.split('val')) == shortest else 'training'} "
                f"split ({shortest} tokens) is shorter than one block of --block-size "
                f"{block_size} + 1; "
                f"use more text or --block-size {longest_ok} or less"
            )

    def get_batch(
        self, split: str, offsets: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows starting at `offsets` (B,) -> x, y (B, block_size) int64, y shifted by one."""
        index = offsets.numpy()[:, None] + np.arange(block_size + 1)  # (B, block_size + 1)
        window = torch.from_numpy(self.split(split)[index].astype(np.int64))
        return window[:, :-1], window[:, 1:]

    def sample_offsets(
        self, split: str, n_rows: int, block_size: int, generator: torch.Generator, stride: int = 1
    ) -> torch.Tensor:
        """Random window starts in `split`; with stride > 1 only at multiples of `stride` tokens
        from the start of the stream (data packed as sequences of `stride` tokens: each window
        starts a sequence)."""
        if stride == 1:
            return torch.randint(
                len(self.split(split)) - block_size, (n_rows,), generator=generator
            )
        # the first sequence start in the split
        first = 0 if split == "train" else -self.n_train % stride
        starts = (len(self.split(split)) - block_size - first + stride - 1) // stride
        if starts <= 0:
            raise UserError(
                f"the {split} split has no window of {block_size} + 1 tokens starting at a "
                "multiple of "
                f"--window-stride {stride}; use more data or a smaller --block-size"
            )
        return first + torch.randint(starts, (n_rows,), generator=generator) * stride


def prepare_data(
    data: str | None,
    tokenizer_kind: str,
    vocab_size: int,
    out: Path,
    tokenizer: Tokenizer | None = None,
) -> tuple[Tokenizer, TokenData]:
    """The run's tokenizer (trained unless given) and its token file, written once into `out` and
    reused."""
    sources = find_sources(data)
    if tokenizer is None:
        tokenizer = train_tokenizer(tokenizer_kind, sources, vocab_size)
    tokenizer_json = tokenizer.backend.to_str()
    meta = {
        "source": _fingerprint(sources),
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
    }
    bin_path, meta_path = out / "tokens.bin", out / "tokens.json"
    if bin_path.is_file() and meta_path.is_file():
        saved = json.loads(meta_path.read_text())
        if {k: saved.get(k) for k in meta} == json.loads(
            json.dumps(meta)
        ) and bin_path.stat().st_size == saved["bytes"]:
            return tokenizer, TokenData(bin_path, saved["dtype"], saved["n_tokens"])
    dtype = "uint16" if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"
    n_tokens = 0

    def write(tmp: str) -> None:
        nonlocal n_tokens
        with open(tmp, "wb") as f:
            for chunk in iter_text(sources):
                ids = np.asarray(tokenizer.encode(chunk, add_special_tokens=False), dtype=dtype)
                ids.tofile(f)
                n_tokens += len(ids)

    atomic_write(bin_path, write)
    if n_tokens == 0:
        os.unlink(bin_path)
        raise _empty_text(sources)
    meta.update(dtype=dtype, n_tokens=n_tokens, bytes=n_tokens * np.dtype(dtype).itemsize)
    atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    return tokenizer, TokenData(bin_path, dtype, n_tokens)
