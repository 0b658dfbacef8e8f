"""TrainConfig: flags generated from its fields, nanoGPT names mapped onto ModelConfig, config
files, presets."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from attnlab.errors import UserError
from attnlab.model.config import ModelConfig, field_types
from attnlab.training.cli import add_commands
from attnlab.training.config import MODEL_FIELDS, TRAIN_PRESETS, TrainConfig, build_config


def parse_train(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train", *argv])


def test_every_field_has_a_flag_and_nothing_else_does():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    train = parser._subparsers._group_actions[0].choices["train"]
    flags = {
        opt for action in train._actions for opt in action.option_strings if opt.startswith("--")
    }
    fields = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)}
    assert fields <= flags
    negations = {
        "--no-" + f.name.replace("_", "-")
        for f in dataclasses.fields(TrainConfig)
        if f.type == "bool"
    }
    assert negations == {
        "--no-bias",
        "--no-attn-only",
        "--no-compile",
        "--no-qk-norm",
        "--no-tie-embeddings",
        "--no-zero-init-projections",
    }
    assert flags - fields - negations == {
        "--help",
        "--preset",
        "--config",
        "--resume",
        "--overwrite",
        "--quiet",
    }


def test_nanogpt_flags_parse_into_the_model_config():
    args = parse_train(
        "--n-layer 2 --n-head 4 --n-embd 32 --block-size 16 --n-kv-head 2 --pos rope "
        "--norm rmsnorm --mlp swiglu --no-bias --dropout 0.1 --learning-rate 3e-4".split()
    )
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if hasattr(args, f.name)
    }
    cfg = build_config(overrides=overrides)
    model = cfg.model_config(d_vocab=50)
    assert (model.n_layers, model.n_heads, model.d_model, model.n_ctx, model.n_kv_heads) == (
        2,
        4,
        32,
        16,
        2,
    )
    assert (model.positional, model.norm, model.mlp, model.bias, model.dropout) == (
        "rope",
        "rmsnorm",
        "swiglu",
        False,
        0.1,
    )
    # untyped flags keep defaults
    assert cfg.learning_rate == 3e-4 and cfg.batch_size == TrainConfig().batch_size


def test_speedrun_flags_parse_into_the_model_and_training_configs():
    args = parse_train(
        "--mlp relu2 --qk-norm --no-tie-embeddings --logit-softcap 15 --zero-init-projections "
        "--optimizer muon --schedule wsd --cooldown-fraction 0.5 "
        "--max-time 60 --target-loss 1.886".split()
    )
    cfg = build_config(
        overrides={
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(TrainConfig)
            if hasattr(args, f.name)
        }
    )
    model = cfg.model_config(d_vocab=50)
    assert (
        model.mlp,
        model.qk_norm,
        model.tie_embeddings,
        model.logit_softcap,
        model.zero_init_projections,
    ) == ("relu2", True, False, 15.0, True)
    assert (cfg.optimizer, cfg.schedule, cfg.cooldown_fraction, cfg.max_time, cfg.target_loss) == (
        "muon",
        "wsd",
        0.5,
        60.0,
        1.886,
    )


def test_model_field_map_targets_model_config():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(MODEL_FIELDS.values()) <= names
    assert set(MODEL_FIELDS) <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_a_model_flag_has_its_model_fields_type_and_admits_null_exactly_where_it_does():
    """A flag's type (and whether a config file may set it to null) comes from TrainConfig's
    annotation, the model's check from ModelConfig's, both read by one helper: the two annotations
    must agree, or a flag would parse what the model then refuses (or a config file's null would
    reach the model as a refusal)."""
    train, model = field_types(TrainConfig), field_types(ModelConfig)
    for name, target in MODEL_FIELDS.items():
        assert train[name] == model[target], (name, target)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_file_same_keys_and_precedence(tmp_path, suffix):
    path = tmp_path / f"cfg{suffix}"
    if suffix == ".toml":
        path.write_text('n-layer = 3\nlearning_rate = 1\npos = "rope"\n')
    else:
        path.write_text(json.dumps({"n-layer": 3, "learning_rate": 1, "pos": "rope"}))
    cfg = build_config(preset="nano", config_file=path, overrides={"pos": "learned"})
    assert cfg.n_layer == 3 and cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    assert cfg.pos == "learned"  # a typed flag beats the file
    # the preset fills the rest
    assert cfg.lr_decay_iters == TRAIN_PRESETS["nano"]["lr_decay_iters"]


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("n_layr = 3\n")
    with pytest.raises(UserError, match="unknown key 'n-layr'; did you mean n-layer"):
        build_config(config_file=bad)
    bad.write_text('n_layer = "three"\n')
    with pytest.raises(UserError, match="n-layer must be int"):
        build_config(config_file=bad)
    bad.write_text("n_layer = = 3\n")
    with pytest.raises(UserError, match="cannot parse"):
        build_config(config_file=bad)
    with pytest.raises(UserError, match="no such file"):
        build_config(config_file=tmp_path / "missing.toml")
    null = tmp_path / "null.json"
    null.write_text('{"warmup_iters": null}')  # only fields typed `X | None` may be null
    with pytest.raises(UserError, match="warmup-iters must be int, got None"):
        build_config(config_file=null)
    null.write_text('{"lr_decay_iters": null, "n_kv_head": null}')
    assert build_config(config_file=null).lr_decay_iters is None


def test_n_embd_not_divisible_by_n_head_names_the_flags():
    with pytest.raises(
        UserError, match=r"d_model \(100\) must be divisible by n_heads \(3\).*--n-embd is d_model"
    ):
        TrainConfig(n_embd=100, n_head=3)


@pytest.mark.parametrize(
    "bad",
    [
        dict(batch_size=0),
        dict(max_iters=-1),
        dict(beta2=1.0),
        dict(tokenizer="words"),
        dict(dtype="int8"),
        dict(learning_rate=-1.0),
        dict(max_time=0.0),
        dict(cooldown_fraction=1.5),
        dict(optimizer="sgd"),
        dict(schedule="step"),
        dict(logit_softcap=-1.0),
    ],
)
def test_bad_values_are_user_errors(bad):
    with pytest.raises(UserError):
        TrainConfig(**bad)


@pytest.mark.parametrize("name", list(TRAIN_PRESETS))
def test_presets_build(name):
    cfg = build_config(preset=name)
    cfg.model_config(d_vocab=65)
    with pytest.raises(UserError, match="unknown preset"):
        build_config(preset=name + "x")
