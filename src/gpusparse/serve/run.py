"""Running an app with uvicorn until SIGINT/SIGTERM, which drain the requests in flight."""

from __future__ import annotations

from typing import Any

from .app import require_server_stack


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
