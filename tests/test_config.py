"""attnlab.model.config: validation messages that name the values and a fix, derived sizes,
presets."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Union

import pytest
import torch

from attnlab import PRESETS, ModelConfig, Transformer, preset
from attnlab.errors import UserError
from attnlab.model.config import field_types


def test_heads_that_do_not_divide_d_model_are_refused_with_a_fix():
    with pytest.raises(UserError) as err:
        ModelConfig(d_model=100, n_heads=3)
    message = str(err.value)
    assert "d_model (100) must be divisible by n_heads (3)" in message
    suggested = [int(n) for n in message.split("try n_heads=")[1].split(" or ")]
    assert suggested and all(100 % n == 0 for n in suggested)
    ModelConfig(d_model=100, n_heads=suggested[0])  # the fix works
    ModelConfig(d_model=100, n_heads=3, d_head=32)  # an explicit d_head needs no divisibility


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(n_heads=4, n_kv_heads=3),
            r"n_heads \(4\) must be a multiple of n_kv_heads \(3\); try n_kv_heads=1",
        ),
        (dict(n_kv_heads=0), r"n_kv_heads \(0\)"),
        (dict(n_kv_heads=1.5), "n_kv_heads must be a positive integer .* got 1.5"),
        (dict(n_kv_heads="2"), "n_kv_heads must be a positive integer .* got '2'"),
        (
            dict(positional="alibi"),
            "positional must be one of learned, sinusoidal, rope, none; got 'alibi'",
        ),
        (dict(norm="batchnorm"), "norm must be one of layernorm, rmsnorm"),
        (dict(norm_placement="sandwich"), "norm_placement must be one of pre, post"),
        (dict(mlp="geglu"), "mlp must be one of gelu, gelu_tanh, relu, relu2, swiglu"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (dict(dropout=-0.1), "dropout must be in"),
        (dict(rotary_fraction=0.0), r"rotary_fraction must be in \(0, 1\]"),
        (dict(positional="rope", d_model=12, n_heads=2, rotary_fraction=0.5), r"= 3 is odd"),
        (
            dict(positional="sinusoidal", d_model=15, n_heads=3),
            "sinusoidal positions need an even d_model, got 15",
        ),
        (dict(n_token_types=-1), "n_token_types must be >= 0"),
        (dict(d_model=0), "d_model must be a positive integer, got 0"),
        (dict(n_layers=2.5), "n_layers must be a positive integer, got 2.5"),
        (dict(d_vocab=-3), "d_vocab must be a positive integer"),
        (dict(d_head=0), "d_head must be a positive integer, got 0"),
        (dict(d_mlp=-4), "d_mlp must be a positive integer, got -4"),
        (dict(n_layers=True), "n_layers must be a positive integer, got True"),
        (
            dict(parallel_residual=True, norm_placement="post"),
            "parallel_residual needs pre-norm blocks with an MLP",
        ),
        (dict(parallel_residual=True, attn_only=True), "parallel_residual needs .* attn_only=True"),
        (
            dict(rope_scaling="yarn", positional="rope"),
            "rope_scaling must be one of none, linear, llama3; got 'yarn'",
        ),
        (
            dict(rope_scaling="linear"),
            r"rope_scaling='linear' scales RoPE's angles, but positional='learned'",
        ),
        (
            dict(positional="rope", rope_scaling="linear", rope_scaling_factor=0.0),
            "rope_scaling_factor must be > 0",
        ),
        (
            dict(
                positional="rope",
                rope_scaling="llama3",
                rope_low_freq_factor=4.0,
                rope_high_freq_factor=1.0,
            ),
            r"0 < rope_low_freq_factor \(4.0\) < rope_high_freq_factor \(1.0\)",
        ),
        (dict(rope_original_n_ctx=0), "rope_original_n_ctx must be a positive integer"),
        (
            dict(sliding_window_pattern=6),
            r"sliding_window_pattern must be an integer >= 2 with a sliding_window .* got 6 "
            "with sliding_window=None",
        ),
        (dict(sliding_window=4, sliding_window_pattern=1), "got 1 with sliding_window=4"),
        (
            dict(rope_theta_local=1e4, positional="rope"),
            "rope_theta_local is the RoPE base of the sliding-window blocks: it needs .* "
            "sliding_window=None",
        ),
        (
            dict(sandwich_norm=True, norm_placement="post"),
            "sandwich_norm norms the attention and MLP outputs of pre-norm blocks; got "
            "norm_placement='post'",
        ),
    ],
)
def test_bad_configs_raise_user_errors_that_name_the_values(fields, message):
    with pytest.raises(UserError, match=message):
        ModelConfig(**fields)


def test_the_config_is_frozen_and_replace_validates():
    config = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 64  # type: ignore[misc]
    assert config.replace(n_heads=8).n_heads == 8
    with pytest.raises(UserError, match="divisible"):
        config.replace(n_heads=3)


def test_derived_sizes():
    config = ModelConfig(d_model=64, n_heads=8)
    assert (config.d_head, config.n_kv_heads, config.d_mlp, config.use_qkv_bias) == (
        8,
        8,
        256,
        True,
    )
    assert config.scale == pytest.approx(8**-0.5)  # the chapter's 1/√d_k
    config = ModelConfig(
        d_model=64,
        n_heads=8,
        n_kv_heads=2,
        d_head=16,
        d_mlp=100,
        bias=False,
        qkv_bias=True,
        positional="rope",
        rotary_fraction=0.25,
        attn_scale=0.1,
    )
    assert (config.d_head, config.n_kv_heads, config.d_mlp, config.use_qkv_bias) == (
        16,
        2,
        100,
        True,
    )
    assert (config.rotary_dim, config.scale) == (4, 0.1)


def test_dict_round_trip_through_json():
    config = ModelConfig(d_vocab=65, positional="rope", n_kv_heads=2, extra={"source": "test"})
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.extra == {"source": "test"}
    with pytest.raises(UserError, match=r"unknown model config keys \['n_embd'\]"):
        ModelConfig.from_dict({**config.to_dict(), "n_embd": 3})


SMALL_PRESETS = [name for name in PRESETS if name != "gpt2-small"]


@pytest.mark.parametrize("name", SMALL_PRESETS)
def test_presets_build_and_run(name):
    config = preset(name)
    model = Transformer(config).eval()
    ids = torch.randint(0, config.d_vocab, (1, 5))
    out = model(ids)
    assert out.shape == (1, 5, config.d_vocab if config.causal else config.d_model)
    assert torch.isfinite(out).all()


def test_gpt2_small_preset_has_gpt2_smalls_parameter_count():
    """124,439,808 parameters (tied head), counted from 1- and 2-layer builds: building all 12 takes
    seconds."""
    config = preset("gpt2-small")
    assert (config.n_layers, config.n_heads, config.d_model, config.n_ctx, config.d_vocab) == (
        12,
        12,
        768,
        1024,
        50257,
    )
    one, two = (
        Transformer(preset("gpt2-small", n_layers=n, d_vocab=1)).num_params() for n in (1, 2)
    )
    per_layer = two - one
    # attention 4d² + 4d, MLP 8d² + 5d, two LayerNorms 4d
    assert per_layer == 12 * 768**2 + 13 * 768
    assert one + 11 * per_layer + (config.d_vocab - 1) * 768 == 124_439_808


def test_preset_overrides_and_unknown_names():
    assert preset("nano", d_vocab=65).d_vocab == 65
    assert preset("llama-tiny").n_kv_heads == 2
    with pytest.raises(UserError, match="unknown preset 'gpt5'; choose one of nano"):
        preset("gpt5")
    with pytest.raises(UserError, match="divisible"):
        preset("nano", n_heads=3)


@dataclasses.dataclass
class _Annotated:
    plain: int = 0
    union: float | None = None
    optional: Optional[str] = None  # the older spellings must read the same
    old_union: Union[bool, None] = None
    table: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_field_types_reads_the_annotations_not_their_text():
    assert field_types(_Annotated) == {
        "plain": (int, False),
        "union": (float, True),
        "optional": (str, True),
        "old_union": (bool, True),
        "table": (dict, False),
    }


def test_every_model_setting_refuses_a_value_of_another_type_naming_itself():
    """What config.json may hold: each field refuses a value of another type, with its name, and
    only the fields whose default is None accept None (ModelConfig._check_types, read from the
    annotations)."""
    for f in dataclasses.fields(ModelConfig):
        if f.name == "extra":
            continue
        wrong = 1 if isinstance(f.default, str) else "x"
        with pytest.raises(UserError, match=rf"^{f.name} must be "):
            ModelConfig(**{f.name: wrong})
        if f.default is None:
            ModelConfig(**{f.name: None})
        else:
            with pytest.raises(UserError, match=rf"^{f.name} must be "):
                ModelConfig(**{f.name: None})
