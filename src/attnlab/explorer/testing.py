"""The explorer started for a script or a test (the tests, benchmarks/ and docs/screenshots/), on
127.0.0.1 and a free port; never used by the commands themselves.

Design choices:
- `serving(app)` runs uvicorn in a thread of the caller (an app built in the same process).
- `explorer_process(ARGS)` runs `attnlab explore ARGS` in a process of its own, as a user runs it
  (its memory and its event loop its own), and reads the URL line `serve` prints (URL_LINE).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .server import URL_LINE, bind, url_of


@contextmanager
def serving(app, start_timeout: float = 60) -> Iterator[str]:
    """uvicorn serving `app` (create_app's) in a thread of this process on 127.0.0.1 and a free
    port, for a
    script or a test: yields the page's URL once the server accepts, and stops the server on
    leaving."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the explorer's server did not start")
        time.sleep(0.05)
    try:
        yield url_of("127.0.0.1", sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def explorer_process(*args: str, **popen) -> Iterator[tuple[subprocess.Popen, str]]:
    """`attnlab explore ARGS --port 0` in a process of its own (its memory and its event loop its
    own, as when a user runs it), for a script or a test; `popen` goes to subprocess.Popen (env,
    cwd). Yields the process and the URL it prints, once it prints it; stops the process on
    leaving."""
    process = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "explore", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    try:
        for line in process.stdout:  # a warning or a note may come first
            found = URL_LINE.match(line.rstrip("\n"))
            if found:
                break
        else:
            process.wait(timeout=30)
            raise RuntimeError(
                f"attnlab explore {' '.join(args)} did not start (exit {process.returncode}): "
                f"{process.stderr.read().strip()}"
            )
        yield process, found.group(1)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        process.stdout.close()
        process.stderr.close()
