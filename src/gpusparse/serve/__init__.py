"""An HTTP/JSON search service with dynamic batching (``gpusparse serve``).

``POST /search`` takes one query or a list of them — text (encoded on the server by the
SPLADE encoder) or sparse vectors ``{"token": weight}`` — and ``k``; it answers the
documents' string ids and float32 scores, exactly those of :meth:`Index.search` for the
same query (only documents with a score > 0; fewer than ``k`` when fewer match).

Admission comes first: while ``queue_size + max_batch_size`` search requests are in flight
(received and not yet answered), a new one gets HTTP 429 at once, before its body is read
(:mod:`.admission`), so overload costs the server little. Admitted requests are validated
(:mod:`.validate`; 4xx with a one-line ``detail``), then wait in a bounded FIFO queue
(HTTP 429 when it is full) for the one worker thread that owns the device and serves them
in batches (:mod:`.batcher`). A request waiting longer than ``request_timeout_s`` gets
HTTP 504 and is dropped from the queue. On shutdown the service stops taking requests
(503) and the worker finishes those already queued.

``GET /health`` and ``GET /metrics`` (Prometheus text format, :mod:`.metrics`) report on
the service; FastAPI serves the OpenAPI schema at ``/openapi.json`` and its docs at ``/docs``.

The modules: :mod:`.config` (the frozen :class:`ServerConfig`), :mod:`.batcher`,
:mod:`.validate`, :mod:`.schemas` (pydantic models), :mod:`.admission`, :mod:`.routes`,
:mod:`.app` (:func:`create_app`), :mod:`.run` (:func:`serve`), :mod:`.metrics`.

``fastapi`` and ``uvicorn`` are optional (``pip install 'gpusparse[serve]'``); this package
imports them when an app is created, never when it is imported.
"""

from .admission import RECEIVED_KEY, AdmissionControl
from .app import INSTALL_HINT, create_app, require_server_stack
from .batcher import QUEUE_FULL, DynamicBatcher, PendingRequest, QueueFullError, ShuttingDownError, search_batch
from .config import ServerConfig
from .metrics import Histogram, Metrics
from .run import serve
from .validate import canonical_vector, check_queries, describe_validation_errors

__all__ = [
    "INSTALL_HINT",
    "QUEUE_FULL",
    "RECEIVED_KEY",
    "AdmissionControl",
    "DynamicBatcher",
    "Histogram",
    "Metrics",
    "PendingRequest",
    "QueueFullError",
    "ServerConfig",
    "ShuttingDownError",
    "canonical_vector",
    "check_queries",
    "create_app",
    "describe_validation_errors",
    "require_server_stack",
    "search_batch",
    "serve",
]
