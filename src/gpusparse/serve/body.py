"""Reading request bodies before anything else is spent on them: a size limit, a deadline, shutdown.

:class:`BodyReader` reads the whole body of ``POST /search`` before admission control counts
the request, so a client that trickles its body holds a connection (capped per client
address by :mod:`.run`) but never a slot of the batch queue. It answers, and closes the
connection:

- 413 when ``Content-Length`` says more than ``max_bytes``, before reading anything, or
  when a body without one (chunked) grows past ``max_bytes`` while it streams in;
- 408 when the whole body has not arrived ``timeout_s`` after the headers;
- 503 when the server starts shutting down (:class:`Drain`) while the body is still coming,
  so a stalled upload does not hold up SIGTERM.

The body read is handed on to the app as a single message; ``scope[BODY_KEY]`` holds it too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from .metrics import Metrics

BODY_KEY = "gpusparse.body"  # the scope key where the body read goes


class Drain:
    """Set when the server begins to shut down: wakes every request still waiting for its body.

    Only the event loop's thread touches it (:meth:`start` is called by the server's
    shutdown, on the loop).
    """

    def __init__(self) -> None:
        self.draining = False
        self._waiting: set[asyncio.Timeout] = set()

    def start(self) -> None:
        """Refuse bodies still arriving (503) and any that start arriving from now on."""
        self.draining = True
        if self._waiting:
            now = asyncio.get_running_loop().time()
            for timeout in list(self._waiting):
                timeout.reschedule(now)  # their deadline is now: they wake and answer 503


def problem(status: int, detail: str, *, close: bool = True, extra: list[tuple[bytes, bytes]] | None = None) -> tuple:
    """The ASGI ``(start, body)`` messages of a JSON ``{"detail": ...}`` answer."""
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the body was not read (whole): do not read the rest to find the next request
        headers.append((b"connection", b"close"))
    headers += extra or []
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


class BodyReader:
    """Pure ASGI middleware reading the body of ``POST path`` in full, within limits (see the module)."""

    def __init__(
        self, app: Any, *, path: str, max_bytes: int, timeout_s: float, drain: Drain, metrics: Metrics
    ) -> None:
        self.app, self.path, self.max_bytes, self.timeout_s = app, path, max_bytes, timeout_s
        self.drain, self.metrics = drain, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        answer = await self._read(scope, receive)
        if answer is None:
            return  # the client went away
        if isinstance(answer, tuple):
            self.metrics.observe_request(answer[0]["status"], 0.0, 0)
            for message in answer:
                await send(message)
            return
        scope[BODY_KEY] = answer
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": answer, "more_body": False}
            return await receive()  # after the body: only http.disconnect can come

        await self.app(scope, replay, send)

    async def _read(self, scope: dict, receive: Callable) -> bytes | tuple | None:
        """The body; or the messages of a refusal; or None if the client disconnected."""
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:  # the HTTP parser frames the body by it, so it is a number; be safe anyway
                    declared = int(value)
                except ValueError:
                    return problem(400, "malformed Content-Length header")
                if declared > self.max_bytes:
                    return problem(413, self._too_large())
                break
        if self.drain.draining:
            return problem(503, "the server is shutting down")
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        self.metrics.reading += 1
        try:
            async with asyncio.timeout_at(loop.time() + self.timeout_s) as deadline:
                self.drain._waiting.add(deadline)
                try:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            return None
                        chunk = message.get("body", b"")
                        size += len(chunk)
                        if size > self.max_bytes:
                            return problem(413, self._too_large())
                        chunks.append(chunk)
                        if not message.get("more_body", False):
                            break
                finally:
                    self.drain._waiting.discard(deadline)
        except TimeoutError:
            if self.drain.draining:
                return problem(503, "the server is shutting down")
            return problem(408, f"the request body did not arrive within {self.timeout_s:g} s")
        finally:
            self.metrics.reading -= 1
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_bytes:,} bytes (--max-body-bytes)"
