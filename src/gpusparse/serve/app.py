"""``create_app``: the FastAPI app serving an index, assembled from the config, batcher, metrics and routes."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..queries import check_vocab
from .batcher import QUEUE_FULL, DynamicBatcher, search_requests
from .config import ServerConfig
from .metrics import Metrics
from .served import served

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ..encode import SpladeEncoder
    from ..index import Index
    from ..segments import SegmentedIndex

INSTALL_HINT = "the search server needs fastapi and uvicorn: pip install 'gpusparse[serve]'"


def require_server_stack() -> None:
    """Raise :class:`ImportError` with an install hint unless fastapi and uvicorn import."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


def create_app(
    index: Index | SegmentedIndex,
    *,
    encoder: SpladeEncoder | None = None,
    config: ServerConfig | None = None,
    search_kwargs: dict[str, Any] | None = None,
    **settings: Any,
) -> Any:  # fastapi.FastAPI
    """The FastAPI app serving ``index`` (see :mod:`gpusparse.serve`).

    Args:
        index: the index to search (on the device it will be searched on): an
            :class:`Index`, or a :class:`~gpusparse.segments.SegmentedIndex` snapshot
            (answered with its documents' string ids; see :mod:`.served`).
        encoder: a SPLADE encoder for text queries, in the index's vocabulary; without one
            only ``{token: weight}`` queries are accepted.
        config: the server's settings (default: :class:`ServerConfig`'s defaults).
        search_kwargs: passed to :meth:`Index.search` (``kernel``, ``memory_budget`` ...).
        **settings: fields of :class:`ServerConfig` (``max_batch_size=64`` ...), replacing
            those of ``config``.

    Raises:
        ValueError: a setting out of range.
    """
    require_server_stack()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    from .admission import AdmissionControl
    from .body import BodyReader, Drain
    from .routes import add_search_route, add_status_routes
    from .security import RequestGuard
    from .validate import describe_validation_errors

    config = dataclasses.replace(config or ServerConfig(), **settings)
    index = served(index)
    if encoder is not None:
        check_vocab(encoder.vocab, index.vocab)
    metrics = Metrics(config.max_batch_size)
    batcher = DynamicBatcher(
        lambda batch: search_requests(
            index, batch, encoder=encoder, search_kwargs=search_kwargs, on_engine=metrics.observe_engine
        ),
        max_batch_size=config.max_batch_size,
        max_wait_s=config.max_wait_ms / 1000,
        queue_size=config.queue_size,
        on_batch=metrics.observe_batch,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        # Uvicorn has let in-flight requests finish; serve anything still queued, then stop.
        await asyncio.to_thread(batcher.close)

    app = FastAPI(
        title="GPUSparse search",
        version=_version(),
        description="Exact top-k retrieval over learned sparse vectors, batched dynamically.",
        lifespan=lifespan,
        # The docs pages load scripts and styles from a CDN: not served. /openapi.json is.
        docs_url=None,
        redoc_url=None,
    )
    app.state.index, app.state.encoder, app.state.batcher, app.state.metrics = index, encoder, batcher, metrics
    app.state.config = config
    app.state.drain = drain = Drain()  # started by gpusparse.serve.run's server on shutdown
    # Middleware, outermost last. Requests in flight at most: a full queue plus a batch being
    # served, counted once the body is read (reading one takes no slot) and refused before
    # parsing, so the HTTP layer refuses the surplus before spending much on it.
    app.add_middleware(
        AdmissionControl,
        path="/search",
        limit=config.admission_limit,
        metrics=metrics,
        message=QUEUE_FULL.format(queue_size=config.queue_size),
    )
    app.add_middleware(
        BodyReader,
        path="/search",
        max_bytes=config.max_body_bytes,
        timeout_s=config.body_timeout_s,
        drain=drain,
        metrics=metrics,
    )
    app.add_middleware(RequestGuard, allowed_hosts=config.allowed_hosts, auth_token=config.auth_token, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = describe_validation_errors(list(exc.errors()))
        if request.url.path == "/search":
            metrics.observe_request(status, 0.0, 0)
        return JSONResponse({"detail": message}, status_code=status)

    add_search_route(app, index, encoder, config, batcher, metrics)
    add_status_routes(app, index, encoder, config, batcher)
    return app


def _version() -> str:
    return __version__
