"""Each architecture as a user downloads it: a random-weight transformers model of it, written to
GGUF by llama.cpp's own converter, read by attnlab, against transformers on the same model (logits
within 1e-4 relative, every attention pattern within 1e-5).

The models, the tokenizers the converter needs and the conversion are benchmarks/
gguf_architectures.py's (its CONFIGS; the benchmark adds llama.cpp's greedy text). The converter
comes from llama.cpp's sources as the pinned llama-cpp-python sdist carries them, unpacked into the
venv by `make venv-test`; without it every test here skips in one line naming that step. All the
models are converted in one run of the converter (one import of torch and transformers), shared by
the tests. An architecture attnlab does not run must be refused in one line that names it and lists
the ones it runs, and that list must be true: each one listed converts and matches.

Quantized copies (benchmarks/_llama_logits.py): two of the converted files, made Q8_0 by llama.cpp's
llama-quantize, run by llama.cpp (its logits at every position, benchmarks/anchors/llama_logits.c
compiled against libllama) and by attnlab (dequantized, and the blocks' decode step) on the same
ids: top-1 agreement and mean KL within the benchmark's bounds (the KL's relative to the format's
own: llama.cpp's copy against its f32 file). They need a llama.cpp build: its bin
folder in $ATTNLAB_LLAMA_CPP, as the benchmarks take it; without one they skip in one line saying
what to set.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
from attnlab.errors import UserError
from attnlab.formats.gguf import ARCHITECTURES
from attnlab.formats.hf import architectures

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _llama_logits as llama_logits  # noqa: E402
import gguf_architectures as harness  # noqa: E402

# where the Makefile's venv-test step unpacks it
VOCABULARIES = Path(sys.prefix) / "llama.cpp-vocabularies"
SOURCES = harness.Sources(VOCABULARIES / "converter", VOCABULARIES)

pytestmark = pytest.mark.slow
# the mixtures of experts, which tests/test_formats_moe.py converts with the same converter (smaller
# models, their routers sharpened); the benchmark runs these rows
EXPERTS = ("mixtral", "qwen2moe", "qwen3moe")
# every GGUF architecture attnlab reads, once (its first row: a second row of the same architecture,
# another tokenizer or a Mistral written as llama, is the benchmark's), and the first it refuses
# (its message is the same for all)
READ = [
    case
    for i, case in enumerate(harness.CONFIGS)
    if case.gguf_architecture in ARCHITECTURES
    and case.name not in EXPERTS
    and all(other.gguf_architecture != case.gguf_architecture for other in harness.CONFIGS[:i])
]
REFUSED = [case for case in harness.CONFIGS if case.gguf_architecture not in ARCHITECTURES][:1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{case name: (the transformers model, the converted file, the converter's error or None,
    the Hugging Face directory it came from)}."""
    if not (SOURCES.converter / "convert_hf_to_gguf.py").is_file():
        pytest.skip(
            f"llama.cpp's converter is not in {SOURCES.converter}: run `make venv-test` with PyPI "
            "reachable (it unpacks it from the llama-cpp-python sdist)"
        )
    work = tmp_path_factory.mktemp("architectures")
    prepared = {case.name: harness.prepare(case, SOURCES, work) for case in READ + REFUSED}
    failed = harness.convert(SOURCES, [(d, p) for _, d, p in prepared.values()])
    return {
        name: (reference, path, failed.get(str(directory)), directory)
        for name, (reference, directory, path) in prepared.items()
    }


@pytest.mark.parametrize("case", READ + REFUSED, ids=lambda case: case.name)
def test_converted_file_matches_transformers(case, converted):
    reference, path, failed, _ = converted[case.name]
    assert failed is None, f"llama.cpp's converter failed on {case.name}: {failed}"
    if case.gguf_architecture not in ARCHITECTURES:
        with pytest.raises(UserError) as refused:
            harness.compare_with_transformers(reference, path)
        message = str(refused.value)
        assert "\n" not in message and f"architecture {case.gguf_architecture!r}" in message
        assert ", ".join(ARCHITECTURES) in message
        return
    found = harness.compare_with_transformers(reference, path)
    found.pop("model")
    assert found["gguf_architecture"] == case.gguf_architecture
    assert found["logits_relative_error"] <= harness.LOGITS_BOUND, found
    assert found["pattern_max_error"] <= harness.PATTERN_BOUND, found


def test_the_prompt_moves_the_logits(converted):
    """The comparison can fail: the random models are far from uniform, so a wrong weight or a
    missing step shows in the logits (a changed token changes the next position's logits)."""
    reference, _, _, _ = converted[harness.CONFIGS[0].name]
    ids = harness.prompt_ids(reference.config.vocab_size)
    changed = ids.clone()
    changed[0, 5] += 1
    with torch.no_grad():
        a, b = reference(ids).logits, reference(changed).logits
    assert float((a - b)[0, 6:].abs().max() / a.abs().max()) > 100 * harness.LOGITS_BOUND


# the architectures whose Q8_0 copies are compared with llama.cpp's logits (a SentencePiece and a
# byte-level BPE vocabulary), on the text's first 64 tokens
QUANTIZED = READ[:2]


@pytest.fixture(scope="module")
def llama_cpp():
    """(the llama.cpp build in $ATTNLAB_LLAMA_CPP, the logits anchor compiled against it)."""
    try:
        build = llama_logits.find_build(None)
        return build, llama_logits.compile_anchor(build)
    except llama_logits.MissingBuild as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("case", QUANTIZED, ids=lambda case: case.name)
def test_a_quantized_copy_agrees_with_llama_cpps_logits(case, converted, llama_cpp, tmp_path):
    _, path, failed, _ = converted[case.name]
    assert failed is None, f"llama.cpp's converter failed on {case.name}: {failed}"
    f32, q8 = llama_logits.compare_formats(*llama_cpp, path, tmp_path, ("Q8_0",), tokens=64)
    assert "Q8_0" in q8["tensor_types"], q8  # llama-quantize wrote blocks
    for row in (f32, q8):
        assert "error" not in row, row
        for name in ("dequantized", "blocks"):
            if name in row:
                assert row[name]["within_bounds"], (name, row)
    # the bound's scale: the format moved llama.cpp's own logits, so a block read wrongly shows
    assert q8["format_cost"]["kl_mean"] > 1e3 * f32["dequantized"]["kl_mean"], q8


def test_where_greedy_texts_part_is_found(converted):
    """The benchmark's note on a greedy text that parts from llama-simple's: the step where it
    parts, attnlab's margin there, and no float16 flip for a token far below the top."""
    from attnlab.generate.loop import generate

    _, path, _, _ = converted[harness.CONFIGS[0].name]
    model = attnlab.load(str(path))
    prompt = torch.tensor([model.tokenizer.encode(harness.PROMPT)])
    ids = generate(model, prompt, max_new_tokens=harness.NEW_TOKENS, temperature=0)[0].tolist()
    ours, at = model.tokenizer.decode(ids), prompt.shape[1] + 3
    with torch.no_grad():
        last = int(model(torch.tensor([ids[:at]]))[0, -1].argmin())  # the least likely token
    theirs = model.tokenizer.decode(ids[:at] + [last])
    parting = harness.greedy_parting(model, ours, theirs)
    assert parting["step"] == 3 and parting["margin_float32"] > 0, parting
    assert not parting["float16_kv_gives_llama_simple"], parting
    assert harness.greedy_parting(model, ours, ours) is None


def test_agreement_is_top_1_share_and_kl_of_the_anchor_from_attnlab():
    theirs = np.log(np.array([[0.5, 0.5, 1e-9], [0.7, 0.2, 0.1]]))
    ours = np.log(np.array([[0.9, 0.1, 1e-9], [0.7, 0.2, 0.1]])) + 3.0  # a shift changes nothing
    found = llama_logits.agreement(ours, theirs)
    expected = 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1)  # KL(p || q), p llama.cpp's
    assert found["top1"] == 1.0  # argmax of a tie is the first, in both
    assert found["kl_max"] == pytest.approx(expected, rel=1e-6)
    assert found["kl_mean"] == pytest.approx(expected / 2, rel=1e-6)


def test_a_folder_without_a_llama_cpp_build_is_one_line(tmp_path):
    with pytest.raises(llama_logits.MissingBuild) as missing:
        llama_logits.find_build(tmp_path)
    message = str(missing.value)
    assert "\n" not in message and "libllama.so" in message and "--bin" in message


# the architectures read from GGUF whose Hugging Face directories attnlab does not read (Gemma's
# norms are stored as w, not 1 + w; the others have no table in attnlab.formats.hf)
HF_UNREAD = [case for case in READ if case.model_type not in architectures()]


@pytest.mark.parametrize("case", HF_UNREAD, ids=lambda case: case.name)
def test_a_hugging_face_directory_attnlab_does_not_read_is_refused_in_one_line(case, converted):
    *_, directory = converted[case.name]
    with pytest.raises(UserError) as refused:
        attnlab.load(str(directory))
    message = str(refused.value)
    assert "\n" not in message and f"model_type {case.model_type!r}" in message, message


@pytest.fixture(scope="module")
def quantized(converted, tmp_path_factory):
    """{case name: (the Q8_0 copy the converter wrote from the same directory, its error or
    None)}: every architecture read, in one more run of the converter (--outtype q8_0: the
    matrices in Q8_0 blocks, the norms float32, as a user's quantized file holds them)."""
    work = tmp_path_factory.mktemp("q8_0")
    jobs = {case.name: (converted[case.name][3], work / f"{case.name}-q8_0.gguf") for case in READ}
    failed = harness.convert(SOURCES, list(jobs.values()), outtype="q8_0")
    return {name: (out, failed.get(str(directory))) for name, (directory, out) in jobs.items()}


@pytest.mark.parametrize("case", READ, ids=lambda case: case.name)
def test_a_q8_0_copy_kept_as_blocks_gives_the_dequantized_logits(case, quantized):
    """keep_blocks=True holds the file's Q8_0 blocks (no float copy of a matrix) and its module
    path computes the logits of the same file dequantized to float32."""
    from attnlab.quant.blocks import BlockLinear

    path, failed = quantized[case.name]
    assert failed is None, f"llama.cpp's converter failed on {case.name}: {failed}"
    floats, blocks = attnlab.load(str(path)), attnlab.load(str(path), keep_blocks=True)
    kept = [m for m in blocks.modules() if isinstance(m, BlockLinear)]
    assert kept and {m.kind for m in kept} == {"q8_0"}
    assert not any(isinstance(m, torch.nn.Linear) for m in blocks.blocks.modules())
    ids = harness.prompt_ids(floats.config.d_vocab)
    with torch.no_grad():
        torch.testing.assert_close(blocks(ids), floats(ids), rtol=1e-5, atol=1e-5)
