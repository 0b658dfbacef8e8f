"""The generation view's stream: a prompt (or a chat message through the model's chat template)
generated token by token by attnlab.generate.watch, each step sent to the page as one line of JSON
as soon as it is computed (NDJSON over chunked HTTP: no websocket, nothing to download).

Design choices:
- What a request can get wrong is checked before the first byte (`open_generation`): an unknown
  model or step 404, an encoder or a model without a chat template 409, a prompt over the limit or
  one that leaves no room to generate 413. After that the answer is 200, and a failure mid-stream
  is a last line {"event": "error", "detail": ...}.
- The model runs in a thread of its own, under the model's lock (hooks live on the shared
  modules); its lines reach the event loop through an asyncio queue. When the page stops (its Stop
  button aborts the request) or closes, the server sees the connection close, the response is
  cancelled, and the generating thread's next step raises `Stopped`: generation ends within one
  token, and it leaves `Explorer.generations` (the streams being generated).
  - The lines: "start" (the prompt's tokens, the budget, the KV cache's bytes per position and the
  length it allocates, the decode step that runs: attnlab's C decode program, or the modules and why
  the C step does not apply to this model), one "token" per new token (id, string, the text it adds,
  every head's attention row of the step that wrote it as one [n_layers · n_heads, key_pos] matrix
  encoded as the pattern view's are, the top candidates with their probabilities, the positions in
  the KV cache, the step's time), and "end" (why it ended, tokens per second on the server, the
  text).
- Candidates are the distribution the token is drawn from (temperature, top-k, top-p); with
  temperature 0 (greedy) the model's own softmax, whose most likely token wins.
- One stream holds the work queue's slot (work_queue.py) for as long as it runs, as any computation
  does: other requests wait until it ends or is stopped.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from ..errors import UserError
from ..formats.gguf_tokenizer import chat_ids
from ..generate.kv_cache import buffer_length, bytes_per_position
from ..generate.sample import TextStream
from ..generate.sampling import filter_logits
from ..generate.watch import Step, decode_path, generate_watched
from .encoding import encode_matrix
from .models import ModelEntry, TextTooLong, Unsupported, Variant

MAX_NEW_TOKENS = 1024  # the most tokens one request may ask for


class Stopped(Exception):
    """Raised in the generating thread when the page has gone (Stop, or closed)."""


class _Pieces:
    """A file for TextStream: what it writes is the text the latest token added."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self.text = self.text, ""
        return text


class Generation:
    """One checked request, ready to stream (`lines`)."""

    def __init__(self, explorer, entry: ModelEntry, ids: list[int], tokens: list[str], request):
        self.explorer, self.entry, self.ids, self.tokens, self.request = (
            explorer,
            entry,
            ids,
            tokens,
            request,
        )
        model = entry.model
        limit = min(explorer.served.token_limit(model), model.config.n_ctx)
        self.budget = min(request.max_new_tokens, limit - len(ids))
        if self.budget < 1:
            raise TextTooLong(
                f"the prompt is {len(ids)} tokens and model {entry.name!r} takes at most {limit}: "
                "no room to generate; shorten it"
            )
        self.end_of_turn = model.config.extra.get("eos_token_id") if request.chat else None
        self.stop = threading.Event()

    def start_event(self) -> dict[str, Any]:
        model, r = self.entry.model, self.request
        per_position = bytes_per_position(model)
        path, why = decode_path(model)
        return {
            "event": "start",
            "model": self.entry.name,
            "chat": r.chat,
            "prompt_ids": self.ids,
            "prompt_tokens": self.tokens,
            "prompt_text": model.tokenizer.decode(self.ids),
            "budget": self.budget,
            "n_layers": model.config.n_layers,
            "n_heads": model.config.n_heads,
            "n_kv_heads": model.config.n_kv_heads,
            "d_head": model.config.d_head,
            "kv_bytes_per_position": per_position,
            "kv_allocated_positions": buffer_length(len(self.ids) + self.budget),
            # "kernels" (the C decode program) or "modules", and why the C step does not apply
            "decode": {"path": path, "reason": why},
            "settings": {
                "temperature": r.temperature,
                "top_k": r.top_k,
                "top_p": r.top_p,
                "seed": r.seed,
                "end_of_turn": self.end_of_turn,
            },
        }

    def token_event(self, step: Step, stream: TextStream, pieces: _Pieces) -> dict[str, Any]:
        r, tokenizer = self.request, self.entry.model.tokenizer
        end = step.token == self.end_of_turn
        if not end:  # the end-of-turn token ends the reply and is not part of it (as `chat`)
            stream.push([step.token])
        logits = step.logits[None]  # [1, d_vocab]
        drawn_from = (
            filter_logits(logits, r.temperature, r.top_k, r.top_p) if r.temperature else logits
        )
        probs = torch.softmax(drawn_from, dim=-1)[0]
        top = torch.topk(probs, min(r.k, probs.shape[-1]))
        L, H, S = step.rows.shape
        return {
            "event": "token",
            "index": step.index,
            "id": step.token,
            "token": tokenizer.label(step.token),
            "piece": pieces.take(),
            "end_of_turn": end,
            "prob": _finite(float(probs[step.token])),
            "candidates": [
                {
                    "id": i,
                    "token": tokenizer.label(i),
                    "piece": tokenizer.decode([i]),
                    "prob": _finite(p),
                    "logit": _finite(float(logits[0, i])),
                }
                for p, i in zip(top.values.tolist(), top.indices.tolist())
            ],
            "rows": encode_matrix(step.rows.reshape(L * H, S), r.encoding),  # [layer·head, key]
            "kv_positions": step.index,  # keys 0 … index − 1 are cached when the step has run
            "step_ms": 1000 * step.seconds,
        }

    def run(self, emit) -> None:
        """Generate, emitting each line (a dict) as it is ready; in the generating thread."""
        r, model = self.request, self.entry.model
        pieces = _Pieces()
        stream = TextStream(model.tokenizer, file=pieces)
        stream.push(self.ids)  # the prompt: the first token decodes in its context
        pieces.take()
        written: list[int] = []
        start = time.perf_counter()
        reason = "max_new_tokens"

        def on_step(step: Step) -> None:
            nonlocal reason
            if self.stop.is_set():
                raise Stopped
            written.append(step.token)
            if step.token == self.end_of_turn:
                reason = "end_of_turn"
            emit(self.token_event(step, stream, pieces))

        try:
            with self.entry.lock:
                generate_watched(
                    model,
                    torch.tensor([self.ids]),
                    self.budget,
                    on_step,
                    temperature=r.temperature,
                    top_k=r.top_k,
                    top_p=r.top_p,
                    seed=r.seed,
                    eos_token_id=self.end_of_turn,
                )
        except Stopped:
            return
        except UserError as exc:
            emit({"event": "error", "detail": str(exc)})
            return
        seconds = time.perf_counter() - start
        stream.finish()
        reply = [t for t in written if t != self.end_of_turn]
        emit(
            {
                "event": "end",
                "reason": reason,
                "tokens": len(written),
                "seconds": seconds,
                "tokens_per_s": len(written) / seconds if seconds > 0 else None,
                "tail": pieces.take(),  # a character held back at the last token, if any
                "text": model.tokenizer.decode(reply),
                "ids": self.ids + written,
            }
        )

    async def lines(self) -> AsyncIterator[bytes]:
        """The stream: one JSON line per event, as the generating thread makes them."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event: dict[str, Any] | None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is gone: nobody is listening
                self.stop.set()

        def work() -> None:
            try:
                self.run(emit)
            except Exception as exc:  # a bug: said on the stream, not lost in a thread
                emit({"event": "error", "detail": f"generation failed: {exc!r}"})
            finally:
                self.explorer.generations.discard(self)
                emit(None)

        yield _line(self.start_event())
        self.explorer.generations.add(self)
        thread = threading.Thread(target=work, name="attnlab-generate", daemon=True)
        thread.start()
        try:
            while (event := await queue.get()) is not None:
                yield _line(event)
        finally:  # the stream ended, or the page went (the response was cancelled)
            self.stop.set()


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity (a temperature so small that the logits overflow): null."""
    return x if math.isfinite(x) else None


def _line(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, ensure_ascii=False, allow_nan=False) + "\n").encode()


def open_generation(explorer, request) -> Generation:
    """The request checked (UserErrors with their HTTP statuses, app.STATUSES), not yet started."""
    served = explorer.served
    entry = served.entry(request.model, Variant(step=request.step))
    model = entry.model
    if not model.config.causal:
        raise Unsupported(
            f"model {entry.name!r} is an encoder (not causal): it does not generate; "
            "pick a causal model"
        )
    if request.chat:
        if not isinstance(model.config.extra.get("chat_template"), str):
            raise Unsupported(
                f"model {entry.name!r} has no chat template (a GGUF file carries one); "
                "untick chat to continue the text as a prompt"
            )
        served.encode(entry, request.text)  # the message's own limits, as every view checks
        ids = chat_ids(model, [{"role": "user", "content": request.text}])
        if len(ids) > served.token_limit(model):
            raise TextTooLong(
                f"the chat prompt is {len(ids)} tokens; the explorer's limit for model "
                f"{entry.name!r} is {served.token_limit(model)} tokens; shorten the message"
            )
        tokens = [model.tokenizer.label(i) for i in ids]
    else:
        ids_tensor, tokens = served.encode(entry, request.text)
        ids = ids_tensor[0].tolist()
    return Generation(explorer, entry, ids, tokens, request)
