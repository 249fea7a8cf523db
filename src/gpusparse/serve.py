"""An HTTP/JSON search service with dynamic batching (``gpusparse serve``).

``POST /search`` takes one query or a list of them — text (encoded on the server by the
SPLADE encoder) or sparse vectors ``{"token": weight}`` — and ``k``; it answers the
documents' string ids and float32 scores, exactly those of :meth:`Index.search` for the
same query (only documents with a score > 0; fewer than ``k`` when fewer match).

Admission comes first: while ``queue_size + max_batch_size`` search requests are in flight
(received and not yet answered), a new one gets HTTP 429 at once, before its body is read
(:class:`AdmissionControl`), so overload costs the server little. Admitted requests are
validated (4xx with a one-line ``detail``), then wait in a bounded FIFO queue (HTTP 429
when it is full). One worker thread owns the device: it takes the
oldest request, then keeps adding whole requests, oldest first, until the batch holds
``max_batch_size`` queries or ``max_wait_ms`` have passed since the oldest one arrived; it
encodes the batch's texts in one call, searches the whole batch once with the largest
``k`` in it and trims each request's rows to its own ``k`` (an exact top-k with a fixed
tie-break is a prefix of a larger one). When idle a request is served after ``max_wait_ms``
in a small batch; under load the queue fills and batches grow. A request waiting longer
than ``request_timeout_s`` gets HTTP 504 and is dropped from the queue. On shutdown the
service stops taking requests (503) and the worker finishes those already queued.

``GET /health`` and ``GET /metrics`` (Prometheus text format) report on the service;
FastAPI serves the OpenAPI schema at ``/openapi.json`` and its docs at ``/docs``.

``fastapi`` and ``uvicorn`` are optional (``pip install 'gpusparse[serve]'``); this module
imports them when an app is created, never when it is imported.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations
# at run time, and the request models are defined inside ``create_app``.
import asyncio
import collections
import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .collection import SparseCollection, _check_weights
from .errors import InputError

if TYPE_CHECKING:
    from .encode import SpladeEncoder
    from .index import Index
    from .vocab import Vocabulary

INSTALL_HINT = "the search server needs fastapi and uvicorn: pip install 'gpusparse[serve]'"
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_QUEUE_SIZE = 1024
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_MAX_QUERY_TERMS = 1024
DEFAULT_MAX_QUERIES_PER_REQUEST = 256
DEFAULT_MAX_TEXT_CHARS = 10_000
QUEUE_FULL = "the request queue is full ({queue_size} requests); retry later"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def require_server_stack() -> None:
    """Raise :class:`ImportError` with an install hint unless fastapi and uvicorn import."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


# -- the batcher ----------------------------------------------------------------------------


@dataclass(eq=False)
class PendingRequest:
    """One validated request waiting for the worker.

    ``queries`` holds, per query, either a text or canonical ``(term ids, weights)`` arrays;
    the worker calls ``deliver`` (thread-safe) with ``(scores, ids)`` rows or an exception.
    """

    queries: list[str | tuple[np.ndarray, np.ndarray]]
    k: int
    deliver: Callable[[Any], None]
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False

    @property
    def size(self) -> int:
        return len(self.queries)


class QueueFullError(Exception):
    """The request queue is full (HTTP 429)."""


class ShuttingDownError(Exception):
    """The service is draining and takes no new requests (HTTP 503)."""


class DynamicBatcher:
    """A bounded FIFO of requests and the one worker thread that serves them in batches.

    Args:
        run_batch: called by the worker with a list of requests; answers each one.
        max_batch_size: queries per batch (a single larger request is served alone, whole).
        max_wait_s: how long the oldest request of a batch waits for company.
        queue_size: requests waiting at most; :meth:`submit` refuses more.
        on_batch: called with the number of queries of each batch (metrics).
    """

    def __init__(
        self,
        run_batch: Callable[[list[PendingRequest]], None],
        *,
        max_batch_size: int,
        max_wait_s: float,
        queue_size: int,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.queue_size = queue_size
        self._on_batch = on_batch
        self._queue: collections.deque[PendingRequest] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the batch being served)."""
        return len(self._queue)

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> None:
        """Start the worker (idempotent)."""
        with self._cond:
            if self._thread is None and not self._closing:
                self._thread = threading.Thread(target=self._work, name="gpusparse-batcher", daemon=True)
                self._thread.start()

    def submit(self, request: PendingRequest) -> None:
        """Queue ``request``; raise :class:`QueueFullError` or :class:`ShuttingDownError`."""
        self.start()
        with self._cond:
            if self._closing:
                raise ShuttingDownError("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFullError(QUEUE_FULL.format(queue_size=self.queue_size))
            self._queue.append(request)
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, serve those queued, stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _next_batch(self) -> list[PendingRequest] | None:
        with self._cond:
            while True:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return None  # closing and drained
                first = self._queue.popleft()
                if not first.cancelled:
                    break
            batch, n = [first], first.size
            deadline = first.enqueued + self.max_wait_s
            while n < self.max_batch_size:
                if self._queue:
                    nxt = self._queue[0]
                    if nxt.cancelled:
                        self._queue.popleft()
                        continue
                    if n + nxt.size > self.max_batch_size:
                        break
                    batch.append(self._queue.popleft())
                    n += nxt.size
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing:
                    break
                self._cond.wait(remaining)
            return batch

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            batch = [r for r in batch if not r.cancelled]
            if not batch:
                continue
            if self._on_batch is not None:
                self._on_batch(sum(r.size for r in batch))
            try:
                self._run_batch(batch)
            except BaseException as exc:  # answer every request, whatever happened
                for r in batch:
                    r.deliver(exc)


def search_batch(
    index: "Index",
    batch: Sequence[PendingRequest],
    *,
    encoder: "SpladeEncoder | None" = None,
    search_kwargs: dict[str, Any] | None = None,
) -> None:
    """Serve ``batch``: encode its texts in one call, search once with the largest ``k``, trim, deliver."""
    queries = [q for r in batch for q in r.queries]
    texts = [q for q in queries if isinstance(q, str)]
    if texts:
        if encoder is None:  # validation refuses texts without an encoder; be safe
            raise RuntimeError("no encoder for text queries")
        encoded = encoder.encode_queries(texts)
        it = iter(range(len(texts)))
        rows = []
        for q in queries:
            if isinstance(q, str):
                i = next(it)
                a, b = int(encoded.indptr[i]), int(encoded.indptr[i + 1])
                rows.append((encoded.indices[a:b], encoded.values[a:b]))
            else:
                rows.append(q)
    else:
        rows = queries  # type: ignore[assignment]
    lengths = np.fromiter((len(t) for t, _ in rows), dtype=np.int64, count=len(rows))
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    indices = np.concatenate([t for t, _ in rows]) if rows else np.zeros(0, np.int32)
    values = np.concatenate([w for _, w in rows]) if rows else np.zeros(0, np.float32)
    coll = SparseCollection(indptr, indices, values, vocab=index.vocab, check_ids=False)
    k = max(r.k for r in batch)
    res = index.search(coll, k, **(search_kwargs or {}))
    scores, ids = res.scores.numpy(), res.ids.numpy()
    row = 0
    for r in batch:
        r.deliver((scores[row : row + r.size, : r.k], ids[row : row + r.size, : r.k]))
        row += r.size


# -- metrics --------------------------------------------------------------------------------


class Histogram:
    """A Prometheus histogram: cumulative buckets, sum and count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = sorted(buckets)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.bounds, self.counts, strict=True):
            cum += c
            out.append(f'{name}_bucket{{le="{_num(b)}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


def _num(x: float) -> str:
    if isinstance(x, int) or (math.isfinite(x) and x == int(x) and abs(x) < 1e15):
        return str(int(x))
    return repr(float(x))


class Metrics:
    """Counters and histograms of the service, rendered in Prometheus text format 0.0.4."""

    def __init__(self, max_batch_size: int) -> None:
        self._lock = threading.Lock()
        self.requests: dict[int, int] = collections.Counter()
        self.queries = 0
        self.in_flight = 0
        bounds = [1 << i for i in range(max(1, max_batch_size).bit_length())]
        if bounds[-1] < max_batch_size:
            bounds.append(max_batch_size)
        self.batch_size = Histogram(bounds)
        self.latency = Histogram(LATENCY_BUCKETS)

    def observe_batch(self, n_queries: int) -> None:
        with self._lock:
            self.batch_size.observe(n_queries)

    def observe_request(self, status: int, seconds: float, n_queries: int) -> None:
        with self._lock:
            self.requests[status] += 1
            if status == 200:
                self.queries += n_queries
                self.latency.observe(seconds)

    def render(self, queue_depth: int) -> str:
        with self._lock:
            lines = [
                "# HELP gpusparse_requests_total Search requests answered, by HTTP status.",
                "# TYPE gpusparse_requests_total counter",
            ]
            lines += [f'gpusparse_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += [
                "# HELP gpusparse_queries_total Queries answered successfully.",
                "# TYPE gpusparse_queries_total counter",
                f"gpusparse_queries_total {self.queries}",
                "# HELP gpusparse_queue_depth Requests waiting for the worker.",
                "# TYPE gpusparse_queue_depth gauge",
                f"gpusparse_queue_depth {queue_depth}",
                "# HELP gpusparse_requests_in_flight Search requests received and not yet answered.",
                "# TYPE gpusparse_requests_in_flight gauge",
                f"gpusparse_requests_in_flight {self.in_flight}",
                "# HELP gpusparse_batch_size Queries per search batch.",
                "# TYPE gpusparse_batch_size histogram",
                *self.batch_size.lines("gpusparse_batch_size"),
                "# HELP gpusparse_request_latency_seconds Time from receiving a search request to answering it (200s).",
                "# TYPE gpusparse_request_latency_seconds histogram",
                *self.latency.lines("gpusparse_request_latency_seconds"),
            ]
        return "\n".join(lines) + "\n"


# -- request checking -----------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_query_terms: int = DEFAULT_MAX_QUERY_TERMS
    max_queries_per_request: int = DEFAULT_MAX_QUERIES_PER_REQUEST
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS


def check_queries(
    queries: Sequence[object], k: int, index: "Index", *, has_encoder: bool, limits: Limits
) -> list[str | tuple[np.ndarray, np.ndarray]]:
    """Validate a request's queries and ``k``; sparse ones become canonical ``(term ids, weights)``.

    Raises:
        InputError: with a message naming the query at fault (HTTP 400).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"k must be a positive integer, not {k!r}", field="k")
    if k > index.n_docs:
        raise InputError(f"k = {k} is larger than the collection ({index.n_docs:,} documents)", field="k")
    if not queries:
        raise InputError("no queries: give 'query' or a non-empty 'queries' list", field="queries")
    if len(queries) > limits.max_queries_per_request:
        raise InputError(
            f"{len(queries)} queries in one request; at most {limits.max_queries_per_request}", field="queries"
        )
    out: list[str | tuple[np.ndarray, np.ndarray]] = []
    for i, q in enumerate(queries):
        where = f"query {i}: " if len(queries) > 1 else ""
        if isinstance(q, str):
            if not q.strip():
                raise InputError(f"{where}empty query text", field="queries")
            if not has_encoder:
                raise InputError(
                    f"{where}text queries need an encoder; start the server with --model, or send "
                    '{"token": weight} vectors',
                    field="queries",
                )
            if len(q) > limits.max_text_chars:
                raise InputError(
                    f"{where}text of {len(q):,} characters; at most {limits.max_text_chars:,}", field="queries"
                )
            out.append(q)
            continue
        if not isinstance(q, dict):
            raise InputError(f"{where}a query is a text or a {{token: weight}} object", field="queries")
        if not q:
            raise InputError(f"{where}empty query vector", field="queries")
        if len(q) > limits.max_query_terms:
            raise InputError(f"{where}{len(q):,} query terms; at most {limits.max_query_terms:,}", field="queries")
        try:
            terms, weights = canonical_vector(q, index.vocab)
        except (InputError, TypeError) as exc:
            reason = exc.reason if isinstance(exc, InputError) else str(exc)
            raise InputError(f"{where}{reason}", field="queries") from None
        if terms.size == 0:
            raise InputError(f"{where}every weight is zero", field="queries")
        out.append((terms, weights))
    return out


def canonical_vector(vector: dict[str, float], vocab: "Vocabulary") -> tuple[np.ndarray, np.ndarray]:
    """``(term ids, weights)`` of one ``{token: weight}`` query, as :meth:`SparseCollection.from_dicts` makes them.

    Term ids ascending (int32), float32 weights with zeros dropped; the same checks and
    messages (unknown token, negative, non-finite or float32-overflowing weight). This is
    the per-request path of the server, so it skips building a collection: a vocabulary
    lookup per token and a few small numpy calls.
    """
    get = vocab.get
    term_ids = [get(token) for token in vector]
    if None in term_ids:
        token = next(t for t, i in zip(vector, term_ids, strict=True) if i is None)
        raise InputError(f"unknown token {token!r}", field="vector")
    try:
        weights = np.fromiter(vector.values(), dtype=np.float64, count=len(vector))
    except (TypeError, ValueError):
        raise TypeError("weights must be numbers") from None
    _check_weights(weights)
    terms = np.array(term_ids, dtype=np.int32)
    order = np.argsort(terms, kind="stable")
    terms = terms[order]
    if terms.size > 1 and bool((terms[1:] == terms[:-1]).any()):
        # Two spellings of one term (an integer vocabulary's "7" and "07"): summed, the slow way.
        coll = SparseCollection.from_dicts([vector], vocab=vocab, unknown="error")
        return coll.indices, coll.values
    values = weights[order].astype(np.float32)
    keep = values != 0
    return terms[keep], values[keep]


def describe_validation_errors(errors: list[Any]) -> tuple[int, str]:
    """HTTP status (400 for malformed JSON, else 422) and a one-line message for pydantic's errors."""
    # A union (text or vector) fails once per branch: report the deepest, most specific error.
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    status = 400 if first.get("type") == "json_invalid" else 422
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "str", "dict[str,float]"))
    if first.get("type") == "json_invalid":
        message = f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg', 'invalid'))}"
    else:
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return status, message


# -- admission control ----------------------------------------------------------------------

RECEIVED_KEY = "gpusparse.received"  # the scope key where admission notes when a request arrived


class AdmissionControl:
    """Pure ASGI middleware: refuse ``POST path`` with 429 at once while ``limit`` are in flight.

    It runs before routing and before the body is read (uvicorn drops the unread body of an
    answered request and keeps the connection), so a refusal costs the server little more
    than parsing the request line and headers: under overload the event loop
    stays free to answer, instead of reading, validating and queueing requests it will
    refuse anyway. ``metrics.in_flight`` counts the requests admitted and not yet answered;
    the time of admission goes into the scope (``RECEIVED_KEY``) for the latency metric.
    """

    def __init__(self, app: Any, *, path: str, limit: int, metrics: "Metrics", message: str) -> None:
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


# -- the app --------------------------------------------------------------------------------


def create_app(
    index: "Index",
    *,
    encoder: "SpladeEncoder | None" = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
    queue_size: int = DEFAULT_QUEUE_SIZE,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    max_query_terms: int = DEFAULT_MAX_QUERY_TERMS,
    max_queries_per_request: int = DEFAULT_MAX_QUERIES_PER_REQUEST,
    search_kwargs: dict[str, Any] | None = None,
) -> Any:  # fastapi.FastAPI
    """The FastAPI app serving ``index`` (see the module docstring).

    Args:
        index: the index to search (on the device it will be searched on).
        encoder: a SPLADE encoder for text queries, in the index's vocabulary; without one
            only ``{token: weight}`` queries are accepted.
        max_batch_size: queries searched together at most.
        max_wait_ms: how long a request waits for others to join its batch.
        queue_size: requests waiting at most; more get HTTP 429.
        request_timeout_s: a request not answered within this time gets HTTP 504.
        max_query_terms: terms per ``{token: weight}`` query at most.
        max_queries_per_request: queries per request at most.
        search_kwargs: passed to :meth:`Index.search` (``kernel``, ``memory_budget`` ...).
    """
    require_server_stack()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    from .search import check_vocab

    for name, value in (
        ("max_batch_size", max_batch_size),
        ("queue_size", queue_size),
        ("max_query_terms", max_query_terms),
        ("max_queries_per_request", max_queries_per_request),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    if not max_wait_ms >= 0:
        raise ValueError(f"max_wait_ms must be >= 0, not {max_wait_ms!r}")
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, not {request_timeout_s!r}")
    if encoder is not None:
        check_vocab(encoder.vocab, index.vocab)
    limits = Limits(max_query_terms=max_query_terms, max_queries_per_request=max_queries_per_request)
    metrics = Metrics(max_batch_size)
    batcher = DynamicBatcher(
        lambda batch: search_batch(index, batch, encoder=encoder, search_kwargs=search_kwargs),
        max_batch_size=max_batch_size,
        max_wait_s=max_wait_ms / 1000,
        queue_size=queue_size,
        on_batch=metrics.observe_batch,
    )

    class SearchRequest(BaseModel):
        """One query (``query``) or several (``queries``): texts or ``{token: weight}`` vectors."""

        model_config = ConfigDict(extra="forbid")
        query: str | dict[str, float] | None = Field(None, description="A single query.")
        queries: list[str | dict[str, float]] | None = Field(None, description="Several queries.")
        k: int = Field(10, ge=1, description="Results per query (at most the collection's size).")

    class Hits(BaseModel):
        ids: list[str] = Field(description="Document ids, best first (score descending, then internal number).")
        scores: list[float] = Field(description="Their float32 scores; only documents with a score > 0.")

    class SearchResponse(BaseModel):
        k: int
        results: list[Hits] = Field(description="One entry per query, in request order.")

    class Problem(BaseModel):
        detail: str

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        batcher.start()
        yield
        # Uvicorn has let in-flight requests finish; serve anything still queued, then stop.
        await asyncio.to_thread(batcher.close)

    app = FastAPI(
        title="GPUSparse search",
        version=_version(),
        description="Exact top-k retrieval over learned sparse vectors, batched dynamically.",
        lifespan=lifespan,
    )
    app.state.index, app.state.encoder, app.state.batcher, app.state.metrics = index, encoder, batcher, metrics
    # Requests in flight at most: a full queue plus a batch being served. Counted from arrival,
    # so the HTTP layer refuses the surplus before spending anything on it.
    app.add_middleware(
        AdmissionControl,
        path="/search",
        limit=queue_size + max_batch_size,
        metrics=metrics,
        message=QUEUE_FULL.format(queue_size=queue_size),
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = describe_validation_errors(list(exc.errors()))
        if request.url.path == "/search":
            metrics.observe_request(status, 0.0, 0)
        return JSONResponse({"detail": message}, status_code=status)

    def _problem(status: int, message: str, t0: float) -> JSONResponse:
        metrics.observe_request(status, time.perf_counter() - t0, 0)
        return JSONResponse({"detail": message}, status_code=status)

    # The body is parsed by hand (pydantic's JSON validator, no FastAPI body machinery) and
    # the answer encoded once with json.dumps: this is the per-request path of the event loop.
    request_schema = SearchRequest.model_json_schema()
    json_headers = {"content-type": "application/json"}

    @app.post(
        "/search",
        response_model=SearchResponse,
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}}},
        responses={
            400: {"model": Problem, "description": "Bad JSON, unknown token, bad k, empty or too large query."},
            422: {"model": Problem, "description": "A field of the wrong type."},
            429: {"model": Problem, "description": "Too many requests in flight; retry later."},
            503: {"model": Problem, "description": "The server is shutting down."},
            504: {"model": Problem, "description": "Not answered within the request timeout."},
        },
    )
    async def search(request: Request) -> Response:
        """Exact top-k documents for each query."""
        t0 = request.scope.get(RECEIVED_KEY) or time.perf_counter()
        try:
            body = SearchRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _problem(*describe_validation_errors(exc.errors()), t0)
        if (body.query is None) == (body.queries is None):
            return _problem(400, "give exactly one of 'query' and 'queries'", t0)
        raw = [body.query] if body.query is not None else body.queries
        try:
            queries = check_queries(raw or [], body.k, index, has_encoder=encoder is not None, limits=limits)
        except InputError as exc:
            return _problem(400, exc.reason, t0)
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

        pending = PendingRequest(queries, body.k, deliver)
        try:
            batcher.submit(pending)
        except QueueFullError as exc:
            return _problem(429, str(exc), t0)
        except ShuttingDownError as exc:
            return _problem(503, str(exc), t0)
        try:
            scores, ids = await asyncio.wait_for(future, request_timeout_s)
        except TimeoutError:
            pending.cancelled = True
            return _problem(504, f"not answered within {request_timeout_s:g} s", t0)
        except InputError as exc:
            return _problem(400, exc.reason, t0)
        except Exception as exc:
            return _problem(500, f"search failed: {type(exc).__name__}: {exc}", t0)
        names = index.ids
        results = []
        for srow, irow in zip(scores, ids, strict=True):
            keep = irow >= 0
            results.append({"ids": [names[d] for d in irow[keep].tolist()], "scores": srow[keep].tolist()})
        content = json.dumps({"k": body.k, "results": results}, separators=(",", ":")).encode()
        metrics.observe_request(200, time.perf_counter() - t0, len(queries))
        return Response(content, headers=json_headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        """``status`` ok (200) or draining (503), and what is served."""
        body = {
            "status": "draining" if batcher.closing else "ok",
            "documents": index.n_docs,
            "device": str(index.device),
            "encoder": None if encoder is None else encoder.name,
            "queue_depth": batcher.depth,
            "max_batch_size": max_batch_size,
            "max_wait_ms": max_wait_ms,
            "queue_size": queue_size,
        }
        return JSONResponse(body, status_code=503 if batcher.closing else 200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> PlainTextResponse:
        """Prometheus text exposition format 0.0.4."""
        return PlainTextResponse(metrics.render(batcher.depth), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _version() -> str:
    from . import __version__

    return __version__


def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    limit_concurrency: int | None = None,
) -> None:
    """Run ``app`` with uvicorn until interrupted (SIGINT/SIGTERM drain in-flight requests).

    ``limit_concurrency`` bounds open connections and requests in progress (uvicorn answers
    503 beyond it): backpressure before a request is even read, for when the HTTP layer
    rather than the search is the bottleneck.
    """
    require_server_stack()
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=60,
        limit_concurrency=limit_concurrency,
    )
