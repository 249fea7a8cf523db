"""Admission control: refuse search requests with HTTP 429 while the server holds as many as it can serve.

It counts a request from when its body has been read (:mod:`.body`) until it is answered,
so a slow upload never takes a slot; it refuses before the body is parsed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from .metrics import Metrics

RECEIVED_KEY = "gpusparse.received"  # the scope key where admission notes when a request arrived


class AdmissionControl:
    """Pure ASGI middleware: refuse ``POST path`` with 429 at once while ``limit`` are in flight.

    It runs before routing, after :class:`~.body.BodyReader` has read the body (within its
    size limit and deadline) and before the body is parsed, so a refusal costs the server
    little more than receiving the bytes: under overload the event loop stays free to
    answer, instead of parsing, validating and queueing requests it will refuse anyway.
    ``metrics.in_flight`` counts the requests admitted and not yet answered; the time of
    admission goes into the scope (``RECEIVED_KEY``) for the latency metric.
    """

    def __init__(self, app: Any, *, path: str, limit: int, metrics: Metrics, message: str) -> None:
        self.app, self.path, self.limit, self.metrics = app, path, limit, metrics
        self._body = json.dumps({"detail": message}).encode()
        self._headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self._body)).encode()),
            (b"retry-after", b"1"),
        ]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        if metrics.in_flight >= self.limit:
            metrics.observe_request(429, 0.0, 0)
            await send({"type": "http.response.start", "status": 429, "headers": self._headers})
            await send({"type": "http.response.body", "body": self._body})
            return
        scope[RECEIVED_KEY] = time.perf_counter()
        metrics.in_flight += 1  # only the event loop's thread touches it
        try:
            await self.app(scope, receive, send)
        finally:
            metrics.in_flight -= 1
