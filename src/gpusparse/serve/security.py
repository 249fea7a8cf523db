"""What a request must show before anything else happens: an allowed ``Host``, the bearer token, JSON.

:class:`RequestGuard` is pure ASGI middleware, the outermost layer, checking the headers only:

- ``Host`` must be one of ``allowed_hosts`` (port ignored): a page that rebinds its own
  DNS name to 127.0.0.1 still sends its own name, and gets 400;
- with a token configured, ``Authorization: Bearer <token>`` (compared in constant time),
  else 401 with ``WWW-Authenticate: Bearer``;
- a POST must say ``Content-Type: application/json``, else 415: a cross-site page can send
  ``text/plain`` or form bodies without a CORS preflight, never ``application/json``, and
  the server sends no CORS headers, so browsers refuse to preflight for it.

Refusals close the connection: the body, if any, is never read.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from .body import problem
from .metrics import Metrics


def host_name(value: str) -> str:
    """The name of a ``Host`` header value: port dropped, IPv6 brackets dropped, lower case."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1 : value.find("]")] if "]" in value else value
    name, _, port = value.rpartition(":")
    return name if name and port.isdigit() else value


class RequestGuard:
    """Pure ASGI middleware: Host allow-list, bearer token, JSON content type (see the module).

    Args:
        app: the app behind it.
        allowed_hosts: normalised names (:func:`host_name`); ``"*"`` among them allows any.
        auth_token: the token every request must carry, or ``None``.
        metrics: refusals of ``metrics_path`` are counted by status.
        metrics_path: the path whose refusals count in ``gpusparse_requests_total``.
    """

    def __init__(
        self,
        app: Any,
        *,
        allowed_hosts: tuple[str, ...],
        auth_token: str | None,
        metrics: Metrics,
        metrics_path: str = "/search",
    ) -> None:
        self.app = app
        self.allowed = None if "*" in allowed_hosts else frozenset(allowed_hosts)
        self.expected = None if auth_token is None else f"Bearer {auth_token}".encode()
        self.metrics, self.metrics_path = metrics, metrics_path

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if scope["path"] == self.metrics_path:
            self.metrics.observe_request(refusal[0]["status"], 0.0, 0)
        for message in refusal:
            await send(message)

    def _check(self, scope: dict) -> tuple | None:
        host = authorization = content_type = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"authorization":
                authorization = value
            elif name == b"content-type":
                content_type = value
        if self.allowed is not None:
            if host is None:
                return problem(400, "missing Host header")
            name = host_name(host.decode("latin-1"))
            if name not in self.allowed:
                return problem(400, f"Host {name!r} is not allowed (--allow-host)")
        # compare_digest takes time independent of where the bytes differ (not of the length).
        if self.expected is not None and not hmac.compare_digest(authorization or b"", self.expected):
            return problem(401, "missing or wrong bearer token", extra=[(b"www-authenticate", b"Bearer")])
        if scope["method"] == "POST":
            media = (content_type or b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                return problem(415, "the request body must be JSON, sent with Content-Type: application/json")
        return None
