"""The explorer's JSON API through FastAPI's TestClient: numbers agree with run_with_cache; bad
input is a 4xx with a message."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
import torch
from explorer_models import LOCAL, TEXT, post
from fastapi.testclient import TestClient

from attnlab.explorer.app import create_app
from attnlab.explorer.service import MAX_CHARS

MODELS = ("gpt", "llama", "bert")


def cache_of(model, text=TEXT):
    ids = torch.tensor([model.tokenizer.encode(text)])
    with torch.no_grad():
        return model.run_with_cache(ids)


def test_models_lists_each_model_with_its_shape(client, models):
    listed = {m["name"]: m for m in client.get("/api/models").json()}
    assert set(listed) == set(MODELS)
    for name, m in listed.items():
        cfg = models[name].config
        assert (m["n_layers"], m["n_heads"], m["d_model"], m["causal"]) == (
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_model,
            cfg.causal,
        )
    assert listed["gpt"]["max_tokens"] == 128  # learned positions: capped at n_ctx
    assert listed["llama"]["max_tokens"] == 512


def test_run_returns_the_tokenizer_tokens(client, models):
    data = post(client, "/api/run", model="gpt", text=TEXT)
    assert data["tokens"] == list(TEXT)
    assert data["ids"] == models["gpt"].tokenizer.encode(TEXT)


@pytest.mark.parametrize("name", MODELS)
def test_pattern_matches_run_with_cache_and_the_equation(client, models, name):
    model = models[name]
    _, cache = cache_of(model)
    layer, head = 1, 3
    data = post(client, "/api/pattern", model=name, text=TEXT, layer=layer, head=head)
    expected = cache[f"blocks.{layer}.attn.hook_pattern"][0, head]
    pattern = torch.tensor(data["pattern"])
    torch.testing.assert_close(pattern, expected, rtol=0, atol=1e-6)
    # raw q·kᵀ, scaled, masked as the model masks, softmaxed: the model's pattern
    raw = torch.tensor(data["raw"], dtype=torch.float64)
    scores = raw * data["scale"]
    if data["causal"]:
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
        )
    torch.testing.assert_close(torch.softmax(scores, -1).float(), expected, rtol=0, atol=1e-5)
    assert data["scale"] == pytest.approx(model.config.d_head**-0.5)
    assert not torch.allclose(pattern, pattern[:, :1].expand_as(pattern))  # not a trivial pattern


def test_pattern_f32_encoding_carries_the_same_numbers(client):
    as_json = post(client, "/api/pattern", model="llama", text=TEXT, layer=0, head=2)
    as_f32 = post(client, "/api/pattern", model="llama", text=TEXT, layer=0, head=2, encoding="f32")
    for key in ("raw", "pattern"):
        m = as_f32[key]
        decoded = np.frombuffer(base64.b64decode(m["f32"]), dtype="<f4").reshape(m["shape"])
        np.testing.assert_array_equal(decoded, np.array(as_json[key], dtype=np.float32))


def test_stages_apply_the_mask_asked_for(client, models):
    T = len(TEXT)
    causal = post(client, "/api/stages", model="bert", text=TEXT, layer=0, head=0, mask="causal")
    none = post(client, "/api/stages", model="bert", text=TEXT, layer=0, head=0, mask="none")
    upper = np.triu(np.ones((T, T), dtype=bool), 1)
    softmax = np.array(causal["softmax"])
    assert np.all(softmax[upper] == 0)
    np.testing.assert_allclose(softmax.sum(-1), 1, atol=1e-5)
    # −∞ travels as null
    assert all(causal["masked"][i][j] is None for i, j in zip(*np.nonzero(upper)))
    # an encoder's own pattern is the unmasked one
    np.testing.assert_allclose(np.array(none["softmax"]), np.array(none["pattern"]), atol=1e-5)
    assert np.array(none["softmax"])[upper].min() > 0
    np.testing.assert_allclose(
        np.array(causal["scaled"]), np.array(causal["raw"]) * causal["scale"], rtol=1e-6
    )


def test_projection_is_exact_when_keys_are_two_dimensional(client):
    """With d_head = 2 the 2-D picture is the whole story: softmax(scale · q₂·k₂) is the encoder's
    pattern.

    (The keys are centred and the queries are not; the softmax ignores that shift. This checks it.)
    """
    from explorer_models import char_tokenizer

    import attnlab

    torch.manual_seed(1)
    model = attnlab.Transformer(
        attnlab.preset("bert-mini", d_vocab=96, n_layers=1, n_heads=4, d_model=8, d_mlp=16)
    ).eval()
    with torch.no_grad():
        model.blocks[0].attn.W_Q.weight.mul_(30)
        model.blocks[0].attn.W_K.weight.mul_(30)
    model.tokenizer = char_tokenizer()
    with TestClient(create_app({"tiny": model}), base_url=LOCAL) as c:
        data = post(c, "/api/projection", model="tiny", text=TEXT, layer=0, head=1)
        pattern = post(c, "/api/pattern", model="tiny", text=TEXT, layer=0, head=1)["pattern"]
    keys, queries = np.array(data["keys"]), np.array(data["queries"])
    assert keys.shape == queries.shape == (len(TEXT), 2) and np.array(data["values"]).shape == (
        len(TEXT),
        2,
    )
    assert data["keys_variance_kept"] == pytest.approx(1.0)
    scores = data["scale"] * queries @ keys.T
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, np.array(pattern), atol=1e-4)


# one text under the 32-token thumbnail size, one over
@pytest.mark.parametrize("text", [TEXT[:20], TEXT])
def test_heads_thumbnails_are_the_patterns_and_pool_long_texts(client, models, text):
    _, cache = cache_of(models["llama"], text)
    data = post(client, "/api/heads", model="llama", text=text)
    thumbs = np.array(data["thumbnails"])
    patterns = cache.stack("blocks.{}.attn.hook_pattern")[:, 0].numpy()
    T = len(text)
    if T <= 32:
        assert not data["pooled"]
        np.testing.assert_allclose(thumbs, patterns, atol=1e-4)
    else:
        assert data["pooled"] and thumbs.shape == (2, 4, 32, 32)
        # max-pooling keeps the peaks
        np.testing.assert_allclose(thumbs.max((-1, -2)), patterns.max((-1, -2)), atol=1e-4)


def test_head_scores_come_from_inspection_when_it_exists(client, models):
    data = client.get("/api/models/gpt/head-scores").json()
    try:
        from attnlab.inspection.scores import head_scores
    except ImportError:
        assert data == {"available": False}
        return
    assert data["available"]
    expected = head_scores(models["gpt"]).to_dict()
    assert data["scores"]["previous_token"] == expected["scores"]["previous_token"]
    assert np.array(data["scores"]["induction"]).shape == (2, 4)


@pytest.mark.parametrize("name", MODELS)
def test_trace_follows_one_token_through_the_block_with_cached_values(client, models, name):
    model = models[name]
    _, cache = cache_of(model)
    layer, token = 1, 7
    data = post(client, "/api/trace", model=name, text=TEXT, layer=layer, token=token)
    stages = {s["key"]: s for s in data["stages"]}
    order = [s["key"] for s in data["stages"]]
    T, p = len(TEXT), f"blocks.{layer}."
    if model.config.norm_placement == "pre":
        assert order[:2] == ["resid_pre", "ln1"] and order[-3:] == [
            "mlp_post",
            "mlp_out",
            "resid_post",
        ]
        assert order.index("resid_mid") < order.index("ln2") < order.index("mlp_pre")
    else:  # post-norm: attention on the raw stream, the norms after each residual sum
        assert order[:2] == ["resid_pre", "q"] and order[-2:] == ["add2", "resid_post"]
        torch.testing.assert_close(
            torch.tensor(stages["add1"]["values"]),
            (cache[p + "hook_resid_pre"] + cache[p + "hook_attn_out"])[0, token],
            atol=1e-5,
            rtol=0,
        )
    assert ("rot_q" in stages) == (model.config.positional == "rope")
    for key in (
        "resid_pre",
        "q",
        "k",
        "v",
        "z",
        "attn_out",
        "resid_mid",
        "mlp_pre",
        "mlp_post",
        "mlp_out",
        "resid_post",
    ):
        stage = stages[key]
        full = cache[stage["hook"]][0]
        assert stage["shape"] == list(full.shape), key
        torch.testing.assert_close(torch.tensor(stage["values"]), full[token], atol=1e-6, rtol=0)
    assert stages["k"]["shape"] == [T, model.config.n_kv_heads, model.config.d_head]
    pattern = cache[p + "attn.hook_pattern"][0, :, token]  # [head, key_pos]
    torch.testing.assert_close(
        torch.tensor(stages["pattern"]["values"]), pattern, atol=1e-6, rtol=0
    )
    masked = stages["masked"]["values"]
    assert all(
        (v is None) == (model.config.causal and j > token)
        for row in masked
        for j, v in enumerate(row)
    )


def test_next_token_is_the_distribution_sampling_draws_from(client, models):
    model = models["gpt"]
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    with torch.no_grad():
        probs = torch.softmax(model(ids)[0, -1], -1)
    data = post(client, "/api/next", model="gpt", text=TEXT, k=5)
    top = torch.topk(probs, 5)
    assert [c["id"] for c in data["candidates"]] == top.indices.tolist()
    np.testing.assert_allclose(
        [c["prob"] for c in data["candidates"]], top.values.numpy(), rtol=1e-5
    )
    assert data["candidates"][0]["text"] == TEXT + data["candidates"][0]["piece"]
    # top-k renormalises over k tokens; temperature 0 puts everything on the argmax
    top3 = post(client, "/api/next", model="gpt", text=TEXT, top_k=3, k=5)
    assert top3["kept"] == 3 and sum(c["prob"] for c in top3["candidates"]) == pytest.approx(
        1, abs=1e-5
    )
    assert sum(c["prob"] > 0 for c in top3["candidates"]) == 3
    greedy = post(client, "/api/next", model="gpt", text=TEXT, temperature=0)
    assert greedy["candidates"][0]["prob"] == 1 and greedy["candidates"][0]["id"] == int(
        probs.argmax()
    )
    nucleus = post(client, "/api/next", model="gpt", text=TEXT, top_p=0.05)
    assert nucleus["kept"] < 95
    a = post(client, "/api/next", model="gpt", text=TEXT, top_k=3, sample=True, seed=5)
    b = post(client, "/api/next", model="gpt", text=TEXT, top_k=3, sample=True, seed=5)
    assert a["chosen"] == b["chosen"] and a["chosen"]["id"] in [
        c["id"] for c in top3["candidates"][:3]
    ]


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/api/run", {"model": "nope", "text": "hi"}, 404, ["unknown model 'nope'", "'gpt'"]),
        (
            "/api/pattern",
            {"model": "../../etc/passwd", "text": "hi", "layer": 0, "head": 0},
            404,
            ["unknown model"],
        ),
        (
            "/api/pattern",
            {"model": "gpt", "text": "hi", "layer": 9, "head": 0},
            422,
            ["layer 9", "2 layers"],
        ),
        (
            "/api/pattern",
            {"model": "gpt", "text": "hi", "layer": 0, "head": 4},
            422,
            ["head 4", "4 heads"],
        ),
        (
            "/api/pattern",
            {"model": "gpt", "text": "hi", "layer": 0, "head": -1},
            422,
            ["head", "greater than or equal to 0"],
        ),
        (
            "/api/trace",
            {"model": "gpt", "text": "hi", "layer": 0, "token": 2},
            404,
            ["token index 2", "2 tokens"],
        ),
        (
            "/api/stages",
            {"model": "gpt", "text": "hi", "layer": 0, "head": 0, "mask": "diagonal"},
            422,
            ["mask"],
        ),
        (
            "/api/run",
            {"model": "gpt", "text": "x" * 129},
            413,
            ["129 tokens", "limit", "128 tokens"],
        ),
        ("/api/run", {"model": "llama", "text": "x" * 513}, 413, ["513 tokens", "512 tokens"]),
        (
            "/api/run",
            {"model": "gpt", "text": "x" * (MAX_CHARS + 1)},
            422,
            [str(MAX_CHARS), "characters"],
        ),
        ("/api/run", {"model": "gpt", "text": "é"}, 422, ["never saw", "'é'"]),
        ("/api/run", {"model": "gpt", "text": ""}, 422, ["text", "at least 1 character"]),
        ("/api/next", {"model": "bert", "text": "hi"}, 409, ["encoder", "next token"]),
        ("/api/next", {"model": "gpt", "text": "hi", "top_p": 0}, 422, ["top_p", "greater than 0"]),
        # strict types (schemathesis found the first): a boolean or a string is not a number
        (
            "/api/pattern",
            {"model": "gpt", "text": "hi", "layer": 0, "head": False},
            422,
            ["head", "valid integer"],
        ),
        (
            "/api/trace",
            {"model": "gpt", "text": "hi", "layer": "1", "token": 0},
            422,
            ["layer", "valid integer"],
        ),
        (
            "/api/next",
            {"model": "gpt", "text": "hi", "sample": "yes"},
            422,
            ["sample", "valid boolean"],
        ),
        (
            "/api/pattern",
            {"model": "gpt", "text": "hi", "layer": 0, "head": 0, "ablate": [[True, 1]]},
            422,
            ["ablate", "valid integer"],
        ),
    ],
)
def test_bad_requests_get_a_4xx_with_a_message(client, path, body, status, words):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    text = (
        detail
        if isinstance(detail, str)
        else " ".join(f"{'.'.join(map(str, d['loc']))} {d['msg']}" for d in detail)
    )
    for word in words:
        assert word in text, (word, text)


def test_sixteen_concurrent_clients_all_get_their_own_answers(client, models):
    jobs = [
        (name, layer, head, TEXT[: 20 + i])
        for i, (name, layer, head) in enumerate(
            (n, l, h) for n in MODELS for l in range(2) for h in range(4)
        )
    ][:16]
    expected = {}
    for name, layer, head, text in jobs:
        _, cache = cache_of(models[name], text)
        expected[(name, layer, head, text)] = cache[f"blocks.{layer}.attn.hook_pattern"][0, head]
    results, errors = {}, []
    barrier = threading.Barrier(len(jobs))

    def ask(job):
        name, layer, head, text = job
        try:
            barrier.wait()
            response = client.post(
                "/api/pattern", json={"model": name, "text": text, "layer": layer, "head": head}
            )
            results[job] = (response.status_code, response.json())
        except Exception as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 16
    for job, (status, data) in results.items():
        assert status == 200
        torch.testing.assert_close(torch.tensor(data["pattern"]), expected[job], atol=1e-6, rtol=0)


def test_docs_page_is_offline_and_lists_the_api(client):
    page = client.get("/docs")
    assert page.status_code == 200
    assert "/api/run" in page.text and "http" not in page.text.replace("/openapi.json", "")


def test_openapi_documents_every_route(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/api/models",
        "/api/run",
        "/api/pattern",
        "/api/stages",
        "/api/projection",
        "/api/heads",
        "/api/trace",
        "/api/next",
        "/api/models/{name}/head-scores",
    ):
        assert path in paths
    assert "413" in paths["/api/run"]["post"]["responses"]


def test_page_and_static_files_are_served_and_nothing_else(client):
    page = client.get("/")
    assert page.status_code == 200 and "attnlab explorer" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/static/app.js").status_code == 200
    for probe in ("/static/../service.py", "/static/%2e%2e/service.py", "/static/..%2fservice.py"):
        response = client.get(probe)
        assert response.status_code == 404 and "def " not in response.text


def test_a_model_without_tokenizer_is_a_clear_error(models):
    import attnlab

    bare = attnlab.Transformer(models["gpt"].config).eval()
    with TestClient(create_app({"bare": bare}), base_url=LOCAL) as c:
        response = c.post("/api/run", json={"model": "bare", "text": "hi"})
    assert response.status_code == 422 and "no tokenizer" in response.json()["detail"]


def test_byte_level_tokens_arrive_as_the_text_they_read_as(models):
    """A byte-level BPE model's tokens are labelled with their text (" cat", "\n"), not the
    vocabulary's stand-ins ("Ġcat", "Ċ"), in /api/run and in the generation stream's tokens."""
    import attnlab
    from attnlab.tokenizer import Tokenizer

    text = "The cat sat.\n\nIt was tired."
    tokenizer = Tokenizer.train_bpe([text * 10], vocab_size=280)
    model = attnlab.Transformer(models["gpt"].config.replace(d_vocab=tokenizer.vocab_size)).eval()
    model.tokenizer = tokenizer
    with TestClient(create_app({"bpe": model}), base_url=LOCAL) as c:
        tokens = post(c, "/api/run", model="bpe", text=text)["tokens"]
    assert "".join(tokens) == text and len(tokens) == len(tokenizer.encode(text))


def test_trace_of_a_parallel_block_has_no_resid_mid_and_sums_both_branches():
    """Pythia-style blocks: the MLP reads resid_pre, and resid_post = x + attn_out + mlp_out."""
    from explorer_models import char_tokenizer

    import attnlab

    tok = char_tokenizer()
    torch.manual_seed(2)
    model = attnlab.Transformer(
        attnlab.ModelConfig(
            d_vocab=tok.vocab_size,
            n_layers=2,
            n_heads=2,
            d_model=32,
            n_ctx=64,
            positional="rope",
            rotary_fraction=0.25,
            parallel_residual=True,
        )
    ).eval()
    model.tokenizer = tok
    with TestClient(create_app({"pythia": model}), base_url=LOCAL) as client:
        data = post(client, "/api/trace", model="pythia", text=TEXT, layer=1, token=5)
    stages = {s["key"]: s for s in data["stages"]}
    assert "resid_mid" not in stages and "parallel" in stages["ln2"]["equation"]
    _, cache = cache_of(model)
    torch.testing.assert_close(
        torch.tensor(stages["ln2"]["values"]),
        model.blocks[1].ln2(cache["blocks.1.hook_resid_pre"])[0, 5],
        atol=1e-6,
        rtol=0,
    )
    resid_post = (
        cache["blocks.1.hook_resid_pre"]
        + cache["blocks.1.hook_attn_out"]
        + cache["blocks.1.hook_mlp_out"]
    )
    torch.testing.assert_close(
        torch.tensor(stages["resid_post"]["values"]), resid_post[0, 5], atol=1e-5, rtol=0
    )


def test_a_sliding_window_model_shows_its_band_in_the_pattern_and_the_stages():
    """Mistral-style window of 4 on a 44-token text: the pattern is a band, and the stages' causal
    mask is that band."""
    from explorer_models import char_tokenizer

    import attnlab

    tok = char_tokenizer()
    torch.manual_seed(3)
    model = attnlab.Transformer(
        attnlab.ModelConfig(
            d_vocab=tok.vocab_size,
            n_layers=1,
            n_heads=2,
            d_model=32,
            n_ctx=64,
            positional="rope",
            norm="rmsnorm",
            sliding_window=4,
        )
    ).eval()
    model.tokenizer = tok
    T = len(TEXT)
    band = np.tril(np.ones((T, T), dtype=bool)) & ~np.tril(np.ones((T, T), dtype=bool), -4)
    with TestClient(create_app({"mistral": model}), base_url=LOCAL) as client:
        assert client.get("/api/models").json()[0]["sliding_window"] == 4
        data = post(client, "/api/pattern", model="mistral", text=TEXT, layer=0, head=1)
        stages = post(
            client, "/api/stages", model="mistral", text=TEXT, layer=0, head=1, mask="causal"
        )
    pattern = np.array(data["pattern"])
    assert data["sliding_window"] == 4
    assert np.all(pattern[~band] == 0) and np.all(pattern[band] > 0)
    np.testing.assert_allclose(pattern.sum(-1), 1, atol=1e-5)
    np.testing.assert_allclose(np.array(stages["softmax"]), pattern, atol=1e-5)
    assert all(
        (v is None) == (not band[i, j])
        for i, row in enumerate(stages["masked"])
        for j, v in enumerate(row)
    )


def test_an_integer_is_json_schemas_any_number_without_a_fraction(client):
    """1.0 is the integer 1 (the document says "integer", which JSON Schema defines so); 1.5 and
    false are not."""
    as_floats = post(
        client, "/api/pattern", model="gpt", text="hi", layer=1.0, head=2.0, ablate=[[0.0, 1.0]]
    )
    as_ints = post(client, "/api/pattern", model="gpt", text="hi", layer=1, head=2, ablate=[[0, 1]])
    # a timing: differs
    assert as_floats.pop("cost")["server_ms"] >= 0 and as_ints.pop("cost")["server_ms"] >= 0
    assert as_floats == as_ints and as_floats["layer"] == 1
    for bad in (1.5, False, "1"):
        response = client.post(
            "/api/pattern", json={"model": "gpt", "text": "hi", "layer": bad, "head": 0}
        )
        assert response.status_code == 422 and "layer" in response.text, (bad, response.text)
