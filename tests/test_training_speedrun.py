"""The speedrun's training parts: the wsd schedule, --max-time, Muon, the whole-split evaluation,
--target-loss, and `--preset speedrun` itself (a short run: it builds, trains and lowers the loss;
no timing is asserted)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from training_tiny import tiny_config

import attnlab
from attnlab.cli import main
from attnlab.errors import UserError
from attnlab.training.config import TRAIN_PRESETS, TrainConfig, build_config
from attnlab.training.muon import Muon
from attnlab.training.schedule import Optimizers, learning_rate_at, make_optimizer
from attnlab.training.trainer import Trainer, train


def test_wsd_is_warmup_then_flat_then_a_straight_line_to_min_lr():
    cfg = TrainConfig(
        schedule="wsd",
        learning_rate=1.0,
        min_lr=0.1,
        warmup_iters=10,
        max_iters=110,
        cooldown_fraction=0.4,
    )
    assert [learning_rate_at(i, cfg) for i in range(10)] == [(i + 1) / 11 for i in range(10)]
    # stable for the first 60% after warm-up
    assert {learning_rate_at(i, cfg) for i in range(10, 71)} == {1.0}
    down = [learning_rate_at(i, cfg) for i in range(70, 111)]
    # linear, reaching min_lr at the end
    assert down == pytest.approx([1.0 - 0.9 * k / 40 for k in range(41)])
    assert learning_rate_at(500, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_max_time_runs_the_schedule_on_elapsed_time(schedule):
    cfg = TrainConfig(
        schedule=schedule,
        learning_rate=1.0,
        min_lr=0.0,
        warmup_iters=0,
        max_iters=10**6,
        max_time=100.0,
        cooldown_fraction=0.5,
    )
    by_time = [learning_rate_at(5, cfg, elapsed_s=t) for t in (0.0, 25.0, 50.0, 75.0, 100.0, 200.0)]
    steps = TrainConfig(
        schedule=schedule,
        learning_rate=1.0,
        min_lr=0.0,
        warmup_iters=0,
        max_iters=100,
        cooldown_fraction=0.5,
    )
    assert by_time == pytest.approx([learning_rate_at(i, steps) for i in (0, 25, 50, 75, 100, 200)])
    # whichever limit comes first decides: a run out of steps has decayed fully even with time left
    capped = TrainConfig(
        schedule=schedule,
        learning_rate=1.0,
        min_lr=0.0,
        warmup_iters=0,
        max_iters=10,
        max_time=100.0,
    )
    assert learning_rate_at(10, capped, elapsed_s=1.0) == pytest.approx(0.0)


def test_max_time_stops_the_run_in_its_cooldown_and_resume_continues_it(tmp_path, capsys):
    cfg = tiny_config(
        tmp_path,
        max_iters=10**6,
        lr_decay_iters=None,
        max_time=1.5,
        eval_interval=10**6,
        schedule="wsd",
        min_lr=0.0,
    )
    trainer = Trainer(cfg, progress=False)
    applied, step = [], trainer.optimizer.step  # the learning rate each optimizer step ran with
    trainer.optimizer.step = lambda: (
        applied.append(trainer.optimizer.param_groups[0]["lr"]),
        step(),
    )[1]
    first = trainer.run()
    # it ran until its budget, not its steps
    assert first.elapsed_s >= 1.5 and 0 < first.iters < 10**6
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(records) == 1 and records[0]["iter"] == first.iters == len(applied)
    # the log reports the rate the last step ran with (set from the time that step began), not one
    # recomputed after it, when the budget is spent and the schedule says min_lr whatever the step
    # used in the cooldown
    assert records[0]["lr"] == applied[-1] and 0.0 <= applied[-1] < cfg.learning_rate
    assert records[0]["elapsed_s"] >= 1.5
    # a larger budget continues the run where it stopped
    # the first session's evaluation and checkpoint count towards its time too
    budget = first.elapsed_s + 1.5
    more = train(cfg.replace(max_time=budget), resume=True, progress=False)
    assert more.iters > first.iters and more.elapsed_s >= budget
    assert min(more.losses) == first.iters + 1
    # a budget already spent is one line that says what to raise
    assert (
        main(
            [
                "train",
                "--out",
                str(tmp_path / "run"),
                "--resume",
                "--max-time",
                str(first.elapsed_s),
                "--quiet",
            ]
        )
        == 2
    )
    assert "raise --max-time" in capsys.readouterr().err


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(tmp_path):
    model = attnlab.Transformer(
        attnlab.preset(
            "nano", d_vocab=11, n_layers=2, d_model=16, n_heads=2, tie_embeddings=False, bias=False
        )
    )
    optimizer = make_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    assert isinstance(optimizer, Optimizers)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    expected = {id(p) for block in model.blocks for p in block.parameters() if p.dim() == 2}
    # W_Q, W_K, W_V, W_O, W_in, W_out per block
    assert in_muon == expected and len(expected) == 2 * 6
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert in_adamw == {id(p) for p in model.parameters()} - expected
    assert id(model.embed.weight) in in_adamw and id(model.unembed.weight) in in_adamw
    # torch's default, unless --muon-ns-steps says otherwise
    assert muon.param_groups[0]["ns_steps"] == 5
    fewer = make_optimizer(
        model, TrainConfig(optimizer="muon", muon_ns_steps=4), torch.device("cpu")
    )
    assert fewer.optimizers[0].param_groups[0]["ns_steps"] == 4
    with pytest.raises(UserError, match="--muon-ns-steps must be a positive integer"):
        TrainConfig(optimizer="muon", muon_ns_steps=0)
    # a Muon run trains, saves both optimizers' state and resumes exactly
    changes = dict(optimizer="muon", max_iters=6, lr_decay_iters=6, eval_interval=3)
    whole = train(tiny_config(tmp_path / "a", **changes), progress=False)
    train(tiny_config(tmp_path / "b", **{**changes, "max_iters": 3}), progress=False)
    rest = train(tiny_config(tmp_path / "b", **changes), resume=True, progress=False)
    assert rest.losses == pytest.approx({k: v for k, v in whole.losses.items() if k > 3}, abs=1e-6)
    assert whole.losses[6] < whole.losses[1]


def test_full_val_loss_scores_every_validation_token_once(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, block_size=24), progress=False)
    val = torch.from_numpy(trainer.data.split("val").astype("int64"))
    assert (len(val) - 1) % 24  # the split ends in a shorter window, which must count too
    model = trainer.raw_model.eval()
    with torch.no_grad():  # one window at a time, each token scored from the start of its window
        windows = [(s, min(s + 24, len(val) - 1)) for s in range(0, len(val) - 1, 24)]
        total = sum(
            F.cross_entropy(model(val[s:e][None])[0], val[s + 1 : e + 1], reduction="sum")
            for s, e in windows
        )
    expected = float(total) / (len(val) - 1)
    assert trainer.full_val_loss() == pytest.approx(expected, rel=1e-6)
    assert trainer.full_val_loss(batch_size=3) == pytest.approx(expected, rel=1e-6)


def test_the_last_evaluation_records_the_whole_split_and_the_target_time(tmp_path):
    cfg = tiny_config(tmp_path, max_iters=6, lr_decay_iters=6, eval_interval=3, target_loss=100.0)
    result = train(cfg, progress=False)
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert (
        "val_loss_full" not in records[0] and records[-1]["val_loss_full"] == result.val_loss_full
    )
    # the first evaluation at or below 100
    assert records[0]["target_reached_s"] == records[0]["elapsed_s"]
    assert "target_reached_s" not in records[1]
    report = (tmp_path / "run" / "report.md").read_text()
    assert (
        f"| final val loss, whole split (every token once) | {result.val_loss_full:.4f} |" in report
    )
    assert (
        f"| first evaluation with val loss <= 100 | step 3, {records[0]['elapsed_s']:.1f} s |"
        in report
    )
    train(cfg.replace(target_loss=0.01), overwrite=True, progress=False)
    assert (
        "| first evaluation with val loss <= 0.01 | not reached |"
        in (tmp_path / "run" / "report.md").read_text()
    )


def test_speedrun_preset_builds_trains_and_lowers_the_loss(tmp_path):
    data = tiny_config(tmp_path).data  # writes the tiny text
    cfg = build_config("speedrun", overrides=dict(data=data))
    for name, value in TRAIN_PRESETS["speedrun"].items():  # every choice the preset makes is a flag
        assert getattr(cfg, name) == value
    # the preset's recipe, fewer and smaller steps, on the tiny text
    assert (
        main(
            [
                "train",
                "--preset",
                "speedrun",
                "--data",
                data,
                "--out",
                str(tmp_path / "run"),
                "--max-iters",
                "30",
                "--eval-interval",
                "15",
                "--eval-iters",
                "2",
                "--batch-size",
                "4",
                "--warmup-iters",
                "3",
                "--quiet",
            ]
        )
        == 0
    )
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    d_vocab = attnlab.load(tmp_path / "run").config.d_vocab
    # from ln(vocab) at init
    assert records[-1]["val_loss_full"] < records[0]["val_loss"] < 0.8 * math.log(d_vocab)
    loaded = attnlab.load(tmp_path / "run")
    assert loaded.config == cfg.model_config(d_vocab=d_vocab)
