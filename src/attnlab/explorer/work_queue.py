"""The bounded queue in front of model work: one request computes at a time, a fixed number wait, the rest get 503.

Design choices:
- Every request under /api/ is model work (a forward pass, a tokenization, head scores): the rule is the
  path, so a route added to the API is queued without asking for it.
- A forward pass is CPU-bound and torch already spreads one over every core, so running two at once
  only makes both slower: `workers` defaults to 1. Up to `capacity` requests are admitted (the one
  running and the ones waiting); the next one is answered 503 with `Retry-After` at once, before its
  body is read, instead of piling up threads behind a lock (gunicorn's backlog and Triton's
  max_queue_size make the same trade: refuse early, and say when to come back).
- Waiting happens in the event loop (an asyncio semaphore), not in a thread: an admitted request takes
  a thread of FastAPI's pool only when its turn comes. The semaphore belongs to the running loop and is
  made again if the loop changes (a TestClient starts one per `with` block).
- The admission count is guarded by a threading lock and never awaits, so a full queue's 503 costs no
  more than an HTTP round trip (benchmarks/README.md measures it).
"""

from __future__ import annotations

import asyncio
import threading

from starlette.types import ASGIApp, Receive, Scope, Send

from . import QUEUE

QUEUE_PREFIX = "/api/"
RETRY_AFTER_S = 1


class WorkQueue:
    """ASGI middleware: at most `workers` requests under /api/ run at once and `capacity` are admitted."""

    def __init__(self, app: ASGIApp, capacity: int = QUEUE, workers: int = 1) -> None:
        if not 1 <= workers <= capacity:
            raise ValueError(f"need 1 <= workers ({workers}) <= capacity ({capacity})")
        self.app = app
        self.capacity = capacity
        self.workers = workers
        self.admitted = 0  # running + waiting
        self.lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(QUEUE_PREFIX):
            return await self.app(scope, receive, send)
        with self.lock:
            full = self.admitted >= self.capacity
            if not full:
                self.admitted += 1
        if full:
            from starlette.responses import JSONResponse

            detail = (f"the explorer is busy: {self.capacity} requests are already running or waiting; "
                      f"retry in {RETRY_AFTER_S} s")
            response = JSONResponse({"detail": detail}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
            return await response(scope, receive, send)
        try:
            async with self.running():
                await self.app(scope, receive, send)
        finally:
            with self.lock:
                self.admitted -= 1

    def running(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._running = loop, asyncio.Semaphore(self.workers)
        return self._running
