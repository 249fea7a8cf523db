"""The endpoints: ``POST /search`` (parse, validate, queue, answer), ``GET /health``, ``GET /metrics``.

``/search`` parses small bodies on the event loop and large ones in a thread; it never
answers a non-finite score (JSON has none): such a request gets 400.

Imported only when an app is created (it imports fastapi).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations at run time.
import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from ..errors import InputError
from .admission import RECEIVED_KEY
from .batcher import DynamicBatcher, PendingRequest, QueueFullError, ShuttingDownError
from .body import BODY_KEY
from .config import ServerConfig
from .metrics import Metrics
from .schemas import SEARCH_RESPONSES, SearchRequest, SearchResponse
from .validate import check_queries, decode_request, describe_validation_errors

if TYPE_CHECKING:
    from ..encode import SpladeEncoder
    from ..index import Index

JSON_HEADERS = {"content-type": "application/json"}
INLINE_PARSE_BYTES = 64 << 10  # bodies up to this size are parsed on the event loop (< ~2 ms)
PARSE_THREADS = 2
SCORE_OVERFLOW = "a score overflows float32: the query's weights are too large"


class Refused(Exception):
    """A request refused while parsing: HTTP ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def add_search_route(
    app: FastAPI,
    index: "Index",
    encoder: "SpladeEncoder | None",
    config: ServerConfig,
    batcher: DynamicBatcher,
    metrics: Metrics,
) -> None:
    """Register ``POST /search`` on ``app``."""

    def _problem(status: int, message: str, t0: float) -> JSONResponse:
        metrics.observe_request(status, time.perf_counter() - t0, 0)
        return JSONResponse({"detail": message}, status_code=status)

    def parse(raw: bytes) -> tuple[int, list[str | tuple[np.ndarray, np.ndarray]]]:
        """``k`` and the checked queries of a body; raise :class:`Refused`."""
        try:
            decoded, vectors = decode_request(raw)  # the file reader's decoder
        except InputError as exc:
            raise Refused(400, exc.reason) from None
        try:
            body = SearchRequest.model_validate(decoded, strict=True)
        except ValidationError as exc:
            raise Refused(*describe_validation_errors(exc.errors())) from None
        if (body.query is None) == (body.queries is None):
            raise Refused(400, "give exactly one of 'query' and 'queries'")
        if body.query is not None:
            queries = [vectors.get(("query", None), body.query)]
        else:
            queries = [vectors.get(("queries", i), q) for i, q in enumerate(body.queries or [])]
        try:
            return body.k, check_queries(queries, body.k, index.vocab, has_encoder=encoder is not None, limits=config)
        except InputError as exc:
            raise Refused(400, exc.reason) from None

    # Parsing a large body takes the event loop for a while (~30 ms a MB on our CPU with the
    # reader's decoder, ~20 with pydantic's alone; then the query checks): those go to a
    # thread, two at a time, so the loop keeps answering and memory stays bounded.
    parse_slots = asyncio.Semaphore(PARSE_THREADS)
    # The body is decoded by the file reader's decoder and checked by pydantic (no FastAPI body
    # machinery); the answer is encoded once with json.dumps: this is the per-request path.
    request_schema = SearchRequest.model_json_schema()

    @app.post(
        "/search",
        response_model=SearchResponse,
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}}},
        responses=SEARCH_RESPONSES,  # type: ignore[arg-type]
    )
    async def search(request: Request) -> Response:
        """Exact top-k documents for each query."""
        t0 = request.scope.get(RECEIVED_KEY) or time.perf_counter()
        raw = request.scope.get(BODY_KEY)
        if raw is None:  # not behind BodyReader
            raw = await request.body()
        try:
            if len(raw) <= INLINE_PARSE_BYTES:
                k, queries = parse(raw)
            else:
                async with parse_slots:
                    k, queries = await asyncio.to_thread(parse, raw)
        except Refused as exc:
            return _problem(exc.status, exc.message, t0)
        if not queries:  # an empty list: no results, as Index.search answers no queries
            metrics.observe_request(200, time.perf_counter() - t0, 0)
            return Response(json.dumps({"k": k, "results": []}).encode(), headers=JSON_HEADERS)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def deliver(value: Any) -> None:  # called from the worker thread
            def settle() -> None:
                if future.done():
                    return
                if isinstance(value, BaseException):
                    future.set_exception(value)
                else:
                    future.set_result(value)

            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
                loop.call_soon_threadsafe(settle)

        pending = PendingRequest(queries, k, deliver)
        try:
            batcher.submit(pending)
        except QueueFullError as exc:
            return _problem(429, str(exc), t0)
        except ShuttingDownError as exc:
            return _problem(503, str(exc), t0)
        try:
            scores, ids = await asyncio.wait_for(future, config.request_timeout_s)
        except TimeoutError:
            pending.cancelled = True
            return _problem(504, f"not answered within {config.request_timeout_s:g} s", t0)
        except InputError as exc:
            return _problem(400, exc.reason, t0)
        except Exception as exc:
            return _problem(500, f"search failed: {type(exc).__name__}: {exc}", t0)
        names = index.ids
        results = []
        for srow, irow in zip(scores, ids, strict=True):
            keep = irow >= 0
            kept = srow[keep]
            if not np.isfinite(kept).all():  # JSON has no Infinity: refuse rather than answer non-JSON
                return _problem(400, SCORE_OVERFLOW, t0)
            results.append({"ids": [names[d] for d in irow[keep].tolist()], "scores": kept.tolist()})
        try:
            content = json.dumps({"k": k, "results": results}, separators=(",", ":"), allow_nan=False).encode()
        except ValueError as exc:  # cannot happen after the check above; never send non-JSON
            return _problem(500, f"search failed: {exc}", t0)
        metrics.observe_request(200, time.perf_counter() - t0, len(queries))
        return Response(content, headers=JSON_HEADERS)


def add_status_routes(
    app: FastAPI, index: "Index", encoder: "SpladeEncoder | None", config: ServerConfig, batcher: DynamicBatcher
) -> None:
    """Register ``GET /health`` and ``GET /metrics`` on ``app``."""
    metrics: Metrics = app.state.metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        """``status`` ok (200) or draining (503), and what is served."""
        body = {
            "status": "draining" if batcher.closing else "ok",
            "documents": index.n_docs,
            "device": str(index.device),
            "encoder": None if encoder is None else encoder.name,
            "engine": metrics.engine,  # of the latest search; null before the first
            "queue_depth": batcher.depth,
            "max_batch_size": config.max_batch_size,
            "max_wait_ms": config.max_wait_ms,
            "queue_size": config.queue_size,
        }
        return JSONResponse(body, status_code=503 if batcher.closing else 200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> PlainTextResponse:
        """Prometheus text exposition format 0.0.4."""
        return PlainTextResponse(metrics.render(batcher.depth), media_type="text/plain; version=0.0.4; charset=utf-8")
