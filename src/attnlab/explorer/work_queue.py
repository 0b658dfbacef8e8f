"""The bounded queue in front of model work: one request computes at a time, a fixed number wait,
the rest get 503.

Design choices:
- Every request under /api/ is model work (a forward pass, a tokenization, head scores): the rule is
  the path, so a route added to the API is queued without asking for it.
- A forward pass is CPU-bound and torch already spreads one over every core, so running two at once
  only makes both slower: `workers` defaults to 1. Up to `capacity` requests are admitted (the one
  running and the ones waiting); the next one is answered 503 with `Retry-After` at once, before its
  body is read, instead of piling up threads behind a lock (gunicorn's backlog and Triton's
  max_queue_size make the same trade: refuse early, and say when to come back).
- Waiting happens in the event loop (an asyncio semaphore), not in a thread: an admitted request
  takes a thread of FastAPI's pool only when its turn comes. The semaphore belongs to the running
  loop and is made again if the loop changes (a TestClient starts one per `with` block).
- The admission count is changed only by code running in the event loop, with no await between
  reading and writing it, so asyncio's one-coroutine-at-a-time is its only lock (no threading lock:
  the routes' threads never touch it). A full queue's 503 costs no more than an HTTP round trip
  (benchmarks/README.md measures it).
- Concurrency model: one event loop serves the app at a time. uvicorn runs one loop per process (its
  --workers are processes, each with its own WorkQueue), as the explorer and notebooks serve it; a
  TestClient runs one loop per `with` block. The count and the semaphore are not safe for one app
  served by two loops at once (two threads each running an event loop on it), which nothing here
  does.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from . import QUEUE

QUEUE_PREFIX = "/api/"
RETRY_AFTER_S = 1


class WorkQueue:
    """ASGI middleware: at most `workers` requests under /api/ run at once and `capacity` are
    admitted."""

    def __init__(self, app: ASGIApp, capacity: int = QUEUE, workers: int = 1) -> None:
        if not 1 <= workers <= capacity:
            raise ValueError(f"need 1 <= workers ({workers}) <= capacity ({capacity})")
        self.app = app
        self.capacity = capacity
        self.workers = workers
        self.admitted = 0  # running + waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(QUEUE_PREFIX):
            return await self.app(scope, receive, send)
        # no await from this check to the increment: atomic in the loop
        full = self.admitted >= self.capacity
        if not full:
            self.admitted += 1
        if full:
            from starlette.responses import JSONResponse

            detail = (
                f"the explorer is busy: {self.capacity} requests are already running or waiting; "
                f"retry in {RETRY_AFTER_S} s"
            )
            response = JSONResponse(
                {"detail": detail}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
            )
            return await response(scope, receive, send)
        try:
            async with self.running():
                await self.app(scope, receive, send)
        finally:
            self.admitted -= 1

    def running(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._running = loop, asyncio.Semaphore(self.workers)
        return self._running
