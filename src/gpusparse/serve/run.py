"""Running an app with uvicorn: a connection cap per client address, a shutdown that skips stalled clients.

:func:`build_server` makes the :class:`uvicorn.Server`; :func:`serve` runs it until SIGINT
or SIGTERM. On shutdown the server first starts the app's :class:`~.body.Drain` (requests
still receiving their body get 503 and are closed at once), then lets uvicorn close idle
connections and wait for the searches in flight, which end within ``request_timeout_s``
(504 otherwise).
"""

from __future__ import annotations

import collections
import json
import socket
from typing import Any

from .app import require_server_stack
from .config import ServerConfig

# Past request_timeout_s every admitted request has been answered (504 at worst): a little
# more, and uvicorn would cancel nothing that was still going to answer.
SHUTDOWN_MARGIN_S = 2.0


def per_client_protocol(base: type, limit: int) -> type:
    """``base`` (a uvicorn HTTP protocol) refusing a client's connection past ``limit`` open ones.

    A refused connection gets a complete HTTP 429 answer written on the socket and is closed
    before anything is read from it; unix-socket peers are not counted.
    """
    open_by_client: collections.Counter[str] = collections.Counter()  # one per server; the loop's thread only
    body = json.dumps({"detail": f"more than {limit} connections from this address; retry later"}).encode()
    refusal = (
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s" % (len(body), body)
    )

    class PerClientLimit(base):  # type: ignore[misc, valid-type]
        _client: str | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            if not isinstance(peer, tuple) or not peer:
                return
            if open_by_client[peer[0]] >= limit:
                transport.write(refusal)
                transport.close()
                return
            open_by_client[peer[0]] += 1
            self._client = peer[0]

        def connection_lost(self, exc: Exception | None) -> None:
            if self._client is not None:
                open_by_client[self._client] -= 1
                if not open_by_client[self._client]:
                    del open_by_client[self._client]
                self._client = None
            super().connection_lost(exc)

    return PerClientLimit


def build_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    limit_concurrency: int | None = None,
    **uvicorn_options: Any,
) -> Any:  # uvicorn.Server
    """A uvicorn server for an app of :func:`~.app.create_app`, set up from its ``ServerConfig``.

    ``uvicorn_options`` go to :class:`uvicorn.Config` (``backlog`` ...) and win over ours.
    """
    require_server_stack()
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    config: ServerConfig = app.state.config
    drain = app.state.drain

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            drain.start()  # before uvicorn waits on connections: stalled uploads end now
            await super().shutdown(sockets)

    http: Any = "auto"
    if config.max_connections_per_client:
        http = per_client_protocol(AutoHTTPProtocol, config.max_connections_per_client)
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": log_level,
        "http": http,
        "timeout_graceful_shutdown": config.request_timeout_s + SHUTDOWN_MARGIN_S,
        "limit_concurrency": limit_concurrency,
        # Logs show the socket's peer: an X-Forwarded-For header is any client's to write.
        "proxy_headers": False,
    }
    options.update(uvicorn_options)
    return DrainingServer(uvicorn.Config(app, **options))


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
    rather than the search is the bottleneck. The per-client cap, body limits and shutdown
    come from the app's :class:`ServerConfig` (:func:`build_server`).
    """
    build_server(app, host=host, port=port, log_level=log_level, limit_concurrency=limit_concurrency).run()
