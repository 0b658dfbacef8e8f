"""The scaling, extrapolation and coreference experiments, and `attnlab heads`."""

import json
import math

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.inspection.experiments import coreference, scaling


def test_scaling_shows_what_the_scale_is_for(tmp_path, capsys):
    assert main(["experiment", "scaling", "--out", str(tmp_path)]) == 0
    assert "grad norm" in capsys.readouterr().out
    result = json.loads((tmp_path / "scaling.json").read_text())
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    rows = {(r["d_k"], r["scaled"]): r for r in result["rows"]}
    # With 1/sqrt(d_k) the scores keep unit spread and the softmax looks the same at every d_k ...
    for d in (4, 1024):
        assert rows[d, True]["score_std"] == pytest.approx(1.0, abs=0.1)
    assert abs(rows[1024, True]["entropy"] - rows[4, True]["entropy"]) < 0.1
    # ... without it the scores spread like sqrt(d_k), the softmax saturates and its gradient
    # shrinks.
    assert rows[1024, False]["score_std"] == pytest.approx(32.0, rel=0.1)
    assert rows[1024, False]["max_weight"] > 0.9 > 0.2 > rows[1024, True]["max_weight"]
    assert rows[1024, False]["entropy"] < 0.5 * rows[1024, True]["entropy"]
    assert rows[1024, False]["grad_norm"] < 0.5 * rows[1024, True]["grad_norm"]


def test_experiment_out_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["experiment", "scaling", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and "Traceback" not in err


def test_scaling_measure_uses_the_models_softmax():
    row = scaling.measure(16, True, n_queries=64, n_keys=8)
    assert 0 < row["entropy"] <= math.log(8) + 1e-9
    assert 1 / 8 <= row["max_weight"] <= 1


@pytest.mark.slow
def test_extrapolation_quick(tmp_path, capsys):
    assert main(["experiment", "extrapolation", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "n/a" in out  # learned positions past n_ctx
    result = json.loads((tmp_path / "extrapolation.json").read_text())
    rows = {r["positional"]: r for r in result["rows"]}
    assert set(rows) == {"learned", "sinusoidal", "rope", "none"}
    assert rows["learned"]["loss_2x"] is None and rows["learned"]["loss_4x"] is None
    for name in ("sinusoidal", "rope", "none"):
        for f in (1, 2, 4):
            assert 0 < rows[name][f"loss_{f}x"] < 10
    # every model learned something at the training length (uniform guessing is log 64 = 4.16)
    assert all(r["loss_1x"] < math.log(64) for r in rows.values())
    # ... trained by the Trainer (one training loop): each model a run directory that loads as
    # trained
    from attnlab.inspection.experiments.common import SyntheticText, per_token_loss
    from attnlab.inspection.experiments.extrapolation import QUICK

    model = attnlab.load(tmp_path / "extrapolation-rope")
    assert model.config.positional == "rope" and model.config.d_mlp == 2 * QUICK.d_model
    assert (tmp_path / "extrapolation-rope" / "metrics.jsonl").is_file()
    evals = SyntheticText(d_vocab=QUICK.d_vocab).sample(QUICK.n_eval, QUICK.n_ctx + 1, seed=10_001)
    assert float(per_token_loss(model, evals).mean()) == pytest.approx(
        rows["rope"]["loss_1x"], rel=1e-5
    )


def test_coreference_scoring_on_hand_built_patterns():
    # tokens: 0 [CLS]  1 the  2 cat  3 sat  4 on  5 mat  6 it
    tokens = {"pronoun": [6], "antecedent": [2], "other": [5]}
    patterns = torch.zeros(1, 2, 7, 7)
    patterns[0, 0, 6, 2] = 0.7  # head 0: pronoun -> cat
    patterns[0, 0, 6, 5] = 0.3
    patterns[0, 1, 6, 5] = 0.9  # head 1: pronoun -> mat
    right, mass = coreference.head_votes(patterns, tokens)
    assert right.tolist() == [[True, False]]
    assert mass[0].tolist() == pytest.approx([0.7, 0.0])


def test_coreference_locates_words_by_offsets():
    text = "The cat sat on the mat because it was tired."
    char_offsets = [(i, i + 1) for i in range(len(text))]
    where = coreference.locate(text, char_offsets, "it", "cat", "mat")
    assert where == {"pronoun": [31, 32], "antecedent": [4, 5, 6], "other": [19, 20, 21]}
    with pytest.raises(attnlab.UserError, match="dog"):
        coreference.locate(text, char_offsets, "it", "dog", "mat")


def test_coreference_on_a_random_encoder_with_a_char_tokenizer(tmp_path):
    from attnlab.tokenizer import Tokenizer

    tokenizer = Tokenizer.train_char("".join(s[0] for s in coreference.SENTENCES))
    torch.manual_seed(0)
    model = attnlab.Transformer(
        attnlab.preset(
            "bert-mini",
            d_vocab=tokenizer.vocab_size,
            n_layers=2,
            n_heads=4,
            d_model=32,
            d_mlp=64,
            n_ctx=128,
        )
    )
    model.tokenizer = tokenizer
    result = coreference.run(tmp_path, model=model, model_name="random bert-mini")
    accuracy = torch.as_tensor(result["accuracy"])
    assert accuracy.shape == (2, 4)
    assert ((accuracy >= 0) & (accuracy <= 1)).all()
    assert result["best_heads"][0]["accuracy"] == pytest.approx(float(accuracy.max()))
    assert len(result["per_sentence_best_head"]) == len(coreference.SENTENCES)
    assert (tmp_path / "coreference.png").exists()
    assert "chance" in coreference.table(result)


@pytest.mark.slow
def test_coreference_on_the_bundled_minilm(tmp_path, capsys):
    assert main(["experiment", "coreference", "--out", str(tmp_path)]) == 0
    assert "heads are right" in capsys.readouterr().out
    result = json.loads((tmp_path / "coreference.json").read_text())
    assert result["n_heads_total"] == 6 * 12
    assert 0.5 < result["best_heads"][0]["accuracy"] <= 1.0


def test_heads_command_prints_tables_and_writes_json_and_png(tmp_path, capsys):
    torch.manual_seed(0)
    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=40, n_ctx=32, n_layers=2))
    attnlab.save(model, tmp_path / "m")
    assert (
        main(
            [
                "heads",
                str(tmp_path / "m"),
                "--json",
                str(tmp_path / "s.json"),
                "--png",
                str(tmp_path / "s.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for name in ("previous_token", "induction", "duplicate_token", "first_token", "copying"):
        assert name in out
    assert "L1" in out and "H3" in out
    data = json.loads((tmp_path / "s.json").read_text())
    assert len(data["scores"]["induction"]) == 2 and len(data["scores"]["induction"][0]) == 4
    assert (tmp_path / "s.png").stat().st_size > 5_000


def test_heads_command_marks_a_standout_head():
    from attnlab.inspection.cli import score_table

    table = score_table(torch.tensor([[0.1, 0.9], [float("nan"), 0.2]]), 0.5)
    assert "0.90*" in table and "0.10 " in table and "n/a" in table


def test_heads_command_on_a_missing_model_is_one_line(tmp_path, capsys):
    assert main(["heads", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--repeats", "--batch"])
def test_heads_command_on_a_zero_count_is_one_line(tmp_path, capsys, flag):
    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=40, n_ctx=32, n_layers=1))
    attnlab.save(model, tmp_path / "m")
    assert main(["heads", str(tmp_path / "m"), flag, "0"]) == 2
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("d_vocab", [8, 64])
def test_repeated_spans_repeat_a_span_after_a_prefix(d_vocab):
    from attnlab.inspection.experiments.common import repeated_spans

    data = repeated_spans(50, 49, d_vocab, seed=0)
    assert data.shape == (50, 49) and int(data.max()) < d_vocab
    for row in data.tolist():
        # some period p: from some point on, every token equals the one p places back
        assert any(all(row[i] == row[i - p] for i in range(8 + p, 49)) for p in range(1, 21))


def test_experiment_training_shows_a_progress_bar_without_a_line_per_evaluation(tmp_path, capsys):
    """An experiment trains many small models: the Trainer's bar on stderr, not its 100 lines per
    model; `attnlab train`'s Trainer (the default) still prints a line per evaluation."""
    from training_tiny import tiny_config

    from attnlab.inspection.experiments.common import repeated_spans, train_run
    from attnlab.training.trainer import Trainer

    data = repeated_spans(40, 17, 8, seed=0)
    train_run(
        data,
        8,
        tmp_path / "exp",
        steps=4,
        batch=4,
        lr=1e-3,
        seed=0,
        progress=True,
        eval_interval=2,
        n_layer=1,
        n_head=2,
        n_embd=16,
    )
    err = capsys.readouterr().err
    assert "train:" in err and "4/4" in err  # the bar
    assert "step 2: train loss" not in err and "val loss" not in err, err
    Trainer(tiny_config(tmp_path / "cli", max_iters=4, eval_interval=2)).run()
    err = capsys.readouterr().err
    assert "step 2: train loss" in err and "step 4: train loss" in err, err
