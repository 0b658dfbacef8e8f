"""The explorer's experiments through its API: knocking out heads, scrubbing through training
snapshots.

Ablation must be the interventions' ablation (run_with_hooks with ablate_head), not a second
implementation; no ablation must be the plain run; a step must be the snapshot's weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from explorer_models import LOCAL, TEXT, post, snapshot_run
from fastapi.testclient import TestClient

from attnlab.explorer.app import create_app
from attnlab.inspection.interventions import ablate_head
from attnlab.training.snapshots import load_snapshot


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    return snapshot_run(models["gpt"], tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def client(models, run):
    with TestClient(create_app(models, max_tokens=512, runs={"gpt": run}), base_url=LOCAL) as c:
        yield c


def logits_of(model, text=TEXT, hooks=()):
    ids = torch.tensor([model.tokenizer.encode(text)])
    with torch.no_grad():
        return ids, model.run_with_hooks(ids, fwd_hooks=list(hooks))[0].float()


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_ablating_through_the_endpoint_is_run_with_hooks_with_ablate_head(client, models, ablation):
    model = models["gpt"]
    heads = [[1, 2], [0, 3]]
    data = post(client, "/api/next", model="gpt", text=TEXT, ablate=heads, ablation=ablation, k=5)
    ids, expected = logits_of(model, hooks=[ablate_head(l, h, ablation) for l, h in heads])
    _, plain = logits_of(model)
    got = torch.tensor([c["logit"] for c in data["candidates"]])
    index = torch.tensor([c["id"] for c in data["candidates"]])
    torch.testing.assert_close(got, expected[-1, index], rtol=0, atol=1e-5)
    assert (plain[-1, index] - got).abs().max() > 1e-3  # the knockout changed the prediction
    # the per-token losses of /api/knockout are those logits' cross-entropies, before and after
    knock = post(client, "/api/knockout", model="gpt", text=TEXT, ablate=heads, ablation=ablation)
    torch.testing.assert_close(
        torch.tensor(knock["loss_after"]),
        F.cross_entropy(expected[:-1], ids[0, 1:], reduction="none"),
        rtol=0,
        atol=1e-5,
    )
    torch.testing.assert_close(
        torch.tensor(knock["loss_before"]),
        F.cross_entropy(plain[:-1], ids[0, 1:], reduction="none"),
        rtol=0,
        atol=1e-5,
    )
    assert len(knock["cosine"]) == len(TEXT) and min(knock["cosine"]) < 0.999
    # the views see the ablated model too: a later layer's pattern changes, the ablated layer's own
    # does not
    for layer, changes in ((0, False), (1, True)):
        before = torch.tensor(
            post(client, "/api/pattern", model="gpt", text=TEXT, layer=layer, head=0)["pattern"]
        )
        after = torch.tensor(
            post(
                client,
                "/api/pattern",
                model="gpt",
                text=TEXT,
                layer=layer,
                head=0,
                ablate=heads,
                ablation=ablation,
            )["pattern"]
        )
        assert (not torch.allclose(before, after, atol=1e-6)) == changes, layer


def test_ablating_no_head_is_the_plain_run(client, models):
    _, plain = logits_of(models["gpt"])
    data = post(client, "/api/next", model="gpt", text=TEXT, ablate=[], k=5)
    index = torch.tensor([c["id"] for c in data["candidates"]])
    torch.testing.assert_close(
        torch.tensor([c["logit"] for c in data["candidates"]]), plain[-1, index], rtol=0, atol=0
    )
    knock = post(client, "/api/knockout", model="gpt", text=TEXT)
    assert knock["loss_before"] == knock["loss_after"] and all(
        c == pytest.approx(1, abs=1e-6) for c in knock["cosine"]
    )


def test_an_encoder_shows_the_cosine_change_of_the_last_hidden_state(client, models):
    model = models["bert"]
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    name = f"blocks.{model.config.n_layers - 1}.hook_resid_post"  # post-norm: the last hidden state
    with torch.no_grad():
        _, before = model.run_with_cache(ids, names_filter=name)
        _, after = model.run_with_cache(ids, names_filter=name, fwd_hooks=[ablate_head(1, 1)])
    data = post(client, "/api/knockout", model="bert", text=TEXT, ablate=[[1, 1]])
    assert data["loss_before"] is None and data["hidden_hook"] == name
    expected = F.cosine_similarity(after[name][0], before[name][0], dim=-1)
    torch.testing.assert_close(torch.tensor(data["cosine"]), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "ablate, words",
    [
        ([[2, 0]], ["layer 2", "2 layers"]),
        ([[0, 4]], ["head 4", "4 heads"]),
        ([[0, 1], [0, 1]], ["listed twice"]),
        (
            [[layer, head] for layer in range(2) for head in range(4)] + [[0, 0]],
            ["9 heads to ablate", "only 8"],
        ),
        ([[0, 1, 2]], ["ablate"]),  # not a pair: pydantic's 422
    ],
)
def test_bad_head_lists_get_a_declared_422(client, ablate, words):
    for path in ("/api/knockout", "/api/next", "/api/pattern"):
        response = client.post(
            path, json={"model": "gpt", "text": TEXT, "layer": 0, "head": 0, "ablate": ablate}
        )
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        text = (
            detail
            if isinstance(detail, str)
            else " ".join(f"{'.'.join(map(str, d['loc']))} {d['msg']}" for d in detail)
        )
        assert all(word in text for word in words), (words, text)
    spec = client.get("/openapi.json").json()["paths"]
    assert (
        "422" in spec["/api/knockout"]["post"]["responses"]
        and "ablate" in spec["/api/knockout"]["post"]["responses"]["422"]["description"]
    )


def test_a_step_shows_the_snapshot_and_lists_the_run(client, models, run):
    listed = {m["name"]: m for m in client.get("/api/models").json()}
    assert (
        listed["gpt"]["steps"] == [0, 10, 20]
        and listed["gpt"]["start_step"] == 10
        and listed["llama"]["steps"] == []
    )
    for step in (0, 20):
        snap = load_snapshot(models["gpt"], run.snapshots[step])
        ids = torch.tensor([snap.tokenizer.encode(TEXT)])
        with torch.no_grad():
            _, cache = snap.run_with_cache(ids, names_filter="blocks.1.attn.hook_pattern")
        data = post(client, "/api/pattern", model="gpt", text=TEXT, layer=1, head=2, step=step)
        torch.testing.assert_close(
            torch.tensor(data["pattern"]),
            cache["blocks.1.attn.hook_pattern"][0, 2],
            rtol=0,
            atol=1e-6,
        )
    first = post(client, "/api/pattern", model="gpt", text=TEXT, layer=1, head=2, step=0)["pattern"]
    last = post(client, "/api/pattern", model="gpt", text=TEXT, layer=1, head=2, step=20)["pattern"]
    assert first != last
    curves = client.get("/api/models/gpt/training").json()
    assert curves["steps"] == [0, 10, 20] and curves["start_step"] == 10
    if curves["available"]:
        assert (
            len(curves["scores"]["induction"]) == 3 and len(curves["scores"]["induction"][0]) == 2
        )
    assert client.get("/api/models/gpt/head-scores", params={"step": 20}).status_code == 200


@pytest.mark.parametrize(
    "model, step, words",
    [
        ("gpt", 5, ["no snapshot at step 5", "0, 10, 20"]),
        ("llama", 0, ["no training snapshots", "--snapshots"]),
    ],
)
def test_a_step_without_a_snapshot_is_a_404_naming_the_steps(client, model, step, words):
    response = client.post("/api/run", json={"model": model, "text": TEXT, "step": step})
    assert response.status_code == 404 and all(w in response.json()["detail"] for w in words), (
        response.text
    )
    assert client.get(f"/api/models/{model}/head-scores", params={"step": step}).status_code == 404
    assert client.get("/api/models/llama/training").status_code == 404


def test_the_pattern_reports_what_the_text_cost(client):
    data = post(client, "/api/pattern", model="llama", text=TEXT, layer=0, head=0)
    T = len(TEXT)
    assert data["cost"]["entries_per_head"] == T * T and data["cost"]["server_ms"] > 0


def decode_f16(m):
    """What core.js's decodeMatrix does with an "f16" matrix: float16 x scale, a `lower` one's
    triangle filled in."""
    import base64

    import numpy as np

    values = np.frombuffer(base64.b64decode(m["f16"]), dtype="<f2").astype(np.float64) * m["scale"]
    if not m["lower"]:
        return values.reshape(m["shape"])
    out = np.zeros(m["shape"])
    out[np.tril_indices(m["shape"][0])] = values
    return out


def shown(value: float, digits: int = 3) -> float:
    """The number JavaScript's toPrecision(digits) prints."""
    return float(f"{value:.{digits - 1}e}")


@pytest.mark.parametrize("model, lower", [("llama", True), ("bert", False)])
def test_long_texts_travel_as_float16_and_every_shown_digit_is_right(client, model, lower):
    """encoding f16 (what the page asks for above 512 tokens): the same numbers to float16's
    precision, every value the hover prints to 3 significant digits within one unit of its last
    digit of the float32 truth (below `tiny`, printed as "< tiny", within tiny); a causal pattern
    sends its lower triangle only."""
    import base64

    import numpy as np

    text = ("the cat sat on the mat. " * 25)[:511]
    exact = post(client, "/api/pattern", model=model, text=text, layer=1, head=1, encoding="json")
    light = post(client, "/api/pattern", model=model, text=text, layer=1, head=1, encoding="f16")
    for key in ("raw", "pattern"):
        truth, m = np.array(exact[key], dtype=np.float64), light[key]
        assert m["lower"] == (lower and key == "pattern")
        got = decode_f16(m)
        big = np.abs(truth) >= m["tiny"]
        # most values are in float16's exact range (a weight down to ~1e-9)
        assert big.mean() > 0.5, key
        assert np.all(np.abs(got - truth)[big] <= 2**-11 * np.abs(truth)[big]), key
        assert np.all(np.abs(got - truth)[~big] <= m["tiny"]), key
        # what the hover prints, against the truth
        for g, t in zip(got[big][::97], truth[big][::97]):
            assert abs(shown(g) - t) <= 10 ** (np.floor(np.log10(abs(t))) - 2), (
                key,
                g,
                t,
                shown(g),
            )
    T = len(text)
    f32_bytes = 2 * 4 * T * T
    f16_bytes = sum(len(base64.b64decode(light[k]["f16"])) for k in ("raw", "pattern"))
    # 2 bytes a number, the triangle once
    assert f16_bytes == (2 * T * T + 2 * (T * (T + 1) // 2 if lower else T * T))
    assert f16_bytes < (0.38 if lower else 0.51) * f32_bytes
    # a masked score (−∞) keeps the scale of the finite ones
    from attnlab.explorer.encoding import encode_matrix

    masked = torch.tensor([[1.5, -float("inf")], [3.0, -2.0]])
    np.testing.assert_array_equal(decode_f16(encode_matrix(masked, "f16")), masked.numpy())


def test_minilm_knocking_out_the_heads_where_it_lands_on_cat_turns_its_hidden_state():
    """The chapter's coreference example: layer 5's heads 4 and 11 send "it" to "cat"; without them
    "it"'s last hidden state turns (cosine 0.86 measured), while a control head of the same layer
    that ignores "cat" (head 2, weight 0.04) leaves it nearly where it was (0.996)."""
    import attnlab

    model = attnlab.load("minilm")
    text = "The cat sat on the mat because it was tired."
    with TestClient(create_app({"minilm": model}), base_url=LOCAL) as c:
        tokens = post(c, "/api/run", model="minilm", text=text)["tokens"]
        it, cat = tokens.index("it"), tokens.index("cat")
        pattern = post(c, "/api/pattern", model="minilm", text=text, layer=5, head=11)["pattern"]
        assert pattern[it][cat] > 0.5
        knocked = post(c, "/api/knockout", model="minilm", text=text, ablate=[[5, 4], [5, 11]])[
            "cosine"
        ][it]
        control = post(c, "/api/knockout", model="minilm", text=text, ablate=[[5, 2]])["cosine"][it]
    assert knocked < 0.9 and control > 0.99, (knocked, control)


def test_attribution_is_the_inspection_direct_logit_attribution_with_the_knockout(client, models):
    """The next-token view's "who wrote this prediction": attnlab.inspection.attribution's numbers,
    ablation included."""
    from attnlab.inspection.attribution import direct_logit_attribution

    model = models["gpt"]
    top = post(client, "/api/next", model="gpt", text=TEXT, k=1)["candidates"][0]
    data = post(client, "/api/attribution", model="gpt", text=TEXT, token=top["id"])
    expected = direct_logit_attribution(model, TEXT, model.tokenizer.decode([top["id"]]))
    torch.testing.assert_close(torch.tensor(data["heads"]), expected.heads, rtol=0, atol=1e-5)
    assert data["logit"] == pytest.approx(top["logit"], abs=1e-4) and data[
        "sum_of_terms"
    ] == pytest.approx(data["logit"], abs=1e-3)
    knocked = post(
        client, "/api/attribution", model="gpt", text=TEXT, token=top["id"], ablate=[[1, 2]]
    )
    ablated = post(client, "/api/next", model="gpt", text=TEXT, k=100, ablate=[[1, 2]])[
        "candidates"
    ]
    assert knocked["heads"][1][2] == pytest.approx(0, abs=1e-6)  # a knocked-out head writes nothing
    assert knocked["logit"] == pytest.approx(
        next(c["logit"] for c in ablated if c["id"] == top["id"]), abs=1e-4
    )
    assert (
        client.post(
            "/api/attribution", json={"model": "gpt", "text": TEXT, "token": 10**6}
        ).status_code
        == 422
    )
    assert (
        client.post(
            "/api/attribution", json={"model": "bert", "text": TEXT, "token": 1}
        ).status_code
        == 409
    )
