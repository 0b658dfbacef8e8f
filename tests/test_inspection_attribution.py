"""`attnlab attribute` and `attnlab patch`: runs on a small saved model, and the one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from styles import randomize

from attnlab import Transformer
from attnlab.cli import main
from attnlab.formats.native import save_native
from attnlab.inspection.attribution import direct_logit_attribution
from attnlab.model.config import ModelConfig
from attnlab.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = Tokenizer.train_char("abcdefgh .")
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            d_vocab=tokenizer.vocab_size, n_ctx=32, d_model=16, n_layers=2, n_heads=2, d_mlp=32
        )
    )
    randomize(model)
    model.tokenizer = tokenizer
    return save_native(model, tmp_path_factory.mktemp("models") / "tiny")


def test_attribution_terms_sum_to_the_logit_difference(model_dir):
    import attnlab

    model = attnlab.load(model_dir)
    result = direct_logit_attribution(model, "abc abc ab", "c", "d")
    with torch.no_grad():
        logits = model(model.to_tokens("abc abc ab"))[0, -1]
    c, d = model.to_single_token("c"), model.to_single_token("d")
    assert result.logit == pytest.approx(float(logits[c] - logits[d]), rel=1e-5)
    assert result.total() == pytest.approx(result.logit, rel=1e-4, abs=1e-5)
    assert result.heads.shape == (2, 2) and result.mlps.shape == (2,)
    assert [name for name, _ in result.ranked()][:1] and set(result.others) == {
        "embed",
        "pos_embed",
        "bias",
    }
    # token ids: the same numbers, the same labels
    by_id = direct_logit_attribution(model, "abc abc ab", c, d)
    assert by_id.logit == result.logit and torch.equal(by_id.heads, result.heads)
    assert (by_id.answer, by_id.wrong) == ("c", "d")


def test_attribute_command(model_dir, tmp_path, capsys):
    png, out = tmp_path / "dla.png", tmp_path / "dla.json"
    assert (
        main(
            [
                "attribute",
                str(model_dir),
                "--prompt",
                "abc abc ab",
                "--answer",
                "c",
                "--wrong",
                "d",
                "--png",
                str(png),
                "--json",
                str(out),
                "--top",
                "3",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "direct logit attribution to 'c' - 'd'" in printed and "more (--top N)" in printed
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(out.read_text())
    assert data["sum_of_terms"] == pytest.approx(data["logit"], rel=1e-4, abs=1e-5)


def test_patch_command(model_dir, tmp_path, capsys):
    out = tmp_path / "patching"
    assert (
        main(
            [
                "patch",
                str(model_dir),
                "--clean",
                "abc abc ab",
                "--corrupted",
                "abc abd ab",
                "--answer",
                "c",
                "--wrong",
                "d",
                "--out",
                str(out),
                "--sweeps",
                "block,heads,head-outputs",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "restored fraction, top 5" in printed
    assert "head-outputs (layer x head, fast path), restored fraction" in printed
    for name in ("patch-block.png", "patch-heads.png", "patch-head-outputs.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "patching.json").read_text())
    assert data["sweeps"]["block"]["axes"] == ["activation", "layer", "pos"]
    assert data["sweeps"]["heads"]["shape"] == [5, 2, 2]
    # head-outputs is the first panel of heads (each head's output z), alone
    assert data["sweeps"]["head-outputs"]["shape"] == [2, 2]
    assert {sweep["path"] for sweep in data["sweeps"].values()} == {"fast"}
    assert data["sweeps"]["head-outputs"]["values"] == data["sweeps"]["heads"]["values"][:4]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["attribute", "{m}", "--prompt", "abc", "--answer", "ab"], "the answer 'ab' is 2 tokens"),
        (
            ["attribute", "{m}", "--prompt", "abc", "--answer", "c", "--wrong", "dd"],
            "the wrong answer 'dd' is 2 tokens",
        ),
        (
            [
                "patch",
                "{m}",
                "--clean",
                "abc a",
                "--corrupted",
                "abc",
                "--answer",
                "c",
                "--wrong",
                "d",
            ],
            "the clean text is 5 tokens and the corrupted text 3",
        ),
        (
            [
                "patch",
                "{m}",
                "--clean",
                "abc",
                "--corrupted",
                "abd",
                "--answer",
                "c",
                "--wrong",
                "d",
                "--sweeps",
                "block,hedas",
            ],
            "unknown sweep 'hedas'; choose from block, heads, heads-by-pos",
        ),
        (
            ["attribute", "{m}", "--prompt", "xyz", "--answer", "c"],
            "characters this character-level model never saw",
        ),
    ],
)
def test_mistakes_are_one_line(model_dir, tmp_path, capsys, argv, message):
    assert (
        main(
            [a.replace("{m}", str(model_dir)) for a in argv]
            + (["--out", str(tmp_path / "p")] if argv[0] == "patch" else [])
        )
        == 2
    )
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_worked_example_script_runs(tmp_path):
    """docs/tutorials/induction_heads.py on a tiny untrained attention-only model: it writes its
    pictures and numbers."""
    import subprocess
    import sys
    from pathlib import Path

    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            d_vocab=16,
            n_ctx=16,
            d_model=16,
            n_layers=2,
            n_heads=2,
            attn_only=True,
            tie_embeddings=False,
        )
    )
    save_native(model, tmp_path / "model")
    script = Path(__file__).resolve().parent.parent / "docs" / "tutorials" / "induction_heads.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            str(tmp_path / "model"),
            "--out",
            str(tmp_path / "out"),
            "--span",
            "5",
            "--batch",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    for name in ("dla.png", "patching.png", "composition.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    numbers = json.loads((tmp_path / "out" / "numbers.json").read_text())
    assert len(numbers["dla_heads"]) == 2 and len(numbers["patching"]["restored"]["output"]) == 2
