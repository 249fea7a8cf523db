"""An HTTP/JSON search service with dynamic batching (``gpusparse serve``).

``POST /search`` takes one query or a list of them — text (encoded on the server by the
SPLADE encoder) or sparse vectors ``{"token": weight}`` — and ``k``; it answers the
documents' string ids and float32 scores, exactly those of :meth:`Index.search` for the
same query (only documents with a score > 0; fewer than ``k`` when fewer match).

A request passes, in order: the guard (:mod:`.security`: an allowed ``Host``, the bearer
token when one is set, ``Content-Type: application/json`` on POST); the body reader
(:mod:`.body`: the whole body within ``max_body_bytes`` (413) and ``body_timeout_s`` (408),
taking no queue slot while it arrives); admission (:mod:`.admission`: while
``queue_size + max_batch_size`` search requests are in flight, a new one gets HTTP 429 at
once, before its body is parsed); strict parsing and validation (:mod:`.schemas`,
:mod:`.validate`; 4xx with a one-line ``detail``; large bodies are parsed in a thread); a
bounded FIFO queue (HTTP 429 when full) for the one worker thread that owns the device and
serves requests in batches (:mod:`.batcher`). A request waiting longer than
``request_timeout_s`` gets HTTP 504 and is dropped from the queue. A score that is not
finite is never answered (400). On shutdown (:mod:`.run`) requests still sending their
body get 503 at once, the service stops taking requests (503) and the worker finishes
those already queued. :mod:`.run` also caps open connections per client address.

``GET /health`` and ``GET /metrics`` (Prometheus text format, :mod:`.metrics`) report on
the service; ``/openapi.json`` has the OpenAPI schema. There are no ``/docs`` pages (they
load scripts from a CDN) and no CORS headers.

The modules: :mod:`.config` (the frozen :class:`ServerConfig`), :mod:`.security`,
:mod:`.body`, :mod:`.admission`, :mod:`.schemas` (pydantic models), :mod:`.validate`,
:mod:`.batcher`, :mod:`.served` (any index folder: plain, sharded, segmented),
:mod:`.routes`, :mod:`.app` (:func:`create_app`), :mod:`.run`
(:func:`serve`, :func:`build_server`), :mod:`.metrics`.

``fastapi`` and ``uvicorn`` are optional (``pip install 'gpusparse[serve]'``); this package
imports them when an app is created, never when it is imported.
"""

from .admission import RECEIVED_KEY, AdmissionControl
from .app import INSTALL_HINT, create_app, require_server_stack
from .batcher import QUEUE_FULL, DynamicBatcher, PendingRequest, QueueFullError, ShuttingDownError, search_requests
from .config import ServerConfig
from .metrics import Histogram, Metrics
from .run import build_server, serve
from .served import ServedSegments, load_served
from .validate import canonical_vector, check_queries, decode_request, describe_validation_errors

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
    "ServedSegments",
    "ServerConfig",
    "ShuttingDownError",
    "build_server",
    "canonical_vector",
    "check_queries",
    "create_app",
    "decode_request",
    "describe_validation_errors",
    "load_served",
    "require_server_stack",
    "search_requests",
    "serve",
]
