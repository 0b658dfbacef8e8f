"""`attnlab train --snapshots N`: float16 weights at evenly spaced steps, read back as the model was
at that step."""

from __future__ import annotations

import pytest
import torch
from training_tiny import tiny_config, tiny_flags

import attnlab
from attnlab.cli import main
from attnlab.errors import UserError
from attnlab.training.snapshots import list_snapshots, load_snapshot, snapshot_steps
from attnlab.training.trainer import train


def test_snapshot_steps_are_evenly_spaced_from_the_start_to_the_end():
    assert snapshot_steps(1000, 5) == [0, 250, 500, 750, 1000]
    assert snapshot_steps(6, 3) == [0, 3, 6]
    assert snapshot_steps(6, 1) == [6]
    assert snapshot_steps(6, 0) == []
    assert snapshot_steps(3, 10) == [0, 1, 2, 3]  # more snapshots than steps: each step once
    with pytest.raises(UserError, match="--snapshots must be >= 0"):
        snapshot_steps(6, -1)


def test_train_keeps_float16_snapshots_that_load_as_the_model_was(tmp_path):
    cfg = tiny_config(tmp_path, max_iters=6, lr_decay_iters=6, eval_interval=3, snapshots=3)
    train(cfg, progress=False)
    run = tmp_path / "run"
    snaps = list_snapshots(run)
    assert list(snaps) == [0, 3, 6]
    from safetensors.torch import load_file

    assert all(t.dtype == torch.float16 for t in load_file(snaps[3]).values())
    model = attnlab.load(run)  # the final checkpoint, float32
    last = load_snapshot(model, snaps[6])
    first = load_snapshot(model, snaps[0])
    # the last snapshot is the final weights, rounded to float16
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(last.state_dict()[name], weight.half().float(), rtol=0, atol=0)
    # training moved them
    assert not torch.equal(first.state_dict()["embed.weight"], last.state_dict()["embed.weight"])
    assert last.tokenizer is model.tokenizer and next(last.parameters()).dtype == torch.float32
    # starting over removes the old run's snapshots, so the slider never mixes two runs
    train(
        tiny_config(tmp_path, max_iters=4, lr_decay_iters=4, eval_interval=2, snapshots=2),
        progress=False,
        overwrite=True,
    )
    assert list(list_snapshots(run)) == [0, 4]


def test_the_flag_reaches_the_trainer(tmp_path, capsys):
    assert main(["train", *tiny_flags(tmp_path), "--snapshots", "2"]) == 0
    assert list(list_snapshots(tmp_path / "run")) == [0, 6]
    assert main(["train", *tiny_flags(tmp_path), "--overwrite", "--snapshots", "-1"]) == 2
    assert "--snapshots must be >= 0" in capsys.readouterr().err
