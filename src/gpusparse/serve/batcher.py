"""Dynamic batching: a bounded FIFO of validated requests and the one worker thread that serves them.

The worker takes the oldest request, then keeps adding whole requests, oldest first, until
the batch holds ``max_batch_size`` queries or ``max_wait_s`` have passed since the oldest
one arrived; :func:`search_requests` then encodes the batch's texts in one call, searches the
whole batch once with the largest ``k`` in it and trims each request's rows to its own
``k`` (an exact top-k with a fixed tie-break is a prefix of a larger one).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..collection import SparseCollection
from ..errors import InputError

if TYPE_CHECKING:
    from ..encode import SpladeEncoder
    from ..index import Index

QUEUE_FULL = "the request queue is full ({queue_size} requests); retry later"


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


def search_requests(
    index: Index,
    batch: Sequence[PendingRequest],
    *,
    encoder: SpladeEncoder | None = None,
    search_kwargs: dict[str, Any] | None = None,
    on_engine: Callable[[str], None] | None = None,
) -> None:
    """Serve ``batch``: encode its texts in one call, search once with the largest ``k``, trim, deliver.

    ``on_engine``: called with the engine of each search (its results' ``engine``; metrics).

    When the search refuses the batch for bad input (:class:`InputError`, e.g. a query
    whose scores would overflow float32), each request is searched alone, so only the
    requests at fault get the error, not those that happened to share their batch.
    """
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
    try:
        res = index.search(coll, k, **(search_kwargs or {}))
    except InputError:
        if len(batch) == 1:
            raise
        for r in batch:
            try:
                search_requests(index, [r], encoder=encoder, search_kwargs=search_kwargs, on_engine=on_engine)
            except Exception as exc:
                r.deliver(exc)
        return
    if on_engine is not None:
        on_engine(getattr(res, "engine", ""))
    scores, ids = res.scores.numpy(), res.ids.numpy()
    row = 0
    for r in batch:
        r.deliver((scores[row : row + r.size, : r.k], ids[row : row + r.size, : r.k]))
        row += r.size
