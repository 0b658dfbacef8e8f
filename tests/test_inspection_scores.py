"""Head scores on hand-built patterns with known answers, and on real models (never modifying the
cache)."""

import pytest
import torch
from styles import randomize

import attnlab
from attnlab.inspection.scores import (
    attention_to,
    copying_scores,
    duplicate_token_targets,
    first_token_targets,
    head_scores,
    induction_targets,
    pattern_scores,
    previous_token_targets,
    repeated_random_tokens,
)


def one_hot_pattern(targets: torch.Tensor) -> torch.Tensor:
    """[batch, 1, T, T] pattern putting all weight on the first target of each row (on key 0 when
    none)."""
    B, T, _ = targets.shape
    index = torch.where(
        targets.any(-1), targets.float().argmax(-1), torch.zeros(B, T, dtype=torch.long)
    )
    return torch.nn.functional.one_hot(index, T).float()[:, None]


def causal_uniform(T: int) -> torch.Tensor:
    mask = torch.ones(T, T).tril()
    return (mask / mask.sum(-1, keepdim=True))[None, None]  # [1, 1, T, T]


@pytest.fixture
def repeated() -> torch.Tensor:
    span = torch.randperm(50, generator=torch.Generator().manual_seed(0))[:10]
    return span.repeat(3)[None]  # (1, 30): ten distinct tokens, three times


def test_pure_previous_token_pattern_scores_one():
    T = 12
    pattern = torch.zeros(1, 1, T, T)
    pattern[0, 0, 0, 0] = 1.0
    pattern[0, 0, torch.arange(1, T), torch.arange(T - 1)] = 1.0
    tokens = torch.arange(T)[None]
    scores = pattern_scores(pattern, tokens)
    assert scores["previous_token"].item() == pytest.approx(1.0)
    assert scores["first_token"].item() == pytest.approx(1 / (T - 1))  # only query 1 looks at key 0


def test_uniform_pattern_scores_one_over_T():
    T = 16
    uniform = torch.full((1, 1, T, T), 1.0 / T)
    scores = pattern_scores(uniform, torch.arange(T)[None])
    assert scores["previous_token"].item() == pytest.approx(1 / T)
    assert scores["first_token"].item() == pytest.approx(1 / T)
    # causal uniform: query i spreads over i + 1 keys, so the score is the mean of 1/(i + 1), i =
    # 1..T-1
    expected = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
    assert attention_to(causal_uniform(T), previous_token_targets(T)).item() == pytest.approx(
        expected
    )


def test_attention_sink_pattern(repeated):
    T = repeated.shape[1]
    sink = torch.zeros(1, 1, T, T)
    sink[..., 0] = 1.0
    scores = pattern_scores(sink, repeated)
    assert scores["first_token"].item() == pytest.approx(1.0)
    # query 1's previous token is token 0
    assert scores["previous_token"].item() == pytest.approx(1 / (T - 1))


def test_induction_and_duplicate_patterns(repeated):
    induction = one_hot_pattern(induction_targets(repeated))
    duplicate = one_hot_pattern(duplicate_token_targets(repeated))
    s_ind, s_dup = pattern_scores(induction, repeated), pattern_scores(duplicate, repeated)
    assert s_ind["induction"].item() == pytest.approx(1.0)
    assert s_ind["duplicate_token"].item() == pytest.approx(0.0)
    assert s_dup["duplicate_token"].item() == pytest.approx(1.0)
    assert s_dup["induction"].item() == pytest.approx(0.0)
    # In a span repeated with period 10, the induction target of query i (second copy on) is i - 9.
    targets = induction_targets(repeated)[0]
    assert targets[15, 6] and targets[25, 16] and targets[25, 6] and not targets[5].any()


def test_targets_follow_the_definitions():
    tokens = torch.tensor([[7, 3, 7, 3, 9]])
    dup = duplicate_token_targets(tokens)[0]
    assert dup.nonzero().tolist() == [[2, 0], [3, 1]]
    ind = induction_targets(tokens)[0]
    # 7 at 2 -> after the earlier 7 (pos 0) is pos 1
    assert ind.nonzero().tolist() == [[2, 1], [3, 2]]
    assert first_token_targets(3).nonzero().tolist() == [[1, 0], [2, 0]]


def test_several_heads_and_batches_are_scored_separately(repeated):
    prev = torch.zeros(1, 1, 30, 30)
    prev[0, 0, torch.arange(1, 30), torch.arange(29)] = 1.0
    prev[0, 0, 0, 0] = 1.0
    pattern = torch.cat([prev, one_hot_pattern(induction_targets(repeated))], dim=1).repeat(
        2, 1, 1, 1
    )
    scores = pattern_scores(pattern, repeated.repeat(2, 1))
    # query 1 of the induction head sits on key 0
    assert scores["previous_token"].tolist() == pytest.approx([1.0, 1 / 29], abs=1e-6)
    assert scores["induction"].tolist() == pytest.approx([0.0, 1.0], abs=1e-6)


def test_copying_score_of_a_hand_built_copying_head():
    """W_E = I, W_U = I, W_V W_O = +I (copy) or -I (anti-copy): scores +1 and -1."""
    cfg = attnlab.ModelConfig(
        d_vocab=8,
        n_ctx=8,
        d_model=8,
        n_layers=1,
        n_heads=2,
        d_head=4,
        attn_only=True,
        final_norm=False,
        tie_embeddings=False,
        bias=False,
    )
    model = attnlab.Transformer(cfg)
    with torch.no_grad():
        model.embed.weight.copy_(torch.eye(8))
        model.unembed.weight.copy_(torch.eye(8))
        model.blocks[0].attn.W_V.weight.copy_(torch.eye(8))  # head h reads dims 4h..4h+3
        W_O = torch.zeros(8, 8)
        W_O[:4, :4] = torch.eye(4)
        W_O[4:, 4:] = -torch.eye(4)
        model.blocks[0].attn.W_O.weight.copy_(W_O)
    assert copying_scores(model)[0].tolist() == pytest.approx([1.0, -1.0])


def test_copying_scores_are_the_eigenvalues_of_the_whole_ov_circuit():
    """The score from each head's [d_head, d_head] product equals Σλ/Σ|λ| of the literal
    [d_vocab, d_vocab] circuit W_E diag(ln1) W_V,h W_O,h diag(ln_final) W_U (same nonzero
    eigenvalues), on a grouped-query model with norm gains."""
    cfg = attnlab.preset(
        "llama-tiny", d_vocab=40, n_layers=2, n_heads=4, n_kv_heads=2, d_model=24, d_mlp=32
    )
    model = attnlab.Transformer(cfg).eval()
    randomize(model, 0.5)
    scores = copying_scores(model)
    D = cfg.d_head
    for layer, block in enumerate(model.blocks):
        for h in range(cfg.n_heads):
            kv = h // (cfg.n_heads // cfg.n_kv_heads)
            W_V = block.attn.W_V.weight.double()[kv * D : (kv + 1) * D].T  # [d_model, D]
            W_O = block.attn.W_O.weight.double()[:, h * D : (h + 1) * D].T  # [D, d_model]
            circuit = (
                model.embed.weight.double()
                @ torch.diag(block.ln1.weight.double())
                @ W_V
                @ W_O
                @ torch.diag(model.ln_final.weight.double())
                @ model.unembed.weight.double().T
            )
            eig = torch.linalg.eigvals(circuit.detach())
            expected = float(eig.sum().real / eig.abs().sum())
            assert float(scores[layer, h]) == pytest.approx(expected, abs=1e-5), (layer, h)


def test_encoder_has_no_copying_score():
    model = attnlab.Transformer(
        attnlab.preset(
            "bert-mini", d_vocab=100, n_layers=1, n_heads=2, d_model=16, d_mlp=32, n_ctx=32
        )
    )
    assert copying_scores(model) is None
    scores = head_scores(model)
    assert torch.isnan(scores.scores["copying"]).all()
    assert "n/a" in scores.notes["copying"]


@pytest.fixture(scope="module")
def q8_llama(tmp_path_factory):
    """A tiny llama GGUF file, Q8_0 matrices and embedding (tied LM head): 300 tokens of 64."""
    from gguf_files import Q, write_model

    path = tmp_path_factory.mktemp("copying") / "tiny-q8.gguf"
    return write_model(path, "llama", matrix=Q.Q8_0, embedding=Q.Q8_0, d_model=64, d_mlp=128)


@pytest.mark.parametrize("interleaved", [False, True])
def test_weight_rows_are_the_dequantized_rows_in_either_layout(interleaved):
    from attnlab.generate import kernels
    from attnlab.quant.blocks import BlockEmbedding, BlockLinear, weight_rows

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    layer = BlockLinear.from_float(w, "q8_0")
    whole = layer.dequantized()
    embedding = BlockEmbedding(layer.blocks.clone(), "q8_0", 64)
    if interleaved:  # the decode step's 16-row layout: rows 5..36 cross three groups of 16
        layer.blocks, layer.interleaved = kernels.repack16(layer.blocks, 0, 64), True
    assert torch.equal(weight_rows(layer, 5, 37), whole[5:37])
    assert torch.equal(weight_rows(embedding, 5, 37), whole[5:37])
    linear = torch.nn.Linear(64, 48, bias=False)
    assert torch.equal(weight_rows(linear, 5, 37), linear.weight[5:37].detach())


def test_copying_scores_of_kept_blocks_take_the_vocabulary_a_slice_at_a_time(
    q8_llama, monkeypatch, dequantized_rows
):
    """On a GGUF model that keeps its blocks, the copying score never dequantizes the whole
    embedding or LM head (300 rows here): at most COPYING_SLICE weights of them at a time; and it
    equals the score of the same file dequantized to float32."""
    from attnlab.inspection import scores as scores_module

    float_model = attnlab.load(q8_llama, keep_blocks=False)
    kept = attnlab.load(q8_llama, keep_blocks=True)
    monkeypatch.setattr(scores_module, "COPYING_SLICE", 64 * 64)  # 64 rows of d_model 64
    dequantized_rows.clear()  # (loading dequantized the float model's copy)
    rows = dequantized_rows
    ours = copying_scores(kept)
    assert rows and max(rows) <= 64, max(rows)  # the widest matrix of a layer has 64 rows
    torch.testing.assert_close(ours, copying_scores(float_model), atol=1e-6, rtol=0)


def test_a_copying_score_that_does_not_fit_is_left_out_in_one_line(q8_llama, monkeypatch):
    """Where copying_bytes exceeds what the machine reports available, head_scores leaves the
    copying score out (NaN) with a warning and a note naming both figures; the attention scores
    still come."""
    from attnlab import memory
    from attnlab.inspection import scores as scores_module

    model = attnlab.load(q8_llama, keep_blocks=True)
    need = scores_module.copying_bytes(model.config)
    monkeypatch.setattr(memory, "available", lambda: (need - 1, "MemAvailable"))
    called = []
    monkeypatch.setattr(scores_module, "copying_scores", lambda m: called.append(m))
    with pytest.warns(UserWarning, match="copying score not computed: it needs .* available"):
        scores = head_scores(model, span=8, batch=1)
    assert not called
    assert torch.isnan(scores.scores["copying"]).all()
    assert "MemAvailable" in scores.notes["copying"]
    assert torch.isfinite(scores.scores["previous_token"]).all()
    monkeypatch.setattr(memory, "available", lambda: (need, "MemAvailable"))
    head_scores(model, span=8, batch=1)
    assert called


@pytest.mark.parametrize("preset", ["nano", "llama-tiny", "attn-only-2l"])
def test_head_scores_on_any_model(preset):
    torch.manual_seed(0)
    model = attnlab.Transformer(attnlab.preset(preset, d_vocab=97, n_ctx=32, d_model=32, n_heads=4))
    scores = head_scores(model, seed=3)
    for name, values in scores.scores.items():
        assert values.shape == (model.config.n_layers, 4), name
        assert torch.isfinite(values).all(), name
        if name != "copying":
            assert ((values >= 0) & (values <= 1 + 1e-6)).all(), name
    # a fresh model's heads are near-uniform: nothing stands out
    assert all(not scores.standout(name) for name in scores.scores)
    again = head_scores(model, seed=3)
    for name in scores.scores:
        # fixed seed: reproducible
        torch.testing.assert_close(scores.scores[name], again.scores[name])


def test_scores_never_modify_the_cache():
    torch.manual_seed(0)
    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=50, n_ctx=32))
    tokens = repeated_random_tokens(model, batch=2)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    before = {k: v.clone() for k, v in cache.items()}
    for layer in range(model.config.n_layers):
        pattern_scores(cache[f"blocks.{layer}.attn.hook_pattern"], tokens)
    for k in before:
        assert torch.equal(before[k], cache[k])


def test_random_tokens_skip_special_tokens_and_repeat():
    from attnlab.tokenizer import Tokenizer

    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=40, n_ctx=64))
    tokens = repeated_random_tokens(model, n_repeats=4, batch=3, seed=1)
    assert tokens.shape == (3, 64)
    assert torch.equal(tokens[:, :16], tokens[:, 16:32]) and torch.equal(
        tokens[:, :16], tokens[:, 48:]
    )
    assert all(len(set(row[:16].tolist())) == 16 for row in tokens)  # distinct within a span
    tok = Tokenizer.train_char("abcdefghij")
    tok.backend.add_special_tokens(["[X]"])
    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=tok.vocab_size, n_ctx=64))
    model.tokenizer = tok
    special = tok.backend.token_to_id("[X]")
    assert not (repeated_random_tokens(model, batch=8, span=5) == special).any()


def test_local_window_targets_the_query_and_the_keys_just_before_it():
    from attnlab.inspection.scores import local_window_targets

    targets = local_window_targets(6, window=3)
    # queries 0-2 have no target: their window would reach key 0 (the sink) or hold every key
    assert targets[:3].sum() == 0
    assert [row.nonzero().flatten().tolist() for row in targets[3:]] == [
        [1, 2, 3],
        [2, 3, 4],
        [3, 4, 5],
    ]


def test_local_window_scores_a_local_head_one_and_a_sink_zero():
    from attnlab.inspection.scores import LOCAL_WINDOW

    T = 20
    local = torch.zeros(1, 1, T, T)
    for i in range(T):  # uniform over the query and the two keys before it
        keys = list(range(max(0, i - 2), i + 1))
        local[0, 0, i, keys] = 1 / len(keys)
    sink = torch.zeros(1, 1, T, T)
    sink[0, 0, :, 0] = 1.0
    tokens = torch.arange(T)[None]
    assert pattern_scores(local, tokens)["local_window"].item() == pytest.approx(1.0)
    assert pattern_scores(sink, tokens)["local_window"].item() == 0.0
    # causal uniform: query i puts LOCAL_WINDOW / (i + 1) in its window, for i >= LOCAL_WINDOW
    expected = sum(LOCAL_WINDOW / (i + 1) for i in range(LOCAL_WINDOW, T)) / (T - LOCAL_WINDOW)
    uniform = pattern_scores(causal_uniform(T), tokens)["local_window"].item()
    assert uniform == pytest.approx(expected)


def test_scoring_layer_by_layer_equals_scoring_the_cached_patterns():
    """score_patterns scores each layer as the forward pass makes it: the same numbers as
    pattern_scores on run_with_cache's patterns."""
    from attnlab.inspection.scores import score_patterns

    torch.manual_seed(0)
    model = attnlab.Transformer(attnlab.preset("llama-tiny", d_vocab=50, n_ctx=64))
    tokens = repeated_random_tokens(model, batch=2)
    # without gradients, as score_patterns runs: the same path (the kernels' forward), the same sums
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    scores = score_patterns(model, tokens)
    for layer in range(model.config.n_layers):
        expected = pattern_scores(cache[f"blocks.{layer}.attn.hook_pattern"], tokens)
        for name, values in expected.items():
            assert torch.equal(scores[name][layer], values), (name, layer)
