"""The explorer's generation stream (POST /api/generate) and its atlas (POST /api/atlas), through
the API: the streamed rows are the full pattern's on the final ids, the tokens are model.generate's,
a closed connection stops the generation, and the atlas's scores are `attnlab heads`' and the text's
own."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from explorer_models import LOCAL, TEXT, small_models
from fastapi.testclient import TestClient

import attnlab
from attnlab.explorer.app import create_app
from attnlab.explorer.cli import serving
from attnlab.inspection.scores import pattern_scores


def decode(matrix) -> np.ndarray:
    """An encoded matrix (encoding.encode_matrix) as a float64 array."""
    import base64

    if "f32" in matrix:
        flat = np.frombuffer(base64.b64decode(matrix["f32"]), "<f4")
    else:
        flat = np.frombuffer(base64.b64decode(matrix["f16"]), "<f2").astype(np.float64)
        flat = flat * matrix["scale"]
    return flat.astype(np.float64).reshape(matrix["shape"])


def stream(client, **body) -> list[dict]:
    response = client.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def full_patterns(model, ids: list[int]) -> torch.Tensor:
    """The reference: every layer's pattern of one forward pass over `ids`, [layer, head, q, k]."""
    with torch.no_grad():
        _, cache = model.run_with_cache(
            torch.tensor([ids]), names_filter=lambda n: n.endswith("hook_pattern")
        )
    return torch.stack(
        [cache[f"blocks.{layer}.attn.hook_pattern"][0] for layer in range(model.config.n_layers)]
    )


@pytest.mark.parametrize("encoding, tolerance", [("f32", 1e-5), ("f16", 2e-3)])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_streamed_rows_are_the_full_pattern_of_the_final_text(
    client, models, name, encoding, tolerance
):
    model = models[name]
    lines = stream(
        client,
        model=name,
        text="The cat",
        max_new_tokens=20,
        temperature=0.8,
        seed=5,
        encoding=encoding,
    )
    start, tokens, end = lines[0], lines[1:-1], lines[-1]
    assert start["event"] == "start" and end["event"] == "end"
    assert start["decode"] == {"path": "kernels", "reason": None}  # attnlab's C decode step
    assert all(t["event"] == "token" for t in tokens) and len(tokens) == 20 == end["tokens"]
    ids = end["ids"]
    assert ids == start["prompt_ids"] + [t["id"] for t in tokens]
    reference = full_patterns(model, ids)
    L, H = model.config.n_layers, model.config.n_heads
    for t in tokens:
        rows = decode(t["rows"])  # [layer·head, key]
        assert rows.shape == (L * H, t["index"])
        expected = reference[:, :, t["index"] - 1, : t["index"]].reshape(L * H, -1).numpy()
        np.testing.assert_allclose(rows, expected, atol=tolerance, rtol=tolerance)
    # the text the pieces make is the decoded ids
    assert "".join(t["piece"] for t in tokens) + end["tail"] == end["text"]
    assert end["text"] == model.tokenizer.decode(ids[len(start["prompt_ids"]) :])


def test_a_model_the_c_step_does_not_run_streams_through_the_modules_and_says_why():
    """A hooked model takes the module path: the first line says so and why, and the rows are still
    the full pattern's."""
    model = small_models()["llama"]
    model.blocks[1].register_forward_hook(lambda module, inputs, output: None)
    with TestClient(create_app({"llama": model}), base_url=LOCAL) as c:
        lines = stream(
            c, model="llama", text="The cat", max_new_tokens=6, temperature=0.0, encoding="f32"
        )
    start, tokens = lines[0], lines[1:-1]
    assert start["decode"]["path"] == "modules" and "hook" in start["decode"]["reason"]
    reference = full_patterns(model, lines[-1]["ids"])
    L, H = model.config.n_layers, model.config.n_heads
    for t in tokens:
        expected = reference[:, :, t["index"] - 1, : t["index"]].reshape(L * H, -1).numpy()
        np.testing.assert_allclose(decode(t["rows"]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "top_k": 10, "seed": 11},
        {"top_p": 0.9, "seed": 2},
    ],
)
def test_the_stream_gives_model_generates_tokens_for_the_same_settings(client, models, settings):
    model = models["llama"]
    lines = stream(client, model="llama", text=TEXT, max_new_tokens=30, **settings)
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    expected = model.generate(
        ids,
        30,
        temperature=settings.get("temperature", 0.8),
        top_k=settings.get("top_k", 200),
        top_p=settings.get("top_p"),
        seed=settings.get("seed", 1337),
    )
    assert lines[-1]["ids"] == expected[0].tolist()


def test_each_token_carries_its_candidates_and_the_kv_cache(client, models):
    model = models["gpt"]
    lines = stream(client, model="gpt", text="The cat", max_new_tokens=5, temperature=0.0, k=7)
    start, tokens = lines[0], lines[1:-1]
    cfg = model.config
    assert start["kv_bytes_per_position"] == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_head * 4
    assert start["kv_allocated_positions"] == 64  # 7 + 5 positions, rounded up (CACHE_ROUND)
    for t in tokens:
        assert len(t["candidates"]) == 7 and t["candidates"][0]["id"] == t["id"]  # greedy
        probs = [c["prob"] for c in t["candidates"]]
        assert probs == sorted(probs, reverse=True) and t["prob"] == probs[0]
        assert t["kv_positions"] == t["index"]  # keys 0 … index − 1 cached when it was written
    # greedy shows the model's own softmax: its top candidate's probability from the logits
    ids = torch.tensor([lines[-1]["ids"]])
    with torch.no_grad():
        logits = model(ids)[0]
    first = tokens[0]
    p = torch.softmax(logits[first["index"] - 1].double(), -1)
    assert first["candidates"][0]["prob"] == pytest.approx(float(p.max()), rel=1e-4)


def byte_level_model_that_writes_newlines(models):
    """gpt with a byte-level BPE vocabulary whose every step's top candidate is the newline (its
    vocabulary's stand-in "Ċ"): the final norm gives one constant vector whose only logit is the
    newline's."""
    from attnlab.tokenizer import Tokenizer

    tokenizer = Tokenizer.train_bpe(["The cat sat.\n\nIt was tired." * 10], vocab_size=280)
    (newline,) = tokenizer.encode("\n")
    assert tokenizer.id_to_token(newline) == "Ċ"
    config = models["gpt"].config.replace(d_vocab=tokenizer.vocab_size, tie_embeddings=False)
    model = attnlab.Transformer(config).eval()
    with torch.no_grad():
        model.ln_final.weight.zero_()
        model.ln_final.bias.zero_()
        model.ln_final.bias[0] = 1.0
        model.unembed.weight.zero_()
        model.unembed.weight[newline, 0] = 5.0
    model.tokenizer = tokenizer
    return model, newline


def test_the_stream_labels_byte_level_tokens_and_candidates_with_their_text(models):
    """SmolLM2's newline is "Ċ" in its vocabulary: the stream labels the token and every candidate
    with the text they stand for (Tokenizer.label), so the page shows a newline as ⏎."""
    model, newline = byte_level_model_that_writes_newlines(models)
    with TestClient(create_app({"bpe": model}), base_url=LOCAL) as c:
        lines = stream(c, model="bpe", text="The cat", max_new_tokens=3, temperature=0.0, k=20)
    tokens = lines[1:-1]
    assert [t["id"] for t in tokens] == [newline] * 3
    for t in tokens:
        assert t["token"] == "\n" and t["candidates"][0]["token"] == "\n"
        assert [c["token"] for c in t["candidates"]] == [
            model.tokenizer.label(c["id"]) for c in t["candidates"]
        ]
    assert "Ċ" not in json.dumps(lines, ensure_ascii=False)


def test_the_budget_stops_at_the_context(client):
    """gpt learns 128 positions: a 120-character prompt leaves 8 tokens, whatever is asked."""
    lines = stream(client, model="gpt", text="a" * 120, max_new_tokens=50, temperature=0.0)
    assert lines[0]["budget"] == 8 and lines[-1]["tokens"] == 8


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "bert", "text": TEXT}, 409, "encoder"),
        ({"model": "gpt", "text": TEXT, "chat": True}, 409, "no chat template"),
        ({"model": "gpt", "text": "a" * 128}, 413, "no room to generate"),
        ({"model": "nope", "text": TEXT}, 404, "unknown model"),
        ({"model": "gpt", "text": TEXT, "step": 3}, 404, "no training snapshots"),
        ({"model": "gpt", "text": TEXT, "max_new_tokens": 0}, 422, "max_new_tokens"),
        ({"model": "gpt", "text": TEXT, "encoding": "json"}, 422, "encoding"),
    ],
)
def test_a_refused_generation_is_a_4xx_before_any_stream(client, body, status, words):
    response = client.post("/api/generate", json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert words in json.dumps(response.json()["detail"])


def test_chat_goes_through_the_template_and_ends_at_the_end_of_turn(models):
    model = small_models()["llama"]
    model.config.extra["chat_template"] = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    first = model.generate(
        torch.tensor([model.tokenizer.encode("<user>hi\n<assistant>")]), 4, temperature=0.0
    )[0, -2]
    model.config.extra["eos_token_id"] = int(first)  # the third new token ends the turn
    with TestClient(create_app({"llama": model}), base_url=LOCAL) as c:
        listed = c.get("/api/models").json()[0]
        assert listed["chat"] is True
        lines = stream(c, model="llama", text="hi", chat=True, max_new_tokens=50, temperature=0.0)
    start, end = lines[0], lines[-1]
    assert "".join(start["prompt_tokens"]) == "<user>hi\n<assistant>"
    assert end["reason"] == "end_of_turn" and lines[-2]["end_of_turn"] is True
    assert end["tokens"] <= 3 and int(first) not in end["ids"][len(start["prompt_ids"]) : -1]


def test_closing_the_connection_stops_the_generation_on_the_server():
    """The page's Stop button and a closed page both end the request: the server stops generating
    within a step and holds nothing."""
    model = small_models()["llama"]
    steps = []

    def slow(module, inputs, output):  # every forward pass of the model: ~20 ms
        steps.append(time.monotonic())
        time.sleep(0.02)

    model.blocks[0].register_forward_hook(slow)
    app = create_app({"llama": model}, max_tokens=2048)
    explorer = app.state.explorer
    with serving(app) as url:
        body = {"model": "llama", "text": TEXT, "max_new_tokens": 1000, "temperature": 0.0}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "api/generate", json=body) as response:
                lines = response.iter_lines()
                assert json.loads(next(lines))["event"] == "start"
                for _ in range(3):
                    assert json.loads(next(lines))["event"] == "token"
                assert len(explorer.generations) == 1
        deadline = time.monotonic() + 10
        while explorer.generations:
            assert time.monotonic() < deadline, "the generation went on after the page closed"
            time.sleep(0.02)
        ran = len(steps)
        time.sleep(0.3)
        assert len(steps) == ran < 100  # stopped, long before its 1,000 tokens
        # and the model is free: the next request is answered at once
        response = httpx.post(url + "api/run", json={"model": "llama", "text": TEXT}, timeout=30)
        assert response.status_code == 200


# The atlas ----------------------------------------------------------------------------------------


def test_the_atlas_probes_are_attnlab_heads(tmp_path, models):
    """The probes' scores are exactly what `attnlab heads MODEL --json` writes for the model."""
    from attnlab.cli import main

    attnlab.save(models["llama"], tmp_path / "llama")
    served = attnlab.load(tmp_path / "llama")
    assert main(["heads", str(tmp_path / "llama"), "--json", str(tmp_path / "heads.json")]) == 0
    written = json.loads((tmp_path / "heads.json").read_text())
    with TestClient(create_app({"llama": served}), base_url=LOCAL) as c:
        response = c.post("/api/atlas", json={"model": "llama", "text": TEXT})
    assert response.status_code == 200, response.text
    atlas = response.json()
    written.pop("model")
    assert atlas["probes"] == written
    assert set(atlas["roles"]) <= set(written["scores"]) and "local_window" in atlas["roles"]


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_the_atlas_text_scores_are_the_pattern_scores_of_the_text(client, models, name):
    model = models[name]
    text = "abcab abcab abcab"  # repeats: induction and duplicate tokens have targets
    atlas = client.post("/api/atlas", json={"model": name, "text": text}).json()
    ids = torch.tensor([model.tokenizer.encode(text)])
    patterns = full_patterns(model, ids[0].tolist())  # [layer, head, q, k]
    for layer in range(model.config.n_layers):
        expected = pattern_scores(patterns[layer][None], ids)
        for score, values in expected.items():
            got = torch.tensor(atlas["text"]["scores"][score][layer], dtype=torch.float32)
            torch.testing.assert_close(got, values, atol=2e-6, rtol=0)
    assert atlas["n_layers"] == model.config.n_layers and atlas["tokens"] == list(text)


def test_a_knocked_out_head_changes_the_texts_scores_not_the_probes(client):
    plain = client.post("/api/atlas", json={"model": "gpt", "text": TEXT}).json()
    knocked = client.post(
        "/api/atlas", json={"model": "gpt", "text": TEXT, "ablate": [[0, 1], [0, 2]]}
    ).json()
    assert knocked["probes"] == plain["probes"] and knocked["ablated"] == [[0, 1], [0, 2]]
    layer0 = lambda a: a["text"]["scores"]["previous_token"][0]  # noqa: E731
    layer1 = lambda a: a["text"]["scores"]["previous_token"][1]  # noqa: E731
    assert layer0(knocked) == layer0(plain)  # a head's own pattern does not depend on its output
    assert layer1(knocked) != layer1(plain)  # the next layer reads what is left


def test_generation_and_the_atlas_are_in_the_document(client):
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/api/generate"]["post"]
    assert "application/x-ndjson" in op["responses"]["200"]["content"]
    assert {"404", "409", "413", "422"} <= set(op["responses"])
    assert "/api/atlas" in spec["paths"]
    assert spec["components"]["schemas"]["GenerateRequest"]["properties"]["model"]["enum"] == [
        "gpt",
        "llama",
        "bert",
    ]


def test_two_pages_generating_at_once_each_get_their_own_whole_answer(models):
    """One model, two streams at once: they take turns (the work queue, the model's lock), and each
    is what model.generate gives alone."""
    app = create_app({"llama": models["llama"]})
    results = {}
    with serving(app) as url:

        def run(seed):
            body = {"model": "llama", "text": TEXT, "max_new_tokens": 15, "seed": seed}
            response = httpx.post(url + "api/generate", json=body, timeout=60)
            results[seed] = [json.loads(line) for line in response.text.splitlines()]

        threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    model = models["llama"]
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    assert sorted(results) == [1, 2]
    for seed, lines in results.items():
        expected = model.generate(ids, 15, temperature=0.8, top_k=200, seed=seed)
        assert lines[-1]["ids"] == expected[0].tolist()
