"""Loading untrusted files cannot hurt: every damaged or hostile checkpoint is a correct load or one
line.

The named cases (absurd, zero or negative sizes, wrong dtype or shape, missing or extra tensors, NaN
and infinite weights, a safetensors header that lies about its offsets, a tokenizer.json that is not
JSON) each give one line and exit 2 on the command line. A hypothesis property then mutates real
checkpoint
files (attnlab's own, GPT-2 and LLaMA style: config values, safetensors headers, raw bytes) and
asserts that every outcome is a load or a one-line UserError, never another exception: in-process
for the bulk, through `attnlab sample` in subprocesses for a sample.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from training_tiny import load_or_one_line, one_line_error, run_cli, sample_damaged

import attnlab
from attnlab.errors import UserError
from attnlab.tokenizer import Tokenizer

SRC = Path(attnlab.__file__).resolve().parents[1]
KINDS = ("attnlab", "gpt2", "llama")


def make_checkpoint(path: Path, kind: str) -> Path:
    """A small, valid checkpoint with a character tokenizer."""
    config = attnlab.ModelConfig(
        d_vocab=16,
        n_ctx=16,
        d_model=16,
        n_layers=1,
        n_heads=2,
        **(
            {"positional": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
            if kind == "llama"
            else {"mlp": "gelu_tanh"}
            if kind == "gpt2"
            else {}
        ),
    )
    torch.manual_seed(0)
    model = attnlab.Transformer(config)
    model.tokenizer = Tokenizer.train_char("abcdefg hij")
    assert model.tokenizer.vocab_size <= config.d_vocab
    attnlab.save(model, path, format="attnlab" if kind == "attnlab" else "hf")
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {kind: make_checkpoint(root / kind, kind) for kind in KINDS}


def fresh(pristine: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    target = tmp_path / kind
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(pristine[kind], target)
    return target


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (config["model"] if "model" in config else config).update(changes)
    (path / "config.json").write_text(json.dumps(config))


def rewrite_header(file: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header through edit(header) (the data bytes stay as they
    are)."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def refused(path: Path, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        attnlab.load(path)
    message = str(info.value)
    assert "\n" not in message
    return message


# The named cases
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_absurd_sizes_fail_before_allocating(pristine, tmp_path, kind, monkeypatch):
    path = fresh(pristine, kind, tmp_path)
    edit_config(
        path,
        **(
            {"d_model": 10**9}
            if kind == "attnlab"
            else {"n_embd": 10**9}
            if kind == "gpt2"
            else {"hidden_size": 10**9}
        ),
    )
    built = []
    monkeypatch.setattr(
        attnlab.Transformer, "__init__", lambda *a, **k: built.append(1) or pytest.fail("allocated")
    )
    refused(path, "needs at least .* weights, but the weight files hold")
    assert not built


@pytest.mark.parametrize("value", [0, -1, -(10**9), 2.5, "16", None, True])
def test_zero_negative_and_non_integer_sizes(pristine, tmp_path, value):
    path = fresh(pristine, "attnlab", tmp_path)
    edit_config(path, n_layers=value)
    refused(path, "n_layers must be a positive integer")


def test_wrong_dtype_is_named(pristine, tmp_path):
    path = fresh(pristine, "attnlab", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["embed.weight"] = tensors["embed.weight"].to(torch.int32)
    save_file(tensors, path / "model.safetensors")
    refused(path, "weight 'embed.weight' has dtype torch.int32, not a floating-point type")
    hf = fresh(pristine, "llama", tmp_path)
    tensors = load_file(hf / "model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[key] = tensors[key].to(torch.int8)
    save_file(tensors, hf / "model.safetensors")
    refused(hf, f"weight '{key}' has dtype I8")


@pytest.mark.parametrize("change", ["shape", "missing", "extra"])
def test_wrong_shape_missing_and_extra_tensors_are_named(pristine, tmp_path, change):
    path = fresh(pristine, "attnlab", tmp_path)
    tensors = load_file(path / "model.safetensors")
    if change == "shape":
        tensors["embed.weight"] = tensors["embed.weight"][:-1]
    elif change == "missing":
        del tensors["embed.weight"]
    else:
        tensors["blocks.7.attn.W_Q.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    refused(
        path,
        {
            "shape": "'embed.weight' has shape",
            "missing": "missing weight 'embed.weight'",
            "extra": "unexpected weight 'blocks.7.attn.W_Q.weight'",
        }[change],
    )


@pytest.mark.parametrize("kind", ["attnlab", "gpt2"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_infinite_weights_load_with_a_warning_naming_the_tensor(
    pristine, tmp_path, kind, value
):
    path = fresh(pristine, kind, tmp_path)
    tensors = load_file(path / "model.safetensors")
    key = sorted(k for k in tensors if tensors[k].dim() == 2)[0]
    tensors[key][0, 0] = value
    save_file(tensors, path / "model.safetensors")
    with pytest.warns(UserWarning, match="holds NaN or infinite values") as record:
        attnlab.load(path)
    assert key.split(".", 1)[-1] in str(record[0].message)


@pytest.mark.parametrize("kind", ["attnlab", "llama"])
@pytest.mark.parametrize("lie", ["past_the_end", "overlap", "reversed", "huge"])
def test_a_safetensors_header_lying_about_offsets(pristine, tmp_path, kind, lie):
    path = fresh(pristine, kind, tmp_path)

    def edit(header):
        name = max(
            (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
        )
        # the last tensor of the data, so "overlap" covers another
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = {
            "past_the_end": [start, end + 4096],
            "overlap": [0, end - start],
            "reversed": [end, start],
            "huge": [start, start + 2**62],
        }[lie]

    rewrite_header(path / "model.safetensors", edit)
    refused(path, "model.safetensors: not a readable safetensors file")


def test_a_tokenizer_json_that_is_not_json(pristine, tmp_path, capsys):
    path = fresh(pristine, "attnlab", tmp_path)
    (path / "tokenizer.json").write_text("{ this is not json")
    refused(path, "tokenizer.json: not a valid tokenizer.json")
    code, err = run_cli(["sample", str(path), "--max-new-tokens", "2"], capsys)
    assert code == 2 and "not a valid tokenizer.json" in one_line_error(err)


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2]",
        '{"format": "attnlab", "model": 3}',
        '{"format": "attnlab"}',
        '{"format": "attnlab", "version": "2", "model": {}}',
        "\x00\xff",
    ],
)
def test_a_config_json_of_the_wrong_shape(pristine, tmp_path, text):
    path = fresh(pristine, "attnlab", tmp_path)
    (path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(UserError) as info:
        attnlab.load(path)
    assert "\n" not in str(info.value)


# The property: any mutation is a load or one line
# ------------------------------------------------------

JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.just({}),
)


def ways_to_mutate(target: str) -> tuple[str, ...]:
    """A JSON file: a value replaced, bytes changed, truncated. model.safetensors (no JSON
    document): its header's fields, bytes near its start, truncated."""
    return (
        ("header", "bytes", "truncate")
        if target.endswith(".safetensors")
        else ("value", "bytes", "truncate")
    )


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(KINDS))
    target = draw(
        st.sampled_from(["config.json", "model.safetensors", "model.safetensors", "tokenizer.json"])
    )
    how = draw(st.sampled_from(ways_to_mutate(target)))
    return kind, target, how, draw(st.randoms(use_true_random=False)), draw(JSON_VALUES)


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def mutate(path: Path, target: str, how: str, rng, value) -> None:
    """Change `target` in `path` as `how` says; every way changes what a reader of the file sees
    (test below)."""
    assert how in ways_to_mutate(target), (target, how)
    file = path / target
    data = bytearray(file.read_bytes())
    if how == "truncate":
        file.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif how == "bytes":  # 1-4 distinct positions, each XORed with a non-zero byte
        span = min(len(data), 8 + 400) if target.endswith(".safetensors") else len(data)
        before = content(file)
        while content(file) == before:  # again if JSON reads the same (a space become a tab)
            changed = data.copy()
            for at in rng.sample(range(span), rng.randint(1, min(4, span))):
                changed[at] ^= rng.randrange(1, 256)
            file.write_bytes(bytes(changed))
    elif how == "header":

        def edit(header):
            name = rng.choice(sorted(k for k in header if k != "__metadata__"))
            field = rng.choice(["dtype", "shape", "data_offsets"])
            new = value if rng.random() < 0.5 else None
            while new is None or _same(new, header[name][field]):  # never the value it had
                new = (
                    [rng.randint(-1, 2**40) for _ in range(rng.randint(0, 3))]
                    if field != "dtype"
                    else rng.choice(["F16", "BF16", "I64", "BOOL", "F8_E5M2", "U8", "X"])
                )
            header[name][field] = new

        rewrite_header(file, edit)
    else:  # a JSON value somewhere in the file replaced by a drawn one, never by the value it had
        document = json.loads(data)
        node = document.get("model", document) if isinstance(document, dict) else document
        keys = sorted(k for k in node if not _same(node[k], value))
        node[rng.choice(keys) if keys else "mutated"] = value
        file.write_text(json.dumps(document))


@settings(
    max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True
)
@given(case=mutations())
def test_any_mutation_of_a_real_checkpoint_loads_or_is_one_line(pristine, tmp_path, case):
    kind, target, how, rng, value = case
    path = fresh(pristine, kind, tmp_path)
    before = content(path / target)
    mutate(path, target, how, rng, value)
    # every drawn case tests something
    assert content(path / target) != before, (kind, target, how, value)
    load_or_one_line(path)


def content(file: Path):
    """What a mutation must change: a JSON file's document (a rewrite that only reformats it changes
    nothing a reader sees), a safetensors file's header document and data, any other file's
    bytes."""
    data = file.read_bytes()
    try:
        if file.suffix == ".json":
            return json.dumps(json.loads(data), sort_keys=True)
        if file.suffix == ".safetensors":
            (length,) = struct.unpack("<Q", data[:8])
            return json.dumps(json.loads(data[8 : 8 + length]), sort_keys=True), data[8 + length :]
    except (ValueError, struct.error):
        pass  # no longer parses: its bytes
    return data


# a string, null, a negative, a non-finite, a boolean
HOSTILE_VALUES = ["x", None, -1, float("nan"), True]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_every_config_setting_with_every_hostile_value_loads_or_is_one_line(
    pristine, tmp_path, kind
):
    """Exhaustive where the property above samples: each setting of config.json, each kind of bad
    value."""
    keys = sorted(
        json.loads((pristine[kind] / "config.json").read_text()).get("model", {})
        or json.loads((pristine[kind] / "config.json").read_text())
    )
    for key in keys:
        for value in HOSTILE_VALUES:
            path = fresh(pristine, kind, tmp_path)
            config = json.loads((path / "config.json").read_text())
            config.get("model", config)[key] = value
            (path / "config.json").write_text(json.dumps(config))
            try:
                load_or_one_line(path)
            except Exception as exc:
                raise AssertionError(f"{kind} config {key}={value!r}: {exc!r}") from exc


@pytest.mark.slow
def test_the_command_line_on_mutated_checkpoints_exits_0_or_2_with_one_line(pristine, tmp_path):
    import random

    rng = random.Random(0)
    env = {
        **os.environ,
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    outcomes = []
    for i in range(8):
        kind = KINDS[i % 3]
        target = ["config.json", "model.safetensors", "tokenizer.json"][i % 3 if i < 6 else 1]
        path = fresh(pristine, kind, tmp_path / str(i))
        before = content(path / target)
        mutate(path, target, ways_to_mutate(target)[i % 3], rng, [10**12, -1, "x", None][i % 4])
        assert content(path / target) != before, (i, target)
        outcomes.append(sample_damaged(path, env, "a"))
    assert 2 in outcomes
