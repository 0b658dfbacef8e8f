"""Training data: sources, checks, the memory-mapped token file, the split and the batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from training_tiny import write_text

from attnlab.data import builtin_corpus
from attnlab.errors import UserError
from attnlab.training.data import TokenData, find_sources, iter_text, prepare_data


def test_builtin_corpus_is_python_docs_and_needs_no_shared_data():
    text = builtin_corpus()
    assert len(text) > 100_000
    assert "lambda" in text and "class" in text


def test_file_tokens_round_trip_split_and_dtype(tmp_path):
    path = write_text(tmp_path / "a.txt", 5000)
    tokenizer, data = prepare_data(str(path), "char", 0, tmp_path / "run")
    assert data.tokens.dtype == np.uint16 and isinstance(data.tokens, np.memmap)
    assert tokenizer.decode(data.tokens.tolist()) == path.read_text()
    assert data.n_train == int(len(data.tokens) * 0.9)
    assert len(data.split("train")) + len(data.split("val")) == len(data.tokens)


def test_folder_of_txt_files_in_sorted_order(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("bbb\n")
    (tmp_path / "d" / "sub" / "a.txt").write_text("aaa\n")
    (tmp_path / "d" / "ignored.md").write_text("zzz\n")
    sources = find_sources(str(tmp_path / "d"))
    assert [p.name for p in sources] == ["b.txt", "a.txt"]
    assert "".join(iter_text(sources)) == "bbb\naaa\n"


def test_chunks_end_at_newlines(tmp_path, monkeypatch):
    monkeypatch.setattr("attnlab.training.data.CHUNK_BYTES", 64)
    path = write_text(tmp_path / "a.txt", 2000)
    chunks = list(iter_text([path]))
    assert len(chunks) > 5 and all(c.endswith("\n") for c in chunks)
    assert "".join(chunks) == path.read_text()


def test_utf8_split_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr("attnlab.training.data.CHUNK_BYTES", 7)
    text = "héllo wörld ✓ ünïcode\n" * 5
    (tmp_path / "u.txt").write_text(text, encoding="utf-8")
    assert "".join(iter_text([tmp_path / "u.txt"])) == text


def test_bpe_tokenizer_and_reuse_of_the_token_file(tmp_path):
    path = write_text(tmp_path / "a.txt", 20_000)
    tokenizer, data = prepare_data(str(path), "bpe", 300, tmp_path / "run")
    assert tokenizer.kind == "bpe" and tokenizer.vocab_size <= 300
    assert tokenizer.decode(data.tokens.tolist()) == path.read_text()
    stamp = (tmp_path / "run" / "tokens.bin").stat().st_mtime_ns
    _, again = prepare_data(str(path), "bpe", 300, tmp_path / "run", tokenizer)
    assert (tmp_path / "run" / "tokens.bin").stat().st_mtime_ns == stamp  # reused, not rewritten
    np.testing.assert_array_equal(again.tokens, data.tokens)


def test_batches_are_windows_shifted_by_one(tmp_path):
    path = write_text(tmp_path / "a.txt", 3000)
    _, data = prepare_data(str(path), "char", 0, tmp_path / "run")
    offsets = data.sample_offsets("val", 5, 8, torch.Generator().manual_seed(0))
    x, y = data.get_batch("val", offsets, 8)
    assert x.shape == y.shape == (5, 8) and x.dtype == torch.int64
    val = torch.from_numpy(data.split("val").astype(np.int64))
    for row, start in enumerate(offsets.tolist()):
        assert torch.equal(x[row], val[start : start + 8]) and torch.equal(
            y[row], val[start + 1 : start + 9]
        )


def test_missing_data(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        prepare_data(str(tmp_path / "nope.txt"), "char", 0, tmp_path / "run")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="no .txt files"):
        prepare_data(str(tmp_path / "empty_dir"), "char", 0, tmp_path / "run")


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_empty_data(tmp_path, kind):
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(UserError, match="empty"):
        prepare_data(str(tmp_path / "e.txt"), kind, 300, tmp_path / "run")


def test_binary_and_non_utf8_data(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"abc\x00\x01\x02" * 10)
    with pytest.raises(UserError, match="binary"):
        prepare_data(str(tmp_path / "b.txt"), "char", 0, tmp_path / "run")
    (tmp_path / "l.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        prepare_data(str(tmp_path / "l.txt"), "char", 0, tmp_path / "run")


def test_corpus_shorter_than_one_block(tmp_path):
    (tmp_path / "s.txt").write_text("a short text of a few words\n" * 4)
    _, data = prepare_data(str(tmp_path / "s.txt"), "char", 0, tmp_path / "run")
    with pytest.raises(
        UserError, match=r"shorter than one block of --block-size 64.*--block-size 11 or less"
    ):
        data.check_block_size(64)
    data.check_block_size(11)
    assert isinstance(data, TokenData)


def test_window_stride_starts_every_window_at_a_sequence(tmp_path):
    """--window-stride N: windows start only at multiples of N tokens (in the val split too, from
    the stream's start)."""
    tokens = np.arange(10_000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    data = TokenData(path, "uint16", len(tokens))
    g = torch.Generator().manual_seed(0)
    for split, base in (("train", 0), ("val", data.n_train)):
        offsets = data.sample_offsets(split, 200, 48, g, stride=49)
        x, _ = data.get_batch(split, offsets, 48)
        assert (x[:, 0] % 49 == 0).all() and x[:, -1].max() < 10_000
        assert len(set((offsets + base).tolist())) > 1
    with pytest.raises(UserError, match="window-stride 2000"):
        data.sample_offsets("val", 1, 48, g, stride=2000)
