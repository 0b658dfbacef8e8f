"""The experts view's data (POST /api/experts): a mixture of experts' router on a text, against the
reference, the model's own hook points read with run_with_cache on the same model and text.

- The scores are hook_expert_weights exactly, the chosen experts hook_expert_indices and torch.topk
  of those scores, and the weights are the ones the model mixes with: the chosen experts' outputs
  weighted by them (plus Qwen2-MoE's gated shared expert) give the block's hook_mlp_out.
- The load is each layer's count of tokens per expert, and the mean scores each expert's mean.
- A dense model has no router: 409 naming it; a layer past the model's is 422.
- The OpenAPI document declares the route, its 409 and the layer's range; schemathesis fuzzes the
  route on a server with a mixture of experts beside a dense model (every check, as
  test_explorer_fuzz.py fuzzes the rest).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
import torch
from explorer_models import LOCAL, TEXT, moe_model, post, small_models
from fastapi.testclient import TestClient
from schemathesis.config import SchemathesisConfig

from attnlab.explorer.app import create_app
from attnlab.inspection.interventions import ablate_head

CASES = {
    "mixtral": {},  # renormalised top-k weights
    "qwen2_moe": {"norm_topk_prob": False, "d_shared_expert": 20},  # as they are, a shared expert
}


@pytest.fixture(scope="module")
def moe_models() -> dict:
    return {name: moe_model(seed=i, **config) for i, (name, config) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def moe_client(moe_models):
    app = create_app({**moe_models, "llama": small_models()["llama"]}, max_tokens=512)
    with TestClient(app, base_url=LOCAL) as c:
        yield c


@pytest.mark.parametrize("name", list(CASES))
def test_the_router_is_the_hook_points_of_run_with_cache(moe_client, moe_models, name):
    model = moe_models[name]
    cfg = model.config
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    with torch.no_grad():
        # the router's hooks only, as a lens user reads them (and as the view does: the same fast
        # paths run past the other hook points, so the numbers are bit for bit the same)
        _, router = model.run_with_cache(ids, names_filter=lambda name: "hook_expert" in name)
        _, cache = model.run_with_cache(ids)  # every hook: the modules step by step
    counts = []
    for layer in range(cfg.n_layers):
        got = post(moe_client, "/api/experts", model=name, text=TEXT, layer=layer)
        scores = router[f"blocks.{layer}.mlp.hook_expert_weights"][0]  # [pos, n_experts]
        chosen = router[f"blocks.{layer}.mlp.hook_expert_indices"][0]  # [pos, k]
        assert got["hooks"]["scores"] == f"blocks.{layer}.mlp.hook_expert_weights"
        assert got["tokens"] == list(TEXT) and got["layer"] == layer
        assert torch.equal(torch.tensor(got["scores"]), scores)
        assert torch.equal(torch.tensor(got["chosen"]), chosen)
        stepwise = cache[f"blocks.{layer}.mlp.hook_expert_weights"][0]
        torch.testing.assert_close(torch.tensor(got["scores"]), stepwise, rtol=0, atol=1e-6)
        assert torch.equal(
            torch.tensor(got["chosen"]), cache[f"blocks.{layer}.mlp.hook_expert_indices"][0]
        )
        top = torch.topk(scores, cfg.experts_per_token)
        assert torch.equal(torch.tensor(got["chosen"]), top.indices)
        weights = torch.tensor(got["weights"])  # [pos, k]
        expected = (
            top.values / top.values.sum(-1, keepdim=True) if cfg.norm_topk_prob else top.values
        )
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-7)
        # the weights are what the model mixes the chosen experts' outputs with
        mlp = model.blocks[layer].mlp
        with torch.no_grad():
            x = model.blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"][0])  # MLP's input
            out = torch.stack(
                [
                    sum(w * mlp.experts[e](x[t]) for w, e in zip(weights[t], chosen[t].tolist()))
                    for t in range(len(TEXT))
                ]
            )
            if mlp.shared_expert is not None:
                out = out + torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
        torch.testing.assert_close(out, cache[f"blocks.{layer}.hook_mlp_out"][0])
        counts.append(torch.bincount(chosen.flatten(), minlength=cfg.n_experts).tolist())
        assert got["load"]["mean_scores"][layer] == pytest.approx(scores.mean(0).tolist())
    assert got["load"]["counts"] == counts
    assert all(sum(c) == len(TEXT) * cfg.experts_per_token for c in counts)
    assert got["n_experts"] == 6 and got["experts_per_token"] == 2
    assert got["norm_topk_prob"] == cfg.norm_topk_prob
    assert got["shared_expert"] == (name == "qwen2_moe")


def test_knocked_out_heads_reach_the_router(moe_client, moe_models):
    """The view runs the request's variant: the scores are those of the model with the heads off."""
    model = moe_models["mixtral"]
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    off = [[0, 0], [0, 1], [0, 2], [0, 3]]
    with torch.no_grad(), model.hooks([ablate_head(layer, head) for layer, head in off]):
        _, cache = model.run_with_cache(ids, names_filter=lambda name: "hook_expert" in name)
    got = post(moe_client, "/api/experts", model="mixtral", text=TEXT, layer=1, ablate=off)
    plain = post(moe_client, "/api/experts", model="mixtral", text=TEXT, layer=1)
    assert torch.equal(torch.tensor(got["scores"]), cache["blocks.1.mlp.hook_expert_weights"][0])
    assert got["scores"] != plain["scores"]


def test_every_view_answers_on_a_mixture_of_experts(moe_client, moe_models):
    """Each route once on the mixtures (fuzzing all of them on these models passes too, slowly);
    the block's trace shows the router where a dense block shows its MLP's hidden layer."""
    for name in CASES:
        text = {"model": name, "text": TEXT}
        for path, extra in (
            ("/api/run", {}),
            ("/api/pattern", {"layer": 1, "head": 2}),
            ("/api/stages", {"layer": 1, "head": 2}),
            ("/api/projection", {"layer": 1, "head": 2}),
            ("/api/heads", {}),
            ("/api/next", {}),
            ("/api/attribution", {"token": 5}),
            ("/api/knockout", {"ablate": [[0, 1]]}),
            ("/api/atlas", {}),
            ("/api/context", {}),
        ):
            post(moe_client, path, **text, **extra)
        model = moe_models[name]
        with torch.no_grad():
            _, cache = model.run_with_cache(torch.tensor([model.tokenizer.encode(TEXT)]))
        trace = post(moe_client, "/api/trace", **text, layer=2, token=7)
        stages = {s["key"]: s for s in trace["stages"]}
        order = [s["key"] for s in trace["stages"]]
        assert order[-5:] == ["ln2", "router", "experts", "mlp_out", "resid_post"]
        for key, hook in (("router", "hook_expert_weights"), ("experts", "hook_expert_indices")):
            assert stages[key]["hook"] == f"blocks.2.mlp.{hook}"
            full = cache[f"blocks.2.mlp.{hook}"][0]
            assert stages[key]["shape"] == list(full.shape)
            torch.testing.assert_close(
                torch.tensor(stages[key]["values"]), full[7].float(), atol=1e-6, rtol=0
            )


def test_an_exported_page_carries_every_layers_router(moe_client, moe_models):
    """export-html's data: the page's request for each layer, answered as the server answers it
    (to the export's 5 significant digits)."""
    from attnlab.explorer.export import export_data, request_key

    data = export_data(moe_models["mixtral"], TEXT[:20], name="mixtral")
    for layer in range(3):
        body = {"model": "mixtral", "text": TEXT[:20], "layer": layer}
        exported = data["responses"][request_key("/api/experts", body)]
        served = post(moe_client, "/api/experts", **body)
        assert exported["chosen"] == served["chosen"]
        assert exported["load"]["counts"] == served["load"]["counts"]
        torch.testing.assert_close(
            torch.tensor(exported["scores"]), torch.tensor(served["scores"]), rtol=1e-4, atol=0
        )


def test_a_dense_model_has_no_router(moe_client):
    response = moe_client.post("/api/experts", json={"model": "llama", "text": TEXT, "layer": 0})
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert "model 'llama' has no experts" in detail and "mixture-of-experts" in detail
    response = moe_client.post("/api/experts", json={"model": "mixtral", "text": TEXT, "layer": 3})
    assert response.status_code == 422
    assert "layer 3 is out of range" in response.json()["detail"]


def test_the_models_list_says_which_have_experts(moe_client):
    listed = {m["name"]: m for m in moe_client.get("/api/models").json()}
    assert listed["mixtral"]["n_experts"] == 6 and listed["mixtral"]["experts_per_token"] == 2
    assert listed["llama"]["n_experts"] == 0


def test_the_document_declares_the_route_its_409_and_the_layers_range(moe_client):
    spec = moe_client.get("/openapi.json").json()
    responses = spec["paths"]["/api/experts"]["post"]["responses"]
    assert {"200", "404", "409", "413", "422"} <= set(responses)
    layer = spec["components"]["schemas"]["ExpertsRequest"]["properties"]["layer"]
    assert (layer["minimum"], layer["maximum"]) == (0, 2)  # the served models' 3 layers at most


CONFIG = Path(__file__).resolve().parent / "schemathesis.toml"
schema = schemathesis.openapi.from_asgi(
    "/openapi.json",
    # the same layers and heads as the dense model: the ranges of both are one range (app.py)
    create_app({"moe": moe_model(n_layers=2), "llama": small_models()["llama"]}),
    config=SchemathesisConfig.from_path(CONFIG),
    headers={"Host": "127.0.0.1"},
)


# The router's route only (the other routes are fuzzed on dense models in test_explorer_fuzz.py, and
# each answers on this model in test_every_view_answers_on_a_mixture_of_experts). An exclusion, not
# `include`: schemathesis ORs an include with the config's own operation filter, which takes all.
@pytest.mark.slow
@schema.exclude(path_regex="^(?!/api/experts$)").parametrize()
def test_the_router_keeps_every_promise_of_its_document(case):
    case.call_and_validate(base_url=LOCAL)
