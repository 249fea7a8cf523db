"""The service's counters and histograms, rendered in Prometheus text format 0.0.4 (``GET /metrics``)."""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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


def _label(value: str) -> str:
    """A label value escaped for the text format (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    if isinstance(x, int) or (math.isfinite(x) and x == int(x) and abs(x) < 1e15):
        return str(int(x))
    return repr(float(x))


class Metrics:
    """Counters and histograms of the service, rendered in Prometheus text format 0.0.4."""

    def __init__(self, max_batch_size: int) -> None:
        self._lock = threading.Lock()
        # requests, queries and the histograms may be updated from the worker thread; the
        # gauges in_flight and reading only from the event loop's thread.
        self.requests: dict[int, int] = collections.Counter()
        self.queries = 0
        self.in_flight = 0
        self.reading = 0
        bounds = [1 << i for i in range(max(1, max_batch_size).bit_length())]
        if bounds[-1] < max_batch_size:
            bounds.append(max_batch_size)
        self.batch_size = Histogram(bounds)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.engine: str | None = None  # the engine of the latest search; None before the first
        self.searches: dict[str, int] = collections.Counter()  # searches (batches) by engine

    def observe_engine(self, engine: str) -> None:
        """A search ran with ``engine`` (its results' ``engine``; ``""`` reads as unknown)."""
        with self._lock:
            self.engine = engine or "unknown"
            self.searches[self.engine] += 1

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
                "# HELP gpusparse_requests_in_flight Search requests read in full and not yet answered.",
                "# TYPE gpusparse_requests_in_flight gauge",
                f"gpusparse_requests_in_flight {self.in_flight}",
                "# HELP gpusparse_requests_reading_body Search requests whose body is still arriving.",
                "# TYPE gpusparse_requests_reading_body gauge",
                f"gpusparse_requests_reading_body {self.reading}",
                "# HELP gpusparse_engine_info The engine of the latest search (after the first search).",
                "# TYPE gpusparse_engine_info gauge",
                *([f'gpusparse_engine_info{{engine="{_label(self.engine)}"}} 1'] if self.engine else []),
                "# HELP gpusparse_searches_total Searches (batches of queries) run, by engine.",
                "# TYPE gpusparse_searches_total counter",
                *(f'gpusparse_searches_total{{engine="{_label(e)}"}} {n}' for e, n in sorted(self.searches.items())),
                "# HELP gpusparse_batch_size Queries per search batch.",
                "# TYPE gpusparse_batch_size histogram",
                *self.batch_size.lines("gpusparse_batch_size"),
                "# HELP gpusparse_request_latency_seconds Time from receiving a search request to answering it (200s).",
                "# TYPE gpusparse_request_latency_seconds histogram",
                *self.latency.lines("gpusparse_request_latency_seconds"),
            ]
        return "\n".join(lines) + "\n"
