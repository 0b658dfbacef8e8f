"""The explorer on a shared machine: DNS rebinding, cross-site requests, the token, the headers
(security.py).

Every check goes through FastAPI's TestClient against `create_app`, so a route that another change
adds
is guarded the same way: the tests walk the app's own routes rather than a list written here.
"""

from __future__ import annotations

import json

import pytest
from explorer_models import LOCAL, TEXT, small_models
from fastapi.testclient import TestClient

from attnlab.explorer.app import create_app
from attnlab.explorer.security import CSP

BODY = {"model": "gpt", "text": TEXT}


@pytest.fixture(scope="module")
def app():
    return create_app({"gpt": small_models()["gpt"]})


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, base_url=LOCAL) as c:
        yield c


def get_paths(app):
    """Every GET route of the app (path parameters filled with the model's name), the page and a
    static file."""
    paths = ["/", "/docs", "/openapi.json", "/static/app.js", "/static/style.css", "/no-such-page"]
    for route in app.routes:
        if "GET" in getattr(route, "methods", ()) and route.path.startswith("/api/"):
            paths.append(route.path.replace("{name}", "gpt"))
    return paths


@pytest.mark.parametrize(
    "host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000", "LOCALHOST", "127.0.0.1"]
)
def test_loopback_hosts_are_served(client, host):
    assert client.get("/api/models", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize(
    "host",
    [
        "attacker.example",
        "attacker.example:8000",
        "127.0.0.1.attacker.example",
        "localhost.attacker.example:8000",
        "192.168.1.5:8000",
        "",
        "testserver",
    ],
)
def test_any_other_host_is_400_on_every_route(app, client, host):
    """DNS rebinding: a page on attacker.example that re-points its name at 127.0.0.1 sends Host:
    attacker.example."""
    for path in get_paths(app):
        response = client.get(path, headers={"Host": host})
        assert response.status_code == 400, (path, response.status_code)
        assert "DNS rebinding" in response.json()["detail"]
    assert client.post("/api/run", json=BODY, headers={"Host": host}).status_code == 400


@pytest.mark.parametrize(
    "origin",
    [
        "http://attacker.example",
        "http://localhost:8000",
        "http://127.0.0.1:9999",
        "https://127.0.0.1:8000",
        "null",
    ],
)
def test_a_post_from_another_origin_is_403(client, origin):
    response = client.post("/api/run", json=BODY, headers={"Origin": origin})
    assert response.status_code == 403 and "cross-origin" in response.json()["detail"]


def test_a_post_from_the_page_itself_is_served(client):
    assert (
        client.post("/api/run", json=BODY, headers={"Origin": "http://127.0.0.1:8000"}).status_code
        == 200
    )
    assert client.post("/api/run", json=BODY).status_code == 200  # curl and scripts send no Origin
    # a browser that marks the request cross-site is refused even without an Origin
    assert (
        client.post("/api/run", json=BODY, headers={"Sec-Fetch-Site": "cross-site"}).status_code
        == 403
    )
    assert (
        client.post("/api/run", json=BODY, headers={"Sec-Fetch-Site": "same-origin"}).status_code
        == 200
    )


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ],
)
def test_a_body_that_is_not_declared_json_is_never_parsed_as_json(client, content_type):
    """A cross-site form or fetch may send text/plain with no CORS preflight: its JSON-looking body
    is refused unread."""
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/api/run", content=json.dumps(BODY).encode(), headers=headers)
    assert response.status_code == 415, response.text
    assert "application/json" in response.json()["detail"]


def test_no_response_ever_carries_a_cors_header(app, client):
    preflight = {
        "Origin": "http://attacker.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    responses = [
        client.options("/api/run", headers=preflight),
        client.post("/api/run", json=BODY, headers=preflight),
        client.post("/api/run", json=BODY),
    ]
    responses += [
        client.get(path, headers={"Origin": "http://attacker.example"}) for path in get_paths(app)
    ]
    for response in responses:
        assert not [h for h in response.headers if h.lower().startswith("access-control-")], (
            response.headers
        )


def test_a_cors_header_set_by_a_route_is_dropped():
    """Belt and braces: even a route (or a library) that sets Access-Control-Allow-Origin cannot
    grant it."""
    app = create_app({"gpt": small_models()["gpt"]})

    @app.get("/api/leaky")
    def leaky():
        from fastapi.responses import JSONResponse

        return JSONResponse(
            {},
            headers={
                "Access-Control-Allow-Origin": "*",
                "Access-Control-Allow-Credentials": "true",
            },
        )

    response = TestClient(app, base_url=LOCAL).get("/api/leaky")
    assert response.status_code == 200
    assert (
        "access-control-allow-origin" not in response.headers
        and "access-control-allow-credentials" not in response.headers
    )


def test_every_response_carries_the_security_headers(app, client):
    responses = [client.get(path) for path in get_paths(app)]
    # 200 and 422
    responses += [
        client.post("/api/run", json=BODY),
        client.post("/api/run", json={}),
        client.get("/", headers={"Host": "attacker.example"}),
    ]  # and a refusal
    html = [r for r in responses if r.headers.get("content-type", "").startswith("text/html")]
    assert len(html) >= 2  # the page and /docs
    for response in responses:
        assert response.headers["content-security-policy"] == CSP, response.url
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"


def test_the_csp_allows_only_the_pages_own_origin():
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["default-src"] == "'self'"
    for name in ("script-src", "style-src", "connect-src"):
        # no 'unsafe-inline', no 'unsafe-eval', no other host
        assert directives[name] == "'self'", name
    assert directives["img-src"] == "'self' data:"
    assert directives["frame-ancestors"] == "'none'" and directives["object-src"] == "'none'"
    assert not any(s in CSP for s in ("*", "http:", "https:", "unsafe"))


@pytest.mark.parametrize("path", ["/", "/docs"])
def test_html_pages_have_no_inline_script_or_style_for_the_csp_to_block(client, path):
    from html.parser import HTMLParser

    inline = []

    class Finder(HTMLParser):
        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if (
                (tag == "script" and "src" not in attrs)
                or tag == "style"
                or "style" in attrs
                or any(name.startswith("on") for name in attrs)
            ):
                inline.append((tag, attrs))

    Finder().feed(client.get(path).text)
    assert not inline


# The token: a server listening beyond this machine
# ---------------------------------------------------------
TOKEN = "b" * 48


@pytest.fixture(scope="module")
def exposed():
    """The app as `attnlab explore --host 0.0.0.0` builds it: any Host, and a token."""
    with TestClient(
        create_app({"gpt": small_models()["gpt"]}, hosts=["0.0.0.0"], token=TOKEN),
        base_url="http://192.168.1.5:8000",
    ) as c:
        yield c


def test_without_the_token_every_api_call_is_403(exposed):
    for method, path in [
        ("GET", "/api/models"),
        ("POST", "/api/run"),
        ("GET", "/api/models/gpt/head-scores"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
    ]:
        for auth in (
            {},
            {"Authorization": "token wrong"},
            {"Authorization": f"token {TOKEN[:-1]}"},
            {"Authorization": f"Basic {TOKEN}"},
        ):
            response = exposed.request(
                method, path, json=BODY if method == "POST" else None, headers=auth
            )
            assert response.status_code == 403, (path, auth, response.status_code)
            assert "token" in response.json()["detail"]
        assert (
            exposed.request(
                method, path + "?token=nope", json=BODY if method == "POST" else None
            ).status_code
            == 403
        )


def test_with_the_token_the_api_answers(exposed):
    assert (
        exposed.get("/api/models", headers={"Authorization": f"token {TOKEN}"}).status_code == 200
    )
    assert (
        exposed.get("/api/models", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    )
    assert exposed.get(f"/api/models?token={TOKEN}").status_code == 200
    assert (
        exposed.post("/api/run", json=BODY, headers={"Authorization": f"token {TOKEN}"}).status_code
        == 200
    )
    # the page and its files carry no data: they load without it (the page then reads the token from
    # its URL)
    assert exposed.get("/").status_code == 200 and exposed.get("/static/app.js").status_code == 200
    # the token does not excuse a cross-site POST
    response = exposed.post(
        "/api/run",
        json=BODY,
        headers={"Authorization": f"token {TOKEN}", "Origin": "http://attacker.example"},
    )
    assert response.status_code == 403


def test_a_named_host_is_accepted_with_the_loopback_names_and_nothing_else():
    app = create_app({"gpt": small_models()["gpt"]}, hosts=["192.168.1.5"], token=TOKEN)
    c = TestClient(
        app, base_url="http://192.168.1.5:8000", headers={"Authorization": f"token {TOKEN}"}
    )
    assert c.get("/api/models").status_code == 200
    assert c.get("/api/models", headers={"Host": "localhost:8000"}).status_code == 200
    assert c.get("/api/models", headers={"Host": "attacker.example"}).status_code == 400


def test_a_body_over_the_limit_is_413_before_it_is_parsed(client):
    from attnlab.explorer.app import MAX_BODY_BYTES

    big = json.dumps({"model": "gpt", "text": "x" * MAX_BODY_BYTES}).encode()
    response = client.post("/api/run", content=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.headers["content-type"] == "application/json"

    def chunks():  # no Content-Length: the limit counts the bytes as they arrive
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    response = client.post(
        "/api/run", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
