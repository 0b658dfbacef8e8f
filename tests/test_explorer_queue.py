"""The bounded queue in front of model work (work_queue.py): capacity admitted, the excess 503 at
once, nothing lost.

The model is held at a gate (a forward pre-hook that waits), so what the queue does is seen without
timing
anything: the refusals come back while every admitted request is still held, which is what "at once"
means; and once the gate opens every admitted request gets its own, correct answer.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch
from explorer_models import TEXT, small_models

from attnlab.explorer.app import create_app
from attnlab.explorer.testing import serving

CAPACITY = 4


def post(url: str, path: str, body: dict) -> tuple[int, dict, dict]:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1"  # loopback only
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return (
            response.status,
            {k.lower(): v for k, v in response.getheaders()},
            json.loads(response.read()),
        )
    finally:
        connection.close()


def wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds  # a hard deadline against a hang, not a measurement
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def gated():
    """(model, gate): the gpt test model, whose every forward pass waits while `gate` is clear (it
    starts open); `gate.reached` is set when a pass has reached it."""
    model = small_models()["gpt"]
    gate = threading.Event()
    gate.set()
    gate.reached = threading.Event()

    def hold(module, args):
        gate.reached.set()
        gate.wait(120)

    handle = model.blocks[0].register_forward_pre_hook(hold)
    yield model, gate
    gate.set()
    handle.remove()


@pytest.mark.parametrize("load", [1, 2])  # at the queue's capacity, and at twice it
def test_the_excess_over_capacity_gets_503_at_once_and_the_rest_succeed(gated, load):
    model, gate = gated
    heads = [(layer, head) for layer in range(2) for head in range(4)][: load * CAPACITY]
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([model.tokenizer.encode(TEXT)]))
    results: dict[tuple[int, int], tuple[int, dict, dict]] = {}
    gate.clear()
    with serving(create_app({"gpt": model}, queue=CAPACITY)) as url:

        def ask(layer, head):
            results[layer, head] = post(
                url, "/api/pattern", {"model": "gpt", "text": TEXT, "layer": layer, "head": head}
            )

        threads = [threading.Thread(target=ask, args=job) for job in heads]
        for t in threads:
            t.start()
        excess = len(heads) - CAPACITY
        wait_for(lambda: len(results) >= excess, f"{excess} refusals")
        time.sleep(0.2)  # room for a wrong extra answer to arrive while the gate is still closed
        # everything answered while every admitted request is held at the gate
        early = dict(results)
        gate.set()
        for t in threads:
            t.join(timeout=120)

    assert len(early) == excess
    for status, headers, body in early.values():
        assert status == 503 and headers["retry-after"] == "1" and "busy" in body["detail"]
    served = {job: r for job, r in results.items() if job not in early}
    assert len(served) == CAPACITY and len(results) == len(heads)
    for (layer, head), (status, _, body) in served.items():
        assert status == 200
        expected = cache[f"blocks.{layer}.attn.hook_pattern"][0, head]
        torch.testing.assert_close(torch.tensor(body["pattern"]), expected, atol=1e-6, rtol=0)


def test_the_queue_frees_its_places_once_the_work_is_done(gated):
    """After a burst has been refused and served, the next burst at capacity is admitted whole (no
    leaked slot)."""
    model, _ = gated
    with serving(create_app({"gpt": model}, queue=1)) as url:
        for _ in range(3):
            assert post(url, "/api/run", {"model": "gpt", "text": TEXT})[0] == 200
        # a refusal frees its place too
        assert post(url, "/api/run", {"model": "nope", "text": TEXT})[0] == 404
        assert post(url, "/api/run", {"model": "gpt", "text": TEXT})[0] == 200


def test_the_page_and_its_files_are_not_queued(gated):
    """Only /api/ is model work: with the queue full, the page still loads (and then waits its
    turn)."""
    model, gate = gated
    gate.clear()
    with serving(create_app({"gpt": model}, queue=1)) as url:
        held = threading.Thread(
            target=post,
            args=(url, "/api/pattern", {"model": "gpt", "text": TEXT, "layer": 0, "head": 0}),
        )
        held.start()
        wait_for(gate.reached.is_set, "the request to reach the model")
        parts = urlsplit(url)

        def get(path):
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            connection.request("GET", path)
            return connection.getresponse().status

        assert get("/api/models") == 503
        assert get("/") == 200 and get("/static/app.js") == 200
        gate.set()
        held.join(timeout=120)
        assert get("/api/models") == 200


def test_answers_are_encoded_in_the_routes_thread_not_in_the_event_loop(monkeypatch):
    """Encoding a large answer to JSON (every head's pattern: 150 kB) happens where the model work
    ran, so the event loop, which answers the queue's 503s, is never held by it (routers/api.py). A
    probe in the answer
    records where it is encoded: pydantic's encoder, FastAPI's and the routes' alike, reads its
    field."""
    import asyncio

    from explorer_models import LOCAL
    from fastapi.testclient import TestClient
    from pydantic import BaseModel, computed_field

    from attnlab.explorer.views import Explorer

    encoded_in_loop = []

    class Probe(BaseModel):
        @computed_field
        @property
        def encoded(self) -> bool:
            try:
                asyncio.get_running_loop()
                encoded_in_loop.append(True)
            except RuntimeError:
                encoded_in_loop.append(False)
            return True

    monkeypatch.setattr(Explorer, "list_models", lambda self: [{"probe": Probe()}])
    monkeypatch.setattr(Explorer, "run", lambda self, *args: {"probe": Probe()})
    with TestClient(create_app(small_models()), base_url=LOCAL) as client:
        assert client.get("/api/models").json() == [{"probe": {"encoded": True}}]
        assert client.post("/api/run", json={"model": "gpt", "text": TEXT}).json() == {
            "probe": {"encoded": True}
        }
    assert encoded_in_loop == [False, False]


def test_a_nan_in_an_answer_is_sent_as_null_as_fastapi_sends_it(gated):
    """The routes encode their answers themselves (above) but as FastAPI did: valid JSON, a NaN as
    null (a tiny top_p makes every probability 0/0), never a bare NaN token that a browser's
    JSON.parse refuses."""
    from explorer_models import LOCAL
    from fastapi.testclient import TestClient

    model, _ = gated
    with TestClient(create_app({"gpt": model}), base_url=LOCAL) as client:
        response = client.post("/api/next", json={"model": "gpt", "text": TEXT, "top_p": 5e-324})
    assert response.status_code == 200
    assert b"NaN" not in response.content
    json.loads(response.content, parse_constant=lambda name: pytest.fail(f"{name} in the answer"))


def test_the_servers_connections_send_at_once_without_waiting_for_an_ack():
    """TCP_NODELAY on every connection the explorer's socket accepts, as uvicorn's asyncio loop
    serves them.

    With Nagle's algorithm on, an answer written in two parts (headers, then body) held its second
    part until the client acknowledged the first, and Linux clients delay that ACK by 40 ms: every
    request, a 503 included, took 45 ms on an idle loopback instead of about 1 ms
    (benchmarks/README.md). asyncio turns Nagle off only on sockets created as IPPROTO_TCP, so this
    is a property of `bind`."""
    import asyncio
    import socket

    from attnlab.explorer.server import bind

    async def accept_one() -> int:
        sock = bind("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                accepted = transport.get_extra_info("socket")
                seen.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(seen, 60)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accept_one()) != 0


@pytest.mark.slow
def test_the_load_benchmark_holds_at_capacity_and_at_twice_it(tmp_path):
    """benchmarks/explorer_load.py, small: a real server process, fixed clients and counts, a hard
    deadline.

    Its promises but the 50 ms one (durations are the benchmark's to report, not a test's to
    assert):
    at capacity every request succeeds; at twice it only 200s and 503s (each with Retry-After); the
    server's memory after within 10 % of before.
    """
    import subprocess
    import sys
    from pathlib import Path

    import attnlab

    attnlab.save(small_models()["gpt"], tmp_path / "tiny-gpt")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "explorer_load.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--model",
            str(tmp_path / "tiny-gpt"),
            "--queue",
            "2",
            "--requests",
            "30",
            "--rounds",
            "1",
            "--no-machine",
            "--deadline",
            "400",
            "--json",
            str(tmp_path / "load.json"),
            "--results",  # its record too goes to the test's folder, never the repository's
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = json.loads((tmp_path / "load.json").read_text())
    promises = results["promises"]
    assert done.returncode in (0, 1), done.stderr
    for promise, kept in promises.items():
        if "50 ms" not in promise:
            assert kept, (promise, done.stdout)
    assert results["statuses"]["capacity"] == {"200": 30}
    assert results["statuses"]["twice"]["503"] > 0 and results["statuses"]["twice"]["200"] > 0
