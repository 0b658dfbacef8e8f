"""Damaged and hostile GGUF files: each is a correct load or one line (exit 2 on the command line),
and nothing is allocated beyond what the file holds.

The named cases (a truncated file, a wrong magic number, an unsupported version, an unknown or
unreadable tensor type, an architecture attnlab cannot run, tensors past the end of the file,
dimensions that overflow or do not divide into blocks, duplicate tensor or key names, array lengths
that lie) are edits of small files that ggml's own writer (GGUFWriter) made; a hypothesis property
then mutates such a file (truncation, bytes of the header, fields of the tensor table) and asserts a
load or one UserError line, never another exception.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType
from gguf_files import Q, write_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from training_tiny import load_or_one_line, one_line_error, run_cli, sample_damaged

import attnlab
from attnlab.errors import UserError
from attnlab.formats.gguf import read_gguf

SRC = Path(attnlab.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A small llama file with block-quantized matrices, an extra string key ("general.nbme") for
    the duplicate-key case, and ggml's default alignment."""
    root = tmp_path_factory.mktemp("gguf")
    return write_model(
        root / "tiny.gguf",
        "llama",
        matrix=Q.Q8_0,
        embedding=Q.Q4_0,
        extra_metadata={"general.nbme": ("x", GGUFValueType.STRING)},
    )


def fresh(pristine: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model.gguf"
    shutil.copyfile(pristine, target)
    return target


def refused(path: Path, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        attnlab.load(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def info_offsets(path: Path, name: str) -> dict[str, int]:
    """Byte offsets of one tensor's entries in the tensor table: n_dims, dims, type, offset."""
    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    start = tensor.field.offset + 8 + len(name.encode())
    n_dims = len(tensor.shape)
    return {
        "n_dims": start,
        "dims": start + 4,
        "type": start + 4 + 8 * n_dims,
        "offset": start + 8 + 8 * n_dims,
    }


def patch(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


# The named cases --------------------------------------------------------------------------------


def test_the_pristine_file_loads(pristine):
    assert attnlab.load(pristine).config.n_layers == 2


@pytest.mark.parametrize("keep", [0, 3, 20, 200, 2000, -100])
def test_truncated_file(pristine, tmp_path, keep):
    path = fresh(pristine, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    refused(path, "truncated|too short")


def test_wrong_magic(pristine, tmp_path):
    path = fresh(pristine, tmp_path)
    patch(path, 0, b"GGML")
    refused(path, r"not a GGUF file \(it starts with b'GGML'")


@pytest.mark.parametrize("version", [1, 4, 2**31])
def test_unsupported_version(pristine, tmp_path, version):
    path = fresh(pristine, tmp_path)
    patch(path, 4, struct.pack("<I", version))
    refused(path, f"GGUF version {version}, which attnlab does not read")


def test_big_endian_file(pristine, tmp_path):
    path = fresh(pristine, tmp_path)
    patch(path, 4, struct.pack(">I", 3))
    refused(path, "big-endian")


@pytest.mark.parametrize(
    "value, match",
    [
        (99, "has type 99, which GGUF does not define"),
        (16, "has type IQ2_XXS, which attnlab cannot dequantize; it reads F32"),
        (26, "has type I32, which attnlab cannot dequantize"),
    ],
)
def test_unknown_tensor_type_is_named(pristine, tmp_path, value, match):
    path = fresh(pristine, tmp_path)
    patch(path, info_offsets(path, "blk.0.attn_q.weight")["type"], struct.pack("<I", value))
    refused(path, "tensor 'blk.0.attn_q.weight' " + match)


def test_architecture_attnlab_cannot_run_is_named_with_the_list(pristine, tmp_path):
    path = tmp_path / "made-up.gguf"
    write_model(path, "llama")
    data = path.read_bytes().replace(
        b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00bloom", 1
    )
    path.write_bytes(data)
    message = refused(path, "architecture 'bloom', which attnlab cannot run; it runs llama, ")
    supported = ("mistral", "mistral3", "qwen2", "qwen3", "gpt2", "gemma3")
    assert all(name in message for name in supported), message


def test_tensor_past_the_end_of_the_file(pristine, tmp_path):
    path = fresh(pristine, tmp_path)
    patch(path, info_offsets(path, "blk.1.ffn_down.weight")["offset"], struct.pack("<Q", 2**40))
    refused(path, "tensor 'blk.1.ffn_down.weight' ends at byte .* past the end of the file")


def test_misaligned_tensor_offset(pristine, tmp_path):
    path = fresh(pristine, tmp_path)
    at = info_offsets(path, "blk.1.ffn_down.weight")["offset"]
    (offset,) = struct.unpack("<Q", path.read_bytes()[at : at + 8])
    patch(path, at, struct.pack("<Q", offset + 3))
    refused(path, "not a multiple of the file's alignment")


@pytest.mark.parametrize(
    "dims, match",
    [
        ((2**40, 2**40), "overflow"),
        ((0, 64), "each positive"),
        ((33, 64), "do not divide into Q8_0 blocks of 32"),
        ((2**33, 1), "past the end of the file"),
    ],
)
def test_dimensions_that_overflow_or_do_not_divide(pristine, tmp_path, dims, match):
    path = fresh(pristine, tmp_path)
    patch(path, info_offsets(path, "blk.0.attn_q.weight")["dims"], struct.pack("<QQ", *dims))
    refused(path, match)


def test_too_many_dimensions(tmp_path):
    import numpy as np

    def add_5d(tensors):
        tensors["blk.0.extra.weight"] = (np.zeros((2, 1, 1, 1, 2), dtype=np.float32), Q.F32)

    path = write_model(tmp_path / "5d.gguf", "llama", tensor_edit=add_5d)
    refused(
        path, r"tensor 'blk.0.extra.weight' has dimensions \[2, 1, 1, 1, 2\]; GGUF allows 1 to 4"
    )


def test_duplicate_tensor_names(pristine, tmp_path):
    path = fresh(pristine, tmp_path)
    data = path.read_bytes()
    at = data.index(b"blk.0.attn_k.weight")
    patch(path, at, b"blk.0.attn_q.weight")
    refused(path, "the tensor name 'blk.0.attn_q.weight' appears twice")


def test_duplicate_metadata_keys(pristine, tmp_path):
    path = fresh(pristine, tmp_path)
    patch(path, path.read_bytes().index(b"general.nbme"), b"general.name")
    refused(path, "Duplicate general.name")


def test_array_lengths_that_lie(pristine, tmp_path):
    path = fresh(pristine, tmp_path)
    data = path.read_bytes()
    key = b"tokenizer.ggml.tokens"
    # after the key, its value type (ARRAY) and the item type (STRING)
    at = data.index(key) + len(key) + 4 + 4
    patch(path, at, struct.pack("<Q", 2**60))
    refused(path, "claims 1,152,921,504,606,846,976 entries, more than the rest of the file holds")
    path = fresh(pristine, tmp_path)
    key = b"tokenizer.ggml.token_type"
    at = data.index(key) + len(key) + 8
    patch(path, at, struct.pack("<Q", 2**40))
    refused(path, "ends past the end of the file")
    # one string inside the array: the first token's length
    path = fresh(pristine, tmp_path)
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4 + 8
    patch(path, at, struct.pack("<Q", 2**40))
    refused(path, r"string 0 of the array at byte [\d,]+ ends past the end of the file")
    for length in (2**64 - 1, len(data)):  # the largest length; one that ends a few bytes too late
        patch(path, at, struct.pack("<Q", length))
        refused(path, "ends past the end of the file")


def test_string_arrays_read_as_gguf_py_reads_them(tmp_path):
    """attnlab's one-loop walk of a string array (attnlab.formats.gguf) against gguf-py's own
    reader, the reference: the same values for every key, empty, multi-byte and long strings
    included; Python's garbage collector is back on after a read and after a refusal."""
    import gc

    odd = ["", "é", "日本語", "a" * 1000, "\n\n", "▁the", "\x00"]
    path = write_model(
        tmp_path / "strings.gguf",
        "llama",
        extra_metadata={"test.strings": (odd, GGUFValueType.ARRAY, GGUFValueType.STRING)},
    )
    ours = read_gguf(path).metadata
    theirs = {k: f.contents() for k, f in GGUFReader(path).fields.items() if "GGUF." not in k}
    assert ours == theirs and ours["test.strings"] == odd
    assert len(ours["tokenizer.ggml.tokens"]) == 300
    assert gc.isenabled()
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"a" * 1000) + 500])  # the file ends inside a string
    with pytest.raises(UserError, match="string 3 of the array at byte [\\d,]+ ends past the end"):
        read_gguf(path)
    assert gc.isenabled()


def test_metadata_that_does_not_match_the_tensors(pristine, tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(
        attnlab.Transformer, "__init__", lambda *a, **k: built.append(1) or pytest.fail("allocated")
    )
    path = tmp_path / "wide.gguf"
    write_model(path, "llama", extra_metadata=None, d_model=64)
    data = bytearray(path.read_bytes())
    key = b"llama.embedding_length"
    at = data.index(key) + len(key) + 4
    data[at : at + 4] = struct.pack("<I", 10**9)
    path.write_bytes(bytes(data))
    refused(path, "needs at least .* weights")
    assert not built


def test_more_tokens_than_embeddings(tmp_path):
    def drop_rows(tensors):
        values, kind = tensors["token_embd.weight"]
        tensors["token_embd.weight"] = (values[:280], kind)

    path = write_model(
        tmp_path / "short.gguf",
        "llama",
        tensor_edit=drop_rows,
        extra_metadata={"llama.vocab_size": (280, GGUFValueType.UINT32)},
    )
    refused(path, "the tokenizer has 300 tokens but the embedding 280 rows")


def test_the_command_line_says_one_line_and_exits_2(pristine, tmp_path, capsys):
    path = fresh(pristine, tmp_path)
    patch(path, 0, b"GGML")
    code, err = run_cli(["sample", str(path), "--max-new-tokens", "2", "--prompt", "ab"], capsys)
    assert code == 2 and "not a GGUF file" in one_line_error(err)
    code, err = run_cli(
        ["sample", str(pristine), "--max-new-tokens", "2", "--prompt", "ab"], capsys
    )
    assert code == 0, err


# The property -----------------------------------------------------------------------------------


@st.composite
def mutations(draw):
    how = draw(
        st.sampled_from(["truncate", "header bytes", "table field", "table field", "data bytes"])
    )
    return how, draw(st.randoms(use_true_random=False))


def mutate(path: Path, how: str, rng) -> None:
    data = bytearray(path.read_bytes())
    reader = read_gguf(path)
    header_end = min(t.data_offset for t in reader.tensors.values())
    if how == "truncate":
        data = data[: rng.randrange(len(data))]
    elif how == "header bytes":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(header_end)] = rng.randrange(256)
    elif how == "data bytes":
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(header_end, len(data))] = rng.randrange(256)
    else:
        name = rng.choice(sorted(reader.tensors))
        offsets = info_offsets(path, name)
        field = rng.choice(["n_dims", "dims", "type", "offset"])
        width = 4 if field in ("n_dims", "type") else 8
        value = rng.choice(
            [
                0,
                1,
                3,
                31,
                32,
                255,
                2**31,
                2**32 - 1,
                2**63,
                2**64 - 1,
                rng.randrange(2 ** (8 * width)),
            ]
        )
        data[offsets[field] : offsets[field] + width] = (value % 2 ** (8 * width)).to_bytes(
            width, "little"
        )
    path.write_bytes(bytes(data))


@settings(
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
    deadline=None,
)
@given(case=mutations())
def test_any_mutation_of_a_gguf_file_loads_or_is_one_line(pristine, tmp_path, case):
    how, rng = case
    path = fresh(pristine, tmp_path)
    mutate(path, how, rng)
    load_or_one_line(path)


@pytest.mark.slow
def test_the_command_line_on_mutated_gguf_files_exits_0_or_2_with_one_line(pristine, tmp_path):
    import random

    rng = random.Random(0)
    env = {
        **os.environ,
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    outcomes = []
    for i, how in enumerate(
        ["truncate", "header bytes", "table field", "table field", "data bytes", "truncate"]
    ):
        (tmp_path / str(i)).mkdir()
        path = fresh(pristine, tmp_path / str(i))
        mutate(path, how, rng)
        outcomes.append(sample_damaged(path, env, "ab"))
    assert 2 in outcomes
