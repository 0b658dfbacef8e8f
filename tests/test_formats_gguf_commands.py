"""Every command that takes a model takes a GGUF file: sample, heads, attribute, patch, explore,
export-html and compare, each run on a small GGUF file that attnlab.save wrote (a LLaMA-style model
with grouped-query heads and a character tokenizer, so that every answer is one token), and on
the bundled SmolLM2 (a real GGUF file: Q4_1 / Q8_0 blocks, byte-level BPE with special tokens)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from styles import fields
from training_tiny import one_line_error, run_cli

import attnlab
from attnlab.model.config import ModelConfig
from attnlab.tokenizer import Tokenizer

TEXT = "The cat sat on the mat because it was tired. The dog ran."


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    tokenizer = Tokenizer.train_char(TEXT)
    config = ModelConfig(
        **fields(
            "llama-gqa",
            d_vocab=tokenizer.vocab_size,
            n_ctx=128,
            d_model=64,
            n_layers=2,
            n_heads=4,
            tie_embeddings=True,
        )
    )
    torch.manual_seed(0)
    model = attnlab.Transformer(config).eval()
    model.tokenizer = tokenizer
    return attnlab.save(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf", dtype="q8_0")


def test_sample(gguf_file, capsys):
    code, err = run_cli(
        ["sample", str(gguf_file), "--prompt", "The cat", "--max-new-tokens", "8"], capsys
    )
    assert code == 0, err


def test_heads(gguf_file, tmp_path, capsys):
    out = tmp_path / "heads.json"
    code, err = run_cli(
        ["heads", str(gguf_file), "--batch", "1", "--repeats", "2", "--json", str(out)], capsys
    )
    assert code == 0, err
    scores = json.loads(out.read_text())
    assert len(scores["scores"]["induction"]) == 2 and len(scores["scores"]["induction"][0]) == 4


def test_attribute(gguf_file, tmp_path, capsys):
    code, err = run_cli(
        [
            "attribute",
            str(gguf_file),
            "--prompt",
            "The cat sat on the",
            "--answer",
            " ",
            "--wrong",
            "d",
            "--png",
            str(tmp_path / "a.png"),
        ],
        capsys,
    )
    assert code == 0, err
    assert (tmp_path / "a.png").is_file()


def test_patch(gguf_file, tmp_path, capsys):
    code, err = run_cli(
        [
            "patch",
            str(gguf_file),
            "--clean",
            "The cat sat",
            "--corrupted",
            "The dog sat",
            "--answer",
            " ",
            "--wrong",
            "s",
            "--out",
            str(tmp_path / "patching"),
        ],
        capsys,
    )
    assert code == 0, err
    assert list((tmp_path / "patching").glob("*.png"))


def test_export_html(gguf_file, tmp_path, capsys):
    out = tmp_path / "page.html"
    code, err = run_cli(["export-html", str(gguf_file), "--text", TEXT, "-o", str(out)], capsys)
    assert code == 0, err
    assert "tiny.gguf" in out.read_text(encoding="utf-8")


def test_compare(gguf_file, capsys):
    code, err = run_cli(["compare", str(gguf_file), "--text", TEXT], capsys)
    assert code == 0, err


@pytest.mark.slow
def test_explore(gguf_file, tmp_path):
    from attnlab.explorer.cli import explorer_process

    with explorer_process(str(gguf_file), cwd=tmp_path) as (_, url):
        with urllib.request.urlopen(url + "api/models", timeout=60) as response:
            models = json.load(response)
    assert [m["name"] for m in models] == ["tiny.gguf"]


def test_a_missing_gguf_file_is_one_line(tmp_path, capsys):
    for command in (["sample"], ["heads"], ["export-html", "--text", "x", "-o", "x.html"]):
        code, err = run_cli([command[0], str(tmp_path / "none.gguf"), *command[1:]], capsys)
        assert code == 2 and "no such" in one_line_error(err)


# The bundled SmolLM2 ------------------------------------------------------------------------------


def test_attribute_on_smollm2_finds_paris(tmp_path, capsys):
    code, err = run_cli(
        [
            "attribute",
            "smollm2",
            "--prompt",
            "The capital of France is",
            "--answer",
            " Paris",
            "--wrong",
            " London",
            "--png",
            str(tmp_path / "a.png"),
            "--json",
            str(tmp_path / "a.json"),
        ],
        capsys,
    )
    assert code == 0, err
    assert json.loads((tmp_path / "a.json").read_text())["logit"] > 0
