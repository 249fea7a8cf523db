"""The server's settings: one frozen :class:`ServerConfig`, checked when it is made.

Every knob of ``gpusparse serve`` lives here (batching, per-request limits); the app and
the batcher read it, nothing changes it after start-up (:func:`dataclasses.replace` makes
a new one).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_QUEUE_SIZE = 1024
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_MAX_QUERY_TERMS = 1024
DEFAULT_MAX_QUERIES_PER_REQUEST = 256
DEFAULT_MAX_TEXT_CHARS = 10_000


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
    """

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    queue_size: int = DEFAULT_QUEUE_SIZE
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_query_terms: int = DEFAULT_MAX_QUERY_TERMS
    max_queries_per_request: int = DEFAULT_MAX_QUERIES_PER_REQUEST
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "queue_size", "max_query_terms", "max_queries_per_request", "max_text_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, not {self.max_wait_ms!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, not {self.request_timeout_s!r}")

    @property
    def admission_limit(self) -> int:
        """Search requests in flight at most: a full queue plus a batch being served."""
        return self.queue_size + self.max_batch_size
