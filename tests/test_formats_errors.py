"""Bad checkpoints: each gives one clear line naming the file or key and what was expected, and the
command line exits non-zero without a traceback. Checkpoints are written here with safetensors
directly, so these tests need no transformers."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

import attnlab
from attnlab.cli import main
from attnlab.errors import UserError
from attnlab.tokenizer import Tokenizer

GPT2_CONFIG = {
    "model_type": "gpt2",
    "vocab_size": 13,
    "n_positions": 8,
    "n_embd": 12,
    "n_layer": 1,
    "n_head": 2,
}


def write_gpt2(path, config=None, drop=(), add=None, shape_of=None):
    """A valid tiny GPT-2 directory written by attnlab, then edited to break one thing."""
    model = attnlab.Transformer(
        attnlab.ModelConfig(d_vocab=13, n_ctx=8, d_model=12, n_layers=1, n_heads=2, mlp="gelu_tanh")
    )
    attnlab.save(model, path, format="hf")
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    for key in drop:
        del tensors[key]
    tensors.update(add or {})
    save_file(tensors, path / "model.safetensors")
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_directory_in_neither_format(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(UserError, match="neither an attnlab checkpoint nor a Hugging Face") as info:
        attnlab.load(tmp_path)
    one_line(info)
    with pytest.raises(UserError, match="no such model directory"):
        attnlab.load(tmp_path / "nope")
    with pytest.raises(UserError, match="not a file in it"):
        attnlab.load(tmp_path / "config.json")


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(UserError) as info:
        attnlab.load(tmp_path)
    assert "'t5' is not supported" in one_line(info)
    for supported in ("gpt2", "gpt_neox", "llama", "qwen2", "qwen3", "mistral", "bert"):
        assert supported in str(info.value)


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_safetensors_names_the_file(tmp_path, cut):
    write_gpt2(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(
        UserError, match="model.safetensors: not a readable safetensors file"
    ) as info:
        attnlab.load(tmp_path)
    assert "truncated or corrupt" in one_line(info)


def test_garbage_safetensors_names_the_file(tmp_path):
    write_gpt2(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(UserError, match="model.safetensors: not a readable safetensors file"):
        attnlab.load(tmp_path)


def test_config_that_disagrees_with_the_weights_names_key_and_shapes(tmp_path):
    write_gpt2(tmp_path, config={**GPT2_CONFIG, "n_embd": 16, "n_head": 2})
    with pytest.raises(UserError) as info:
        attnlab.load(tmp_path)
    message = one_line(info)
    assert "'transformer.wte.weight'" in message and "(13, 12)" in message and "(13, 16)" in message
    assert "config does not match the weights" in message


def test_config_with_more_layers_than_the_weights_names_the_missing_key(tmp_path):
    write_gpt2(tmp_path, config={**GPT2_CONFIG, "n_layer": 2})
    with pytest.raises(
        UserError, match=r"missing weight 'h\.1\.ln_1\.weight' \(and 11 more\)"
    ) as info:
        attnlab.load(tmp_path)
    one_line(info)


def test_missing_key_is_named(tmp_path):
    write_gpt2(tmp_path, drop=["transformer.h.0.attn.c_proj.bias"])
    with pytest.raises(UserError, match=r"missing weight 'h\.0\.attn\.c_proj\.bias'"):
        attnlab.load(tmp_path)


def test_unknown_key_is_named(tmp_path):
    write_gpt2(tmp_path, add={"transformer.h.0.attn.rel_bias": torch.zeros(3)})
    with pytest.raises(
        UserError, match=r"unknown weight 'transformer\.h\.0\.attn\.rel_bias'"
    ) as info:
        attnlab.load(tmp_path)
    one_line(info)


def test_known_non_weights_are_skipped(tmp_path):
    """The causal-mask buffers old GPT-2 files carry are not weights and not an error."""
    write_gpt2(
        tmp_path,
        add={"h.0.attn.bias": torch.ones(1, 1, 8, 8), "h.0.attn.masked_bias": torch.tensor(-1e4)},
    )
    assert attnlab.load(tmp_path).config.d_model == 12


def test_tokenizer_bigger_than_the_vocabulary(tmp_path):
    write_gpt2(tmp_path)
    Tokenizer.train_char("abcdefghijklmnopqrstuvwxyz").save(tmp_path / "tokenizer.json")
    with pytest.raises(
        UserError, match="the tokenizer has 26 tokens but the model's vocabulary is 13"
    ) as info:
        attnlab.load(tmp_path)
    assert "tokenizer.json" in one_line(info)


def test_pickled_checkpoints_are_refused_not_unpickled(tmp_path):
    write_gpt2(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"this would be a pickle; it must never be opened")
    with pytest.raises(UserError, match="never unpickles") as info:
        attnlab.load(tmp_path)
    one_line(info)


def test_no_weights_at_all(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    with pytest.raises(UserError, match="no model.safetensors"):
        attnlab.load(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    write_gpt2(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "wte.weight": "model-00001-of-00002.safetensors",
            "wpe.weight": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        UserError, match="lists shard 'model-00002-of-00002.safetensors', which is missing"
    ):
        attnlab.load(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(UserError, match="not a valid safetensors index"):
        attnlab.load(tmp_path)


@pytest.mark.parametrize(
    "config, expected",
    [
        ({**GPT2_CONFIG, "n_embd": "twelve"}, "'n_embd' must be a positive integer"),
        ({"model_type": "gpt2", "vocab_size": 13}, "missing 'n_positions'"),
        ({**GPT2_CONFIG, "activation_function": "swish"}, "activation 'swish' is not supported"),
        (
            {**GPT2_CONFIG, "scale_attn_by_inverse_layer_idx": True},
            "scale_attn_by_inverse_layer_idx",
        ),
        (
            {
                "model_type": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": 8,
                "rope_parameters": {"rope_type": "yarn", "factor": 8.0},
            },
            "rope_type 'yarn' is not supported; attnlab implements default, linear, llama3",
        ),
        (
            {
                "model_type": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": 8,
                "rope_parameters": {"rope_type": "llama3", "factor": 8.0},
            },
            "rope_type 'llama3' needs a number 'low_freq_factor'",
        ),
        (
            {
                "model_type": "gpt_neox",
                "vocab_size": 10,
                "hidden_size": 24,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": 8,
                "rotary_pct": 0.25,
            },
            "rotates 3 dims; RoPE needs a positive, even",
        ),
        (
            {
                "model_type": "qwen2",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "max_position_embeddings": 8,
                "sliding_window": 4,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            "sliding-window attention on some layers only",
        ),
        (
            {
                "model_type": "mistral",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": 8,
                "sliding_window": 0,
            },
            "'sliding_window' must be a positive",
        ),
        (
            {
                "model_type": "bert",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": 8,
                "position_embedding_type": "relative_key",
            },
            "position_embedding_type 'relative_key'",
        ),
    ],
)
def test_config_values_attnlab_cannot_read_are_named(tmp_path, config, expected):
    write_gpt2(tmp_path, config=config)
    with pytest.raises(UserError, match=expected) as info:
        attnlab.load(tmp_path)
    assert "config.json" in one_line(info)


def test_unknown_save_format(tmp_path):
    model = attnlab.Transformer(
        attnlab.ModelConfig(d_vocab=5, n_layers=1, n_heads=1, d_model=4, n_ctx=4)
    )
    with pytest.raises(UserError, match="choose one of attnlab, hf"):
        attnlab.save(model, tmp_path, format="onnx")


def test_compare_command_reports_a_bad_directory_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    assert main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab compare: error:") and "is not supported" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_compare_without_transformers_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    write_gpt2(tmp_path)
    # makes `import transformers` raise ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        "transformers is not installed" in err
        and "pip install transformers" in err
        and err.count("\n") == 1
    )


def test_compare_command_exits_1_when_the_numbers_differ(tmp_path, capsys, monkeypatch):
    from attnlab.formats import compare as compare_module

    bad = compare_module.Comparison(
        tokens=3, embed=0.0, resid=[0.1], pattern=[0.2], output=1.0, output_scale=2.0
    )
    monkeypatch.setattr(compare_module, "compare", lambda path, text=None, revision=None: bad)
    assert main(["compare", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "2.000e-01" in out


def test_compare_input_of_a_character_model_without_the_default_text(tmp_path):
    from attnlab.formats.compare import sample_ids

    model = attnlab.Transformer(
        attnlab.ModelConfig(d_vocab=6, n_layers=1, n_heads=1, d_model=4, n_ctx=8)
    )
    model.tokenizer = Tokenizer.train_char("abc de")  # lacks the 'T' of the default sentence
    ids = sample_ids(model)  # falls back to fixed ids, the same on every call
    assert ids.shape == (1, 8) and torch.equal(ids, sample_ids(model))
    assert sample_ids(model, "a bad").tolist() == [model.tokenizer.encode("a bad")]
    with pytest.raises(UserError, match="never saw: 'T'"):
        sample_ids(model, "The")  # text the user chose is still checked
