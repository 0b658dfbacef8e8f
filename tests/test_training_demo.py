"""`attnlab demo` (`make demo`): pattern walk-through, a short training run on the built-in corpus, a sample."""

from __future__ import annotations

import json

import pytest

from attnlab.cli import main


@pytest.mark.slow
def test_demo_trains_on_the_builtin_corpus_samples_and_opens_the_explorer(tmp_path, capsys, monkeypatch):
    from attnlab.explorer import cli as explorer_cli

    served = []
    monkeypatch.setattr(explorer_cli, "run_explore", lambda args: served.append(args) or 0)
    out = tmp_path / "demo"
    code = main(["demo", "--max-iters", "2", "--out", str(out), "--sample-tokens", "20", "--port", "0"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "causal attention pattern of 'A B C'" in printed
    assert "Python's bundled documentation" in printed and "val loss" in printed
    sample = printed.split("--prompt 'The '):\n\n", 1)[1]
    assert sample.startswith("The ") and len(sample.strip()) >= 4
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["iter"] == 2
    assert json.loads((out / "config.json").read_text())["model"]["positional"] == "rope"
    assert len(served) == 1 and served[0].models == [str(out)] and served[0].host == "127.0.0.1"
