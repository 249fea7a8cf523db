"""The server's settings: one frozen :class:`ServerConfig`, checked when it is made.

Every knob of ``gpusparse serve`` lives here (batching, per-request limits, body limits,
connection cap, bearer token, Host allow-list); the app, the middleware and the uvicorn
launcher read it, nothing changes it after start-up (:func:`dataclasses.replace` makes a
new one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_QUEUE_SIZE = 1024
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_MAX_QUERY_TERMS = 1024
DEFAULT_MAX_QUERIES_PER_REQUEST = 256
DEFAULT_MAX_TEXT_CHARS = 10_000
# 256 queries of ~100 terms each are ~500 kB of JSON; 4 MiB leaves room and bounds what one
# connection can make the server hold (and parse) at once.
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
# Loopback names: what a browser on this machine sends for a server bound to localhost.
# A DNS-rebinding page sends its own name instead, and is refused.
DEFAULT_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServerConfig:
    """How the server batches and what one request may ask for.

    Attributes:
        max_batch_size: queries searched together at most.
        max_wait_ms: how long a request waits for others to join its batch.
        queue_size: requests waiting at most; more get HTTP 429.
        request_timeout_s: a request not answered within this time gets HTTP 504.
        max_query_terms: terms per ``{token: weight}`` query at most.
        max_queries_per_request: queries per request at most.
        max_text_chars: characters per text query at most.
        max_body_bytes: bytes of a request body at most; more get HTTP 413.
        body_timeout_s: seconds to receive a whole request body; slower gets HTTP 408.
        max_connections_per_client: open connections per client address at most (0: no cap);
            more are answered 429 and closed at once. Behind a reverse proxy every
            connection comes from the proxy: raise it or set 0 there.
        auth_token: when set, every request needs ``Authorization: Bearer <token>`` (401
            otherwise). Never shown in the repr.
        allowed_hosts: names the ``Host`` header may carry (port ignored, case-insensitive);
            ``"*"`` allows any. Others get HTTP 400.
        unknown_tokens: a query token missing from the vocabulary is an error (HTTP 400, as
            :meth:`Index.search` refuses it) or, with ``"skip"``, dropped (as the file
            reader's ``unknown="skip"``).
    """

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    queue_size: int = DEFAULT_QUEUE_SIZE
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_query_terms: int = DEFAULT_MAX_QUERY_TERMS
    max_queries_per_request: int = DEFAULT_MAX_QUERIES_PER_REQUEST
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    auth_token: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS
    unknown_tokens: str = "error"

    def __post_init__(self) -> None:
        positive = ("max_batch_size", "queue_size", "max_query_terms", "max_queries_per_request", "max_text_chars")
        for name in (*positive, "max_body_bytes", "max_connections_per_client"):
            value = getattr(self, name)
            low = 0 if name == "max_connections_per_client" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                what = "a non-negative" if low == 0 else "a positive"
                raise ValueError(f"{name} must be {what} integer, not {value!r}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, not {self.body_timeout_s!r}")
        if self.auth_token is not None and (not isinstance(self.auth_token, str) or not self.auth_token.strip()):
            raise ValueError("auth_token must be a non-empty string")
        hosts = self.allowed_hosts
        if isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts) or not hosts:
            raise ValueError(f"allowed_hosts must be a non-empty tuple of names, not {hosts!r}")
        # Stored normalised (lower case, IPv6 without brackets) so the check is a set lookup.
        object.__setattr__(self, "allowed_hosts", tuple(dict.fromkeys(h.lower().strip("[]") for h in hosts)))
        if self.unknown_tokens not in ("error", "skip"):
            raise ValueError(f"unknown_tokens must be 'error' or 'skip', not {self.unknown_tokens!r}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, not {self.max_wait_ms!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, not {self.request_timeout_s!r}")

    @property
    def admission_limit(self) -> int:
        """Search requests in flight at most: a full queue plus a batch being served."""
        return self.queue_size + self.max_batch_size
