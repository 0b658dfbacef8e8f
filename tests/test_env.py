"""attnlab.env: the settings read from the environment. The caps shorten a documented command
without changing its text (tests/test_readme_commands.py runs the README that way), and say so."""

from __future__ import annotations

import json

import pytest
from training_tiny import one_line_error, tiny_config

from attnlab.cli import build_parser, main
from attnlab.env import capped, explorer_port
from attnlab.errors import UserError
from attnlab.training.trainer import train


def test_a_cap_shortens_only_what_is_longer_and_says_so(monkeypatch, capsys):
    monkeypatch.delenv("ATTNLAB_MAX_STEPS", raising=False)
    assert capped(500, "ATTNLAB_MAX_STEPS", "training steps") == 500
    monkeypatch.setenv("ATTNLAB_MAX_STEPS", "3")
    assert capped(2, "ATTNLAB_MAX_STEPS", "training steps") == 2
    assert capsys.readouterr().err == ""
    assert capped(500, "ATTNLAB_MAX_STEPS", "training steps") == 3
    assert "ATTNLAB_MAX_STEPS=3 caps training steps at 3 (of 500)" in capsys.readouterr().err
    for wrong in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("ATTNLAB_MAX_STEPS", wrong)
        expected = f"ATTNLAB_MAX_STEPS='{wrong}': give a whole number >= 1"
        with pytest.raises(UserError, match=expected):
            capped(500, "ATTNLAB_MAX_STEPS", "training steps")


def test_max_steps_caps_a_training_run_schedule_and_all(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNLAB_MAX_STEPS", "2")
    cfg = tiny_config(tmp_path, max_iters=6, lr_decay_iters=None, snapshots=3, eval_iters=5)
    result = train(cfg, progress=False)
    assert result.iters == 2
    (checkpoint,) = (result.out / "checkpoints").iterdir()
    saved = json.loads((checkpoint / "train.json").read_text())["config"]
    assert (saved["max_iters"], saved["eval_iters"]) == (2, 2), saved
    metrics = (result.out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iter"] for line in metrics] == [2]
    snapshots = sorted(p.name for p in (result.out / "snapshots").iterdir())
    assert snapshots[-1] == "step-000002.safetensors"
    assert "caps training steps at 2 (of 6)" in capsys.readouterr().err
    # the capped run is complete: restarted with --resume auto, it says so and trains nothing
    again = train(cfg, resume="auto", progress=False)
    assert again.complete and again.iters == 2


def test_max_new_tokens_caps_a_sample(tmp_path, monkeypatch, capsys):
    run = train(tiny_config(tmp_path, max_iters=2), progress=False).out
    capsys.readouterr()
    monkeypatch.setenv("ATTNLAB_MAX_NEW_TOKENS", "5")
    sample = ["sample", str(run), "--prompt", "the", "--max-new-tokens", "300", "--seed", "1"]
    assert main(sample) == 0
    captured = capsys.readouterr()
    assert len(captured.out) == len("the") + 5 + 1  # a character per token, then print()'s newline
    assert "ATTNLAB_MAX_NEW_TOKENS=5 caps the tokens of a sample at 5 (of 300)" in captured.err
    monkeypatch.setenv("ATTNLAB_MAX_NEW_TOKENS", "many")
    assert main(["sample", str(run), "--prompt", "the"]) == 2
    assert "ATTNLAB_MAX_NEW_TOKENS='many'" in one_line_error(capsys.readouterr().err)


def test_the_explorers_port_is_the_flag_else_attnlab_port_else_8000(monkeypatch, capsys):
    monkeypatch.delenv("ATTNLAB_PORT", raising=False)
    for command in (["explore"], ["demo"], ["experiment", "induction"]):
        assert build_parser().parse_args(command).port is None  # resolved when the command runs
    assert explorer_port(None) == 8000 and explorer_port(8123) == 8123
    monkeypatch.setenv("ATTNLAB_PORT", "0")
    assert explorer_port(None) == 0 and explorer_port(8123) == 8123
    monkeypatch.setenv("ATTNLAB_PORT", "http")
    assert main(["explore", "no-such-model-folder"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "ATTNLAB_PORT='http': give a whole number >= 0" in line
