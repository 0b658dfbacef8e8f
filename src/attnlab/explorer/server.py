"""Serving the explorer: a socket bound on 127.0.0.1 (or --host) and uvicorn on it.

Design choices:
- The server binds 127.0.0.1 unless --host says otherwise. The socket is bound here, before uvicorn
  starts, so a port in use is one clear line (and exit 2) rather than a log of tracebacks. Requests
  for any other Host header are refused (DNS rebinding); see security.py.
- A --host beyond this machine (0.0.0.0, a LAN address) prints a warning and, as Jupyter does, makes
  a token that the printed URL carries: without it every API call is refused (403).
- `serve` prints one line with the URL (URL_LINE matches it), which scripts and tests read
  (testing.py).
- uvicorn and FastAPI are imported inside the functions, not when the command line starts.
"""

from __future__ import annotations

import errno
import re
import socket

from ..errors import UserError
from . import QUEUE


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or a UserError that says the port is taken and what to
    do."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(
            f"cannot resolve --host {host!r} ({exc.strerror}); use an address such as 127.0.0.1"
        ) from None
    family, _, proto, _, address = infos[0]
    # proto named (IPPROTO_TCP), not left 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets
    # that say they are TCP, and with Nagle on, every answer written in two parts (headers, body)
    # waits for the client's delayed ACK before its second part (benchmarks/README.md)
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    # as uvicorn does: restart right after a stop
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is already in use (another explorer?); pass --port "
                f"{port + 1} "
                "or stop the program using it"
            ) from None
        raise UserError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pass another --host or --port"
        ) from None
    # listening already, so the URL works the moment it is printed: connections wait in the backlog
    # until uvicorn's loop accepts them
    sock.listen(2048)
    return sock


def url_of(host: str, port: int, token: str | None = None) -> str:
    url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
    return url + (f"?token={token}" if token else "")


# the line `serve` prints, on 127.0.0.1
URL_LINE = re.compile(r"^attnlab explorer: .* at (http://127\.0\.0\.1:\d+/)  \(Ctrl-C to stop\)$")


def serve(
    models: dict[str, object],
    host: str,
    port: int,
    max_tokens: int | None,
    runs: dict | None = None,
    queue: int = QUEUE,
) -> int:
    """Serve the explorer on host:port until Ctrl-C (`attnlab explore`, `attnlab experiment
    induction --explore`); `models`: name -> loaded model."""
    import uvicorn

    from .app import create_app
    from .security import is_loopback, new_token

    token = None if is_loopback(host) else new_token()
    app = create_app(
        models, max_tokens=max_tokens, runs=runs, hosts=[host], token=token, queue=queue
    )
    sock = bind(host, port)
    port = sock.getsockname()[1]
    if token:
        print(
            f"attnlab explore: warning: listening on {host}: other machines on your network can "
            "reach it; "
            "every request needs the token in the URL below (keep it to yourself)"
        )
    print(
        f"attnlab explorer: {', '.join(models)} at {url_of(host, port, token)}  (Ctrl-C to stop)",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0
