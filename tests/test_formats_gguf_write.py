"""attnlab.save(model, "x.gguf", dtype=...) (attnlab.formats.gguf_write) against its peers: ggml's
own gguf package reads the file back (tensors, Q8_0 blocks equal to its own quantize), attnlab's
reader gives the same model back (exactly in f32), transformers' GGUF reader computes the same
logits; the tokenizers come back with the same ids; what llama.cpp cannot run is one line. The run
in llama.cpp itself is benchmarks/gguf_write_llama_cpp.py (it needs a llama.cpp build)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from styles import fields
from training_tiny import one_line_error, run_cli, tiny_config

import attnlab
import attnlab.formats.gguf_write as gguf_write
from attnlab.errors import UserError
from attnlab.formats.compare import compare, load_transformers
from attnlab.formats.gguf_write import Blocks
from attnlab.model.config import ModelConfig
from attnlab.tokenizer import Tokenizer

TEXT = "The cat sat on the mat.\nIt was tired, so it slept: 42 naps!\n\tDone \\ é ü 猫"

# One model per llama.cpp architecture attnlab writes, each a style of tests/styles.py (at sizes
# transformers' GGUF reader can take: it assumes head_dim 128 for qwen3, and 4 x d_model and a
# context of 1024 for gpt2).
CONFIGS = {
    "llama": fields("llama-gqa", n_heads=4, d_mlp=96, rope_theta=50000.0),
    "llama-tied-linear-rope": fields(
        "llama-gqa",
        n_heads=4,
        n_kv_heads=1,
        tie_embeddings=True,
        rope_scaling="linear",
        rope_scaling_factor=2.0,
    ),
    "qwen2": fields("llama-gqa", qkv_bias=True, n_heads=4),
    "qwen3": fields(
        "llama-gqa", qk_norm=True, n_heads=2, n_kv_heads=1, d_head=128, tie_embeddings=True
    ),
    "gpt2": fields("gpt2", n_heads=4, n_ctx=1024, tie_embeddings=False),
}
GGUF_ARCHITECTURE = {"llama-tied-linear-rope": "llama"}


def random_model(name: str, tokenizer: Tokenizer | None = None, seed: int = 0, **changes):
    """A model of CONFIGS[name] with random weights of a trained model's size (norm weights near 1,
    biases nonzero), and `tokenizer` (default: characters of TEXT)."""
    tokenizer = tokenizer or Tokenizer.train_char(TEXT)
    settings = dict(d_vocab=tokenizer.vocab_size, d_model=64, n_layers=2, n_ctx=128)
    settings.update(CONFIGS[name])
    settings.update(changes)
    torch.manual_seed(seed)
    model = attnlab.Transformer(ModelConfig(**settings)).eval().requires_grad_(False)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            is_norm = param.dim() == 1 and not param_name.endswith(".bias")
            param.copy_(is_norm + 0.1 * torch.randn_like(param))
    model.tokenizer = tokenizer
    return model


def assert_same_state(ours, theirs) -> None:
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", CONFIGS)
def test_f32_round_trip_is_exact_and_gguf_py_reads_it(name, tmp_path):
    model = random_model(name)
    path = attnlab.save(model, tmp_path / "m.gguf")
    back = attnlab.load(path)
    assert back.config.extra["gguf_architecture"] == GGUF_ARCHITECTURE.get(name, name)
    assert_same_state(model, back)
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    torch.testing.assert_close(back(ids), model(ids), rtol=0, atol=0)
    assert back.tokenizer.encode(TEXT) == model.tokenizer.encode(TEXT)
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) == (not model.config.tie_embeddings)
    assert ("blk.1.attn_qkv.weight" in names) == (name == "gpt2")  # gpt2's q, k, v are one tensor
    for tensor in reader.tensors:
        assert GGMLQuantizationType(tensor.tensor_type).name == "F32", tensor.name
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    np.testing.assert_array_equal(
        np.asarray(embed.data).reshape(model.config.d_vocab, -1), model.embed.weight.numpy()
    )


def transformers_logits(path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_transformers(path, causal=True)(ids).logits


# transformers' GGUF reader does not read rope.scaling.* (llama.cpp and attnlab's reader do)
@pytest.mark.parametrize("name", [name for name in CONFIGS if "linear-rope" not in name])
def test_transformers_gguf_reader_computes_the_models_logits(name, tmp_path):
    """f32: transformers on the file = attnlab's model that was written; q8_0: transformers and
    attnlab on the same file, layer by layer (attnlab.formats.compare)."""
    model = random_model(name)
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    expected = model(ids)
    theirs = transformers_logits(attnlab.save(model, tmp_path / "f32.gguf"), ids)
    assert (theirs - expected).abs().max() <= 1e-4 * expected.abs().max()
    result = compare(attnlab.save(model, tmp_path / "q8_0.gguf", dtype="q8_0"), ids=ids)
    assert result.output <= 1e-4 * result.output_scale, result
    assert max(result.pattern) <= 1e-5, result


def test_q_and_k_rows_are_permuted_for_llama_cpps_rope(tmp_path):
    """Written without the converter's permutation, the file computes something else in
    transformers' reader (which un-permutes llama's q and k itself) and in attnlab's: the
    permutation is what makes a llama file right."""
    model = random_model("llama")
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    expected = model(ids)
    original = gguf_write.permute_rows
    try:
        gguf_write.permute_rows = lambda rows, heads: np.arange(rows)
        path = attnlab.save(model, tmp_path / "unpermuted.gguf")
    finally:
        gguf_write.permute_rows = original
    assert (transformers_logits(path, ids) - expected).abs().max() > 1e-2
    assert (attnlab.load(path)(ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_q8_0_blocks_are_gguf_pys_own_and_read_back_as_their_values(name, tmp_path):
    model = random_model(name)
    path = attnlab.save(model, tmp_path / "m.gguf", dtype="q8_0")
    reader = {t.name: t for t in GGUFReader(path).tensors}
    embed = reader["token_embd.weight"]
    assert GGMLQuantizationType(embed.tensor_type).name == "Q8_0"
    np.testing.assert_array_equal(
        np.asarray(embed.data).reshape(-1),
        quantize(model.embed.weight.numpy(), GGMLQuantizationType.Q8_0).reshape(-1),
    )
    back = attnlab.load(path)
    state = back.state_dict()
    for param_name, param in model.state_dict().items():
        if param.dim() == 2 and param_name != "pos_embed.weight":
            expected = dequantize(
                quantize(param.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
            )
            np.testing.assert_array_equal(state[param_name].numpy(), expected, err_msg=param_name)
        else:  # norms, biases, positions: F32, exact
            torch.testing.assert_close(state[param_name], param, rtol=0, atol=0)


def test_f16_holds_each_value_rounded_to_half(tmp_path):
    model = random_model("llama")
    back = attnlab.load(attnlab.save(model, tmp_path / "m.gguf", dtype="f16"))
    for param_name, param in model.state_dict().items():
        expected = param.half().float() if param.dim() == 2 else param
        torch.testing.assert_close(back.state_dict()[param_name], expected, rtol=0, atol=0)


def test_rows_that_do_not_fit_q8_0_blocks_are_f16_with_a_warning(tmp_path):
    model = random_model("llama", d_model=48, d_mlp=80)  # rows of 48 and 80: not whole blocks
    with pytest.warns(UserWarning, match="written as F16"):
        path = attnlab.save(model, tmp_path / "m.gguf", dtype="q8_0")
    kinds = {t.name: GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors}
    assert kinds["blk.0.ffn_up.weight"] == "F16" and kinds["blk.0.attn_norm.weight"] == "F32"


def test_ready_made_blocks_are_written_as_they_are(tmp_path):
    """A tensor given as blocks (a quantized model's) goes into the file byte for byte, its rows
    permuted with the rest of W_Q, whatever dtype the other tensors get."""
    model = random_model("llama")
    w_q = model.blocks[0].attn.W_Q.weight.detach()
    made = quantize(w_q.numpy(), GGMLQuantizationType.Q8_0)
    blocks = {"blocks.0.attn.W_Q.weight": Blocks(made, "Q8_0", tuple(w_q.shape))}
    path = attnlab.save(model, tmp_path / "m.gguf", dtype="f32", blocks=blocks)
    reader = {t.name: t for t in GGUFReader(path).tensors}
    q = reader["blk.0.attn_q.weight"]
    assert GGMLQuantizationType(q.tensor_type).name == "Q8_0"
    order = gguf_write.permute_rows(w_q.shape[0], model.config.n_heads)
    np.testing.assert_array_equal(np.asarray(q.data).reshape(made.shape), made[order])
    back = attnlab.load(path).state_dict()
    np.testing.assert_array_equal(
        back["blocks.0.attn.W_Q.weight"].numpy(), dequantize(made, GGMLQuantizationType.Q8_0)
    )
    torch.testing.assert_close(
        back["blocks.0.attn.W_K.weight"], model.blocks[0].attn.W_K.weight, rtol=0, atol=0
    )
    with pytest.raises(UserError, match="does not hold values of shape"):
        Blocks(made[:-1], "Q8_0", tuple(w_q.shape))


# Tokenizers ---------------------------------------------------------------------------------------


def test_char_tokenizer_is_written_as_an_rwkv_vocabulary_and_read_back_as_itself(tmp_path):
    model = random_model("llama")
    path = attnlab.save(model, tmp_path / "m.gguf")
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "rwkv"
    assert "tokenizer.ggml.eos_token_id" not in fields  # rwkv: no end-of-generation token
    back = attnlab.load(path).tokenizer
    assert back.kind == "char" and back.encode(TEXT) == model.tokenizer.encode(TEXT)
    assert back.decode(back.encode(TEXT)) == TEXT


def test_byte_level_bpe_is_written_as_llama_cpps_gpt2_vocabulary(tmp_path):
    tokenizer = Tokenizer.train_bpe([TEXT * 20, "hello world 12345 hello"], 300)
    model = random_model("llama", tokenizer=tokenizer)
    path = attnlab.save(model, tmp_path / "m.gguf")
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    eos = fields["tokenizer.ggml.eos_token_id"].contents()
    assert tokenizer.id_to_token(eos) == "ÿ"  # byte 0xFF, never in UTF-8 text (gguf_write)
    back = attnlab.load(path).tokenizer
    for text in [TEXT, "  two  spaces\n\n\nand 2024 digits", "naïve café", ""]:
        assert back.encode(text) == tokenizer.encode(text), text
        assert back.decode(back.encode(text)) == text


def test_no_tokenizer_is_llama_cpps_none_and_reads_back_as_none(tmp_path):
    model = random_model("llama")
    model.tokenizer = None
    back = attnlab.load(attnlab.save(model, tmp_path / "m.gguf"))
    assert back.tokenizer is None
    assert_same_state(model, back)


def test_a_tokenizer_llama_cpp_does_not_know_is_refused(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({c: i for i, c in enumerate("abc")}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    model = random_model("llama", tokenizer=Tokenizer(backend, "hf"))
    with pytest.raises(UserError, match="not a byte-level BPE"):
        attnlab.save(model, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


# Bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(mlp="relu2", qk_norm=True, logit_softcap=30.0), ["relu2", "logit soft-cap"]),
        (dict(mlp="gelu"), ["tanh form", "--mlp gelu_tanh"]),
        (dict(sliding_window=8), ["sliding window"]),
        (dict(positional="sinusoidal"), ["positional='sinusoidal'"]),
        (dict(bias=True), ["biases on every linear layer"]),
        (dict(residual_multiplier=0.5), ["Granite's multipliers (residual_multiplier=0.5)"]),
        (dict(unembed_bias=True), ["a bias on the LM head"]),
    ],
)
def test_a_model_llama_cpp_cannot_run_is_one_line_naming_what_it_lacks(changes, words, tmp_path):
    name = "gpt2" if changes.get("mlp") == "gelu" else "llama"
    model = random_model(name, **changes)
    with pytest.raises(UserError) as info:
        attnlab.save(model, tmp_path / "m.gguf")
    message = str(info.value)
    assert "\n" not in message and "cannot write GGUF" in message
    for word in words:
        assert word in message
    assert os.listdir(tmp_path) == []


def test_the_speedrun_recipe_is_refused_on_the_command_line(tmp_path, capsys):
    from attnlab.training.config import SPEEDRUN_RECIPE

    assert SPEEDRUN_RECIPE["mlp"] == "relu2" and SPEEDRUN_RECIPE["logit_softcap"]
    model = random_model("llama", mlp="relu2", qk_norm=True, logit_softcap=30.0)
    attnlab.save(model, tmp_path / "run")
    code, err = run_cli(["convert", str(tmp_path / "run"), str(tmp_path / "m.gguf")], capsys)
    line = one_line_error(err)
    assert code == 2 and "mlp='relu2'" in line and "logit soft-cap" in line
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    "argv_tail, words",
    [
        (["OUT.gguf", "--dtype", "q4"], ["unknown GGUF dtype 'q4'", "q8_0"]),
        (["FOLDER", "--format", "gguf"], ["is a folder"]),
        (["FILE/m.gguf"], ["check the path"]),
        (["OUT.gguf", "--format", "onnx"], ["unknown format 'onnx'"]),
        (["OUT", "--format", "hf", "--dtype", "f16"], ["dtype and blocks choose"]),
    ],
)
def test_bad_convert_arguments_are_one_line(argv_tail, words, tmp_path, capsys):
    model = random_model("llama")
    attnlab.save(model, tmp_path / "run")
    (tmp_path / "FOLDER").mkdir()
    (tmp_path / "FILE").write_text("a file, not a folder")
    out = str(tmp_path / argv_tail[0])
    code, err = run_cli(["convert", str(tmp_path / "run"), out, *argv_tail[1:]], capsys)
    line = one_line_error(err)
    assert code == 2
    for word in words:
        assert word in line, line
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob("FOLDER/*"))


def test_a_crash_while_writing_leaves_the_old_file_and_no_half_file(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    model = random_model("llama")
    path = attnlab.save(model, tmp_path / "m.gguf")
    before = path.read_bytes()
    real = GGUFWriter.write_tensors_to_file

    def crash(self, *args, **kwargs):
        self.fout[0].write(b"half a tensor")
        raise KeyboardInterrupt

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", crash)
    with pytest.raises(KeyboardInterrupt):
        attnlab.save(random_model("llama", seed=1), path)
    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", real)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.gguf"]


def test_convert_writes_a_trained_run_as_q8_0(tmp_path, capsys):
    """`attnlab train` with the llama recipe, then `attnlab convert RUN out.gguf --dtype q8_0`."""
    from attnlab.training.trainer import train

    cfg = tiny_config(
        tmp_path, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_embd=32, n_kv_head=1
    )
    train(cfg)
    out = tmp_path / "out.gguf"
    code, err = run_cli(["convert", cfg.out, str(out), "--dtype", "q8_0"], capsys)
    assert code == 0, err
    trained, back = attnlab.load(cfg.out), attnlab.load(out)
    assert back.config.n_kv_heads == 1 and back.tokenizer.kind == "char"
    ids = torch.tensor([trained.tokenizer.encode("the cat sat")])
    assert back(ids).argmax(-1).tolist() == trained(ids).argmax(-1).tolist()


@pytest.mark.slow
def test_smollm2_written_back_keeps_its_tokenizer_template_and_special_tokens(tmp_path):
    """A GGUF model read and written again: the byte-level BPE with SmolLM2's pre-tokenizer (digits
    one by one), its special tokens and chat template; the ids equal llama.cpp's on the original
    file (tests/fixtures/gguf_tokens.json)."""
    import json
    from pathlib import Path

    model = attnlab.load("smollm2")
    path = attnlab.save(model, tmp_path / "smollm2.gguf", dtype="q8_0")
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert fields["tokenizer.chat_template"].contents() == model.config.extra["chat_template"]
    back = attnlab.load(path)
    fixture = json.loads((Path(__file__).parent / "fixtures" / "gguf_tokens.json").read_text())
    for case in fixture["cases"]:
        assert back.tokenizer.encode(case["text"]) == case["ids"], case["text"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert back.config.extra[key] == model.config.extra[key]
    ids = torch.tensor([model.tokenizer.encode("The capital of France is")])
    assert back(ids)[0, -1].argmax() == model(ids)[0, -1].argmax()
