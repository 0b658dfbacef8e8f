"""schemathesis fuzzes the explorer's API from its own OpenAPI document: no 500, no answer its
document does not declare, no response off its schema, every refusal a declared 4xx, and every
request the document allows answered or refused with the status that says why (404, 409, 413; every
check, a fixed seed).

The settings (seed 15, 200 examples per operation, every check) are in tests/schemathesis.toml,
shared with the live-server run recorded in benchmarks/README.md. In process, the models are the
tests' small random ones, so 200 examples of each operation take about a minute. Then `st run`, as a
client runs it, fuzzes `attnlab explore` serving each kind of model on its own (so the document's
ranges are exactly that model's): the bundled MiniLM encoder, a trained run with snapshots (the step
slider) and a causal model with a BPE tokenizer, every phase (examples, coverage, fuzzing,
stateful), 25 examples each, seed 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis
from explorer_models import LOCAL, PRINTABLE, TEXT, small_models
from schemathesis.config import SchemathesisConfig

import attnlab
from attnlab.explorer.app import create_app
from attnlab.explorer.testing import explorer_process

CONFIG = Path(__file__).resolve().parent / "schemathesis.toml"

schema = schemathesis.openapi.from_asgi(
    "/openapi.json",
    create_app(small_models()),
    config=SchemathesisConfig.from_path(CONFIG),
    headers={"Host": "127.0.0.1"},
)


@pytest.mark.slow
@schema.parametrize()
def test_the_api_keeps_every_promise_of_its_document(case):
    case.call_and_validate(base_url=LOCAL)


def test_the_document_declares_every_status_the_server_can_give():
    """Each refusal of the middleware on every operation, with its body's schema, and 503's
    Retry-After."""
    spec = schema.raw_schema
    operations = [
        (path, method, op)
        for path, methods in spec["paths"].items()
        for method, op in methods.items()
    ]
    assert len(operations) >= 9
    for path, method, op in operations:
        responses = op["responses"]
        expected = {"200", "400", "403", "413", "503"} | (
            {"415", "422"} if "requestBody" in op else set()
        )
        assert expected <= set(responses), (path, method, sorted(responses))
        for status, response in responses.items():
            if status != "200":
                assert "schema" in response["content"]["application/json"], (path, status)
        assert "Retry-After" in responses["503"]["headers"]
    for path in ("/api/next", "/api/attribution"):  # an encoder predicts no next token
        assert "409" in spec["paths"][path]["post"]["responses"], path
    for path, method, op in operations:  # a step without a snapshot, an unknown model
        if (path, method) not in {("/api/models", "get"), ("/api/context/status", "get")}:
            assert "404" in op["responses"], (path, method)
    run = spec["components"]["schemas"]["TextRequest"]["properties"]
    assert run["model"]["enum"] == ["gpt", "llama", "bert"]  # the models this server serves
    assert spec["components"]["schemas"]["HeadRequest"]["properties"]["layer"]["maximum"] == 1
    assert run["ablate"]["uniqueItems"] and run["ablate"]["maxItems"] == 2 * 4
    assert [item["maximum"] for item in run["ablate"]["items"]["prefixItems"]] == [1, 3]
    # the character tokenizer's vocabulary
    characters = "".join(f"\\u{ord(c):04x}" for c in sorted(PRINTABLE))
    assert run["text"]["minLength"] == 1 and run["text"]["pattern"] == f"^[{characters}]*$"
    # an id
    assert (
        spec["components"]["schemas"]["AttributionRequest"]["properties"]["token"]["maximum"] == 95
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, str]:
    """What `attnlab explore` is given for each live server: the bundled MiniLM, a tiny trained run
    with snapshots, and a causal LLaMA-style model with a byte-level BPE tokenizer (any text
    encodes)."""
    from training_tiny import tiny_config

    from attnlab.tokenizer import Tokenizer
    from attnlab.training.trainer import train

    root = tmp_path_factory.mktemp("fuzz")
    train(tiny_config(root, max_iters=6, snapshots=3), progress=False)
    tokenizer = Tokenizer.train_bpe([TEXT * 20], 300)
    model = attnlab.Transformer(
        attnlab.preset(
            "llama-tiny",
            d_vocab=tokenizer.vocab_size,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=32,
            d_mlp=64,
        )
    )
    model.tokenizer = tokenizer
    attnlab.save(model, root / "causal")
    return {"minilm": "minilm", "run": str(root / "run"), "causal": str(root / "causal")}


@pytest.mark.slow
@pytest.mark.parametrize("server", ["minilm", "run", "causal"])
def test_a_live_explorer_keeps_every_promise_of_its_document_to_a_client(served, server, tmp_path):
    """`st run URL/openapi.json --checks all` against a real server: every check, every phase."""
    st = Path(sys.executable).parent / "st"
    with explorer_process(served[server]) as (_, url):
        done = subprocess.run(
            [
                str(st),
                "--config-file",
                str(CONFIG),
                "run",
                f"{url}openapi.json",
                "--checks",
                "all",
                "-n",
                "25",
                "--seed",
                "1",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )  # st keeps a .schemathesis/ folder where it runs
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in report, report[-3000:]  # each phase ran and passed (none skipped)
