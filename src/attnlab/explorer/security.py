"""The explorer's guard: who may talk to it, and the headers every response carries (one ASGI
middleware).

A local server is reachable by every web page the user opens: a page cannot read another origin's
answers, but it can send requests, and with DNS rebinding it can make its own name point at
127.0.0.1. Jupyter's defences, which this follows (jupyter_server's `check_host`, `check_origin`,
token authentication):

- Host: a request whose Host header is not this server's name (a loopback name, or the --host it was
  started with) is refused with 400. That is the DNS-rebinding defence: the rebound page's requests
  carry the attacker's name. Listening on every interface (0.0.0.0, ::) names no host, so there the
  token is the defence and any Host is accepted.
- Origin: a request that changes or computes something (any method but GET, HEAD, OPTIONS) and
  carries an Origin other than the server's own (`http://<Host>`; "null" included) is refused with
  403, and so is one that a browser marks `Sec-Fetch-Site: cross-site`: a page elsewhere cannot make
  the server work for it.
- Bodies: a request body must be sent as application/json (415 otherwise), so a cross-site form or a
  `text/plain` "simple request" (which needs no CORS preflight) is never parsed as JSON. A body over
  `max_body` bytes is 413, in JSON like every refusal, as soon as the bytes received pass the limit
  (whatever its Content-Length claims; it is never read whole into memory first).
- Token: when the server listens beyond this machine it requires a token, as Jupyter does. The
  page's URL
  carries it (`/?token=...`); the page sends it back as `Authorization: token ...` (a query
  parameter `?token=` is accepted too, for curl). Every request but the page and its static files
  needs it (403 without); the comparison is constant-time.
- Headers on every response: a Content-Security-Policy that allows only the page's own origin (and
  data:
  images), `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer` (so the token in a URL
  never leaves in a Referer), and never a CORS header: any `Access-Control-*` header is dropped, so
  no other origin can ever be granted the right to read an answer.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from urllib.parse import parse_qs

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# listening everywhere: no single name to check the Host against
ANY_INTERFACE = ("0.0.0.0", "::", "")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# the page itself and (below) its static files: the same for everyone
PUBLIC_PATHS = ("/", "/favicon.ico")
PUBLIC_PREFIX = "/static/"

# Only this origin's scripts, styles, connections and images (plus data: images: the favicon,
# exported figures); no plugins, no <base> rewriting, no framing by another page, forms post only
# here.
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src "
    "'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def is_loopback(host: str) -> bool:
    """Whether --host names this machine only (so no token is needed)."""
    import ipaddress

    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_hex(24)


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port: 'localhost:8000' -> 'localhost', '[::1]:80' ->
    '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """ASGI middleware: Host, Origin, Content-Type and token checks, and the security headers
    (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        hosts: Iterable[str] = LOOPBACK_HOSTS,
        token: str | None = None,
        max_body: int | None = None,
    ) -> None:
        self.app = app
        self.max_body = max_body
        hosts = [h.lower() for h in hosts]
        self.any_host = any(h in ANY_INTERFACE for h in hosts)
        self.hosts = frozenset({*hosts, *LOOPBACK_HOSTS})
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if not k.lower().startswith(b"access-control-")
                ]
                present = {k.lower() for k, _ in headers}
                headers += [
                    (k.encode(), v.encode())
                    for k, v in SECURITY_HEADERS.items()
                    if k.encode() not in present
                ]
                message = {**message, "headers": headers}
            await send(message)

        refusal = self.refusal(scope)
        if refusal is not None:
            from starlette.responses import JSONResponse

            status, detail = refusal
            return await JSONResponse({"detail": detail}, status_code=status)(
                scope, receive, send_with_headers
            )
        if self.max_body is None:
            return await self.app(scope, receive, send_with_headers)
        received = 0

        async def receive_with_limit() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            # raised inside the route's body reading: FastAPI answers it in JSON
            if received > self.max_body:
                from starlette.exceptions import HTTPException

                raise HTTPException(
                    413, f"the request body is over the explorer's limit of {self.max_body:,} bytes"
                )
            return message

        await self.app(scope, receive_with_limit, send_with_headers)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when the request must be refused, else None."""
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if not self.any_host and host_name(host) not in self.hosts:
            return 400, (
                f"Host {host!r} is not this explorer's address; open it as http://127.0.0.1 or "
                "http://localhost "
                "(requests naming another host are refused: DNS rebinding)"
            )
        method = scope["method"]
        if method not in SAFE_METHODS:
            origin = headers.get("origin")
            scheme = scope.get("scheme", "http")
            if origin is not None and origin.lower() != f"{scheme}://{host}".lower():
                return (
                    403,
                    f"cross-origin request from {origin!r} refused: only the explorer's own page "
                    "may call its API",
                )
            if headers.get("sec-fetch-site") == "cross-site":
                return (
                    403,
                    "cross-site request refused: only the explorer's own page may call its API",
                )
        if (
            self.token is not None
            and not self.public(scope["path"], method)
            and not self.has_token(scope, headers)
        ):
            return 403, (
                "this explorer listens beyond this machine and needs its token: open the URL it "
                "printed "
                "(…/?token=...), or send the header 'Authorization: token ...'"
            )
        if (
            self.has_body(headers)
            and headers.get("content-type", "").split(";")[0].strip().lower() != "application/json"
        ):
            return (
                415,
                "send the request body as JSON, with the header 'Content-Type: application/json'",
            )
        return None

    @staticmethod
    def public(path: str, method: str) -> bool:
        return method in SAFE_METHODS and (path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX))

    def has_token(self, scope: Scope, headers: Headers) -> bool:
        scheme, _, value = headers.get("authorization", "").partition(" ")
        given = value.strip() if scheme.lower() in ("token", "bearer") else None
        if given is None:
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [None])[
                0
            ]
        return given is not None and secrets.compare_digest(given.encode(), self.token.encode())

    @staticmethod
    def has_body(headers: Headers) -> bool:
        return headers.get("content-length", "0") not in ("0", "") or "transfer-encoding" in headers
