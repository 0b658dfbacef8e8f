"""The whole context (POST /api/context, then /overview and /tile in binary): every pooled overview
and every tile equals the model's own attention pattern (run_with_cache's hook_pattern, attnlab's
one attention implementation) max-pooled the same way; a head switch never runs the model again;
memory stays within its budget and is reported; bad requests are one-line 4xx.

The models are the explorer tests' small random ones (a GPT with learned positions, a LLaMA with
RoPE, grouped-query attention and QK-norm, a BERT-style encoder), plus a LLaMA with a sliding
window, on texts long enough for several levels (a character tokenizer: one token a character).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from explorer_models import LOCAL, small_models
from fastapi.testclient import TestClient

import attnlab
from attnlab.explorer.app import create_app
from attnlab.explorer.context import HEADER, MAGIC, TILE, cells, levels, overview_level

TEXT = "".join(f"{i % 97} the cat sat on the mat, because it was tired. " for i in range(40))[:600]


def models() -> dict[str, attnlab.Transformer]:
    out = small_models()
    torch.manual_seed(1)
    tok = out["llama"].tokenizer
    config = attnlab.preset(
        "llama-tiny",
        d_vocab=tok.vocab_size,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        d_model=32,
        d_mlp=64,
        sliding_window=100,
    )
    window = attnlab.Transformer(config).eval()
    with torch.no_grad():
        for block in window.blocks:
            block.attn.W_Q.weight.mul_(20)
    window.tokenizer = tok
    out["window"] = window
    return out


@pytest.fixture(scope="module")
def served():
    served = models()
    with TestClient(create_app(served, max_tokens=1024), base_url=LOCAL) as client:
        yield client, served


def decode(response) -> dict:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    data = response.content
    magic, level, rows, cols, row0, col0, n, size = HEADER.unpack(data[: HEADER.size])
    assert magic == MAGIC and size in (2, 4)
    values = np.frombuffer(data[HEADER.size :], dtype="<f2" if size == 2 else "<f4")
    assert values.size == rows * cols
    return {
        "level": level,
        "row0": row0,
        "col0": col0,
        "n": n,
        "values": torch.from_numpy(values.astype(np.float32).reshape(rows, cols)),
    }


def reference(model, text: str) -> dict[int, torch.Tensor]:
    """The model's own pattern of every layer: {layer: [head, query_pos, key_pos]}."""
    ids = torch.tensor([model.tokenizer.encode(text)])
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))
    return {layer: cache[f"blocks.{layer}.attn.hook_pattern"][0] for layer in range(2)}


def pooled(pattern: torch.Tensor, level: int) -> torch.Tensor:
    f = 2**level
    return F.max_pool2d(pattern[None], f, f, ceil_mode=True)[0] if f > 1 else pattern


def open_context(client, model: str, text: str = TEXT) -> dict:
    response = client.post("/api/context", json={"model": model, "text": text})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "window"])
def test_every_overview_and_tile_is_the_models_own_pattern_max_pooled(served, name):
    client, models_ = served
    text = TEXT[:120] if name == "gpt" else TEXT  # the GPT's learned positions stop at 128
    context = open_context(client, name, text)
    T = len(text)
    assert context["n_tokens"] == T and context["tokens"] == list(text)
    assert context["levels"] == levels(T) == (1 if T <= TILE else 3)
    truth = reference(models_[name], text)
    base = f"/api/context/{context['id']}"
    for layer in range(2):
        for head in range(4):
            full = truth[layer][head]
            for size in (16, 100, T):
                level = overview_level(T, size)
                got = decode(
                    client.get(
                        f"{base}/overview",
                        params={"layer": layer, "head": head, "size": size, "dtype": "f32"},
                    )
                )
                assert got["level"] == level and got["n"] == T
                torch.testing.assert_close(got["values"], pooled(full, level), rtol=1e-5, atol=1e-6)
                half = decode(
                    client.get(
                        f"{base}/overview", params={"layer": layer, "head": head, "size": size}
                    )
                )
                # float16 on the wire: the float32 answer rounded, nothing else
                assert torch.equal(half["values"], got["values"].half().float())
            for level in range(context["levels"]):
                whole = pooled(full, level)
                n = -(-cells(T, level) // TILE)
                for row in range(n):
                    for col in range(n):
                        got = decode(
                            client.get(
                                f"{base}/tile",
                                params={
                                    "layer": layer,
                                    "head": head,
                                    "level": level,
                                    "row": row,
                                    "col": col,
                                    "dtype": "f32",
                                },
                            )
                        )
                        assert (got["row0"], got["col0"]) == (row * TILE, col * TILE)
                        expected = whole[
                            row * TILE : (row + 1) * TILE, col * TILE : (col + 1) * TILE
                        ]
                        torch.testing.assert_close(got["values"], expected, rtol=1e-5, atol=1e-6)
    if models_[name].config.causal:  # the mask: nothing above the diagonal, at every level
        got = decode(client.get(f"{base}/overview", params={"layer": 1, "head": 3, "size": T}))
        assert torch.equal(got["values"].triu(1), torch.zeros(T, T))


class Counting:
    """Counts the model's forward passes (a hook on its first block)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.blocks[0].register_forward_hook(self.count)

    def count(self, *args):
        self.calls += 1


@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "window"])
def test_a_long_texts_heads_grid_comes_from_the_kept_queries_and_keys(served, name, monkeypatch):
    """Past LONG_TEXT tokens the heads grid is pooled from the context ROWS query rows at a time,
    never a T × T matrix, and equals adaptive_max_pool2d of the model's own pattern (600 tokens to
    32 cells: bins that overlap by a row; 70 query rows at a time: blocks that split bins)."""
    from attnlab.explorer import context as context_module
    from attnlab.explorer import views

    client, models_ = served
    text = TEXT[:120] if name == "gpt" else TEXT
    monkeypatch.setattr(views, "LONG_TEXT", 50)
    monkeypatch.setattr(context_module, "ROWS", 70)
    data = client.post("/api/heads", json={"model": name, "text": text}).json()
    assert data["pooled"] and data["tokens"] == list(text)
    thumbs = torch.tensor(data["thumbnails"])
    for layer, pattern in reference(models_[name], text).items():
        expected = F.adaptive_max_pool2d(pattern, (32, 32))
        torch.testing.assert_close(thumbs[layer], expected, atol=1e-4, rtol=0)
    status = client.get("/api/context/status").json()
    assert any(c["n_tokens"] == len(text) and c["model"] == name for c in status["contexts"])


def test_a_head_switch_or_the_same_text_again_never_runs_the_model(served):
    client, models_ = served
    counting = Counting(models_["llama"])
    try:
        text = TEXT[::-1]  # a text no other test posts
        first = open_context(client, "llama", text)
        assert counting.calls == 1
        for layer in range(2):
            for head in range(4):
                base = f"/api/context/{first['id']}"
                params = {"layer": layer, "head": head, "size": 64}
                assert client.get(f"{base}/overview", params=params).status_code == 200
                params = {"layer": layer, "head": head, "level": 0, "row": 2, "col": 1}
                assert client.get(f"{base}/tile", params=params).status_code == 200
        again = open_context(client, "llama", text)
        assert again["id"] == first["id"] and counting.calls == 1
    finally:
        counting.handle.remove()


def test_memory_is_bounded_by_its_budget_and_reported():
    served = small_models()
    cfg = served["llama"].config
    per_text = 4 * cfg.n_layers * 300 * ((cfg.n_heads + cfg.n_kv_heads) * cfg.d_head + cfg.n_heads)
    app = create_app(served, max_tokens=1024)
    app.state.explorer.contexts.budget = 2 * per_text  # two 300-token texts
    with TestClient(app, base_url=LOCAL) as client:
        ids = [open_context(client, "llama", TEXT[i : i + 300])["id"] for i in range(3)]
        status = client.get("/api/context/status").json()
        # the oldest went first; what is held is within the budget, and said
        assert [c["id"] for c in status["contexts"]] == ids[1:]
        assert status["bytes"] <= status["budget_bytes"] == 2 * per_text
        assert status["rss_bytes"] > 0
        gone = client.get(f"/api/context/{ids[0]}/overview", params={"layer": 0, "head": 0})
        assert (
            gone.status_code == 404
            and "post the text to /api/context again" in gone.json()["detail"]
        )
        # many head switches: the normalisers of each head (T floats) and nothing else
        for _ in range(5):
            for layer in range(cfg.n_layers):
                for head in range(cfg.n_heads):
                    params = {"layer": layer, "head": head, "size": 32}
                    assert (
                        client.get(f"/api/context/{ids[2]}/overview", params=params).status_code
                        == 200
                    )
        after = client.get("/api/context/status").json()
        assert after["bytes"] <= after["budget_bytes"]
        held = {c["id"]: c["bytes"] for c in after["contexts"]}
        assert held[ids[2]] == per_text  # q, k and every head's normalisers: exactly the bound
        # under one text's every layer: the layers that fit (the test below); under one layer: 413
        app.state.explorer.contexts.budget = per_text // cfg.n_layers - 1
        too_big = client.post("/api/context", json={"model": "llama", "text": TEXT[:300] + "!"})
        assert too_big.status_code == 413 and "budget" in too_big.json()["detail"]


def test_a_text_over_the_budget_keeps_the_layers_that_fit_and_says_which(monkeypatch):
    """Where every layer's q and k exceed the budget, a context keeps as many layers as fit (from
    layer 0, or those asked for), its forward pass stops after the last of them, and it says which;
    a layer it does not keep is a 404 naming them and the fix; more layers than fit are a 413. The
    kept layers' overviews are still the model's own patterns, and the heads grid of a long text
    takes the layers a window at a time, equal to the grid of a budget that holds them all."""
    from attnlab.explorer import views

    served = small_models()
    model = served["llama"]
    cfg = model.config
    text = TEXT[:300]
    one = 4 * 300 * ((cfg.n_heads + cfg.n_kv_heads) * cfg.d_head + cfg.n_heads)
    app = create_app(served, max_tokens=1024)
    app.state.explorer.contexts.budget = one + one // 2  # one layer of two at 300 tokens
    truth = reference(model, text)
    second = Counting.__new__(Counting)  # counts the passes through layer 1
    second.calls, second.handle = 0, model.blocks[1].register_forward_hook(second.count)
    try:
        with TestClient(app, base_url=LOCAL) as client:
            context = open_context(client, "llama", text)
            assert context["layers"] == [0] and context["n_layers"] == 2
            assert second.calls == 0  # the pass stopped after layer 0
            base = f"/api/context/{context['id']}"
            params = {"layer": 0, "head": 1, "size": 300, "dtype": "f32"}
            got = decode(client.get(f"{base}/overview", params=params))
            torch.testing.assert_close(got["values"], truth[0][1], rtol=1e-5, atol=1e-6)
            missing = client.get(f"{base}/overview", params={**params, "layer": 1})
            assert missing.status_code == 404, missing.text
            detail = missing.json()["detail"]
            assert "layer 1 is not kept" in detail and "keeps layers 0 of 2" in detail
            assert '"layers"' in detail and "\n" not in detail
            asked = client.post(
                "/api/context", json={"model": "llama", "text": text, "layers": [1]}
            )
            assert asked.status_code == 200 and asked.json()["layers"] == [1]
            base = f"/api/context/{asked.json()['id']}"
            got = decode(client.get(f"{base}/overview", params={**params, "layer": 1}))
            torch.testing.assert_close(got["values"], truth[1][1], rtol=1e-5, atol=1e-6)
            both = client.post(
                "/api/context", json={"model": "llama", "text": text, "layers": [0, 1]}
            )
            assert both.status_code == 413 and "1 layers fit" in both.json()["detail"]
            status = client.get("/api/context/status").json()
            assert status["bytes"] <= status["budget_bytes"]
            monkeypatch.setattr(views, "LONG_TEXT", 50)
            windows = client.post("/api/heads", json={"model": "llama", "text": text}).json()
            app.state.explorer.contexts.budget = 4 * one
            whole = client.post("/api/heads", json={"model": "llama", "text": text}).json()
            assert windows["thumbnails"] == whole["thumbnails"]
            assert len(whole["thumbnails"]) == cfg.n_layers
            app.state.explorer.contexts.budget = one - 1
            none = client.post("/api/context", json={"model": "llama", "text": text})
            assert none.status_code == 413 and "one layer" in none.json()["detail"]
    finally:
        second.handle.remove()


@pytest.mark.parametrize(
    "path, params, status, words",
    [
        # a well-formed request for a tile that does not exist: 404, as a token past a text's end
        ("tile", {"level": 0, "row": 3, "col": 0}, 404, ["tile (3, 0) is outside", "0 to 2"]),
        ("tile", {"level": 1, "row": 0, "col": 2}, 404, ["outside the matrix", "2×2 tiles"]),
        ("tile", {"level": 3, "row": 0, "col": 0}, 404, ["level 3 is out of range", "0 (single"]),
        ("tile", {"level": -1, "row": 0, "col": 0}, 422, ["level"]),
        ("tile", {"level": 0, "row": 0}, 422, ["col"]),
        ("overview", {"size": 8}, 422, ["size"]),
        ("overview", {"size": 5000}, 422, ["size"]),
        ("overview", {"layer": 2}, 422, ["layer"]),
        ("overview", {"layer": 1, "head": 4}, 422, ["head"]),
        ("overview", {"dtype": "f64"}, 422, ["dtype"]),
    ],
)
def test_a_request_outside_the_matrix_is_refused_in_one_line(served, path, params, status, words):
    client, _ = served
    context = open_context(client, "llama")
    params = {"layer": 0, "head": 0, **params}
    response = client.get(f"/api/context/{context['id']}/{path}", params=params)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    text = detail if isinstance(detail, str) else str(detail)
    assert all(w in text for w in words), text
    if isinstance(detail, str):
        assert "\n" not in detail


def test_an_unknown_context_and_a_text_over_the_limit_are_refused(served):
    client, _ = served
    unknown = client.get("/api/context/nope/overview", params={"layer": 0, "head": 0})
    assert unknown.status_code == 404 and "no context 'nope'" in unknown.json()["detail"]
    long = client.post("/api/context", json={"model": "llama", "text": "x" * 1025})
    assert long.status_code == 413 and "1025 tokens" in long.json()["detail"]


def test_the_header_says_where_the_cells_are(served):
    client, _ = served
    context = open_context(client, "llama")
    base = f"/api/context/{context['id']}"
    data = client.get(
        f"{base}/tile", params={"layer": 0, "head": 1, "level": 1, "row": 1, "col": 0}
    ).content
    assert struct.unpack("<4s7I", data[:32]) == (MAGIC, 1, 44, 256, 256, 0, 600, 2)
    assert len(data) == 32 + 2 * 44 * 256  # 600 tokens at level 1: 300 cells, 256 + 44
