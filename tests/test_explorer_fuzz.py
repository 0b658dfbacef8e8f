"""schemathesis fuzzes the explorer's API from its own OpenAPI document: no 500, no answer its document
does not declare, no response off its schema, every refusal a declared 4xx (every check, a fixed seed).

The settings (seed 15, 200 examples per operation, every check) are in tests/schemathesis.toml, shared
with the live-server run recorded in benchmarks/README.md. The models are the tests' small random ones,
so 200 examples of each operation take about a minute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig

from attnlab.explorer.app import create_app
from explorer_models import LOCAL, small_models

CONFIG = Path(__file__).resolve().parent / "schemathesis.toml"

schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(small_models()), config=SchemathesisConfig.from_path(CONFIG),
                                       headers={"Host": "127.0.0.1"})


@pytest.mark.slow
@schema.parametrize()
def test_the_api_keeps_every_promise_of_its_document(case):
    case.call_and_validate(base_url=LOCAL)


def test_the_document_declares_every_status_the_server_can_give():
    """Each refusal of the middleware on every operation, with its body's schema, and 503's Retry-After."""
    spec = schema.raw_schema
    operations = [(path, method, op) for path, methods in spec["paths"].items() for method, op in methods.items()]
    assert len(operations) >= 9
    for path, method, op in operations:
        responses = op["responses"]
        expected = {"200", "400", "403", "413", "503"} | ({"415", "422"} if "requestBody" in op else set())
        assert expected <= set(responses), (path, method, sorted(responses))
        for status, response in responses.items():
            if status != "200":
                assert "schema" in response["content"]["application/json"], (path, status)
        assert "Retry-After" in responses["503"]["headers"]
    run = spec["components"]["schemas"]["TextRequest"]["properties"]
    assert run["model"]["enum"] == ["gpt", "llama", "bert"]  # the models this server serves
    assert spec["components"]["schemas"]["HeadRequest"]["properties"]["layer"]["maximum"] == 1
