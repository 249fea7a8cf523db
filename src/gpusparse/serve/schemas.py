"""The request and response models of ``POST /search`` (pydantic), for parsing and the OpenAPI schema.

Imported only when an app is created: pydantic comes with fastapi, an optional dependency.
"""

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

# Strict types, as the file reader is strict: a weight is a JSON number (true and "1.5" are
# not), k a JSON integer. Pydantic's lax mode would turn true into 1.0 and "1.5" into 1.5.
Query = StrictStr | dict[StrictStr, StrictFloat]


class SearchRequest(BaseModel):
    """One query (``query``) or several (``queries``): texts or ``{token: weight}`` vectors."""

    model_config = ConfigDict(extra="forbid", strict=True)
    query: Query | None = Field(None, description="A single query.")
    queries: list[Query] | None = Field(None, description="Several queries.")
    k: StrictInt = Field(10, ge=1, description="Results per query (fewer when fewer documents match).")


class Hits(BaseModel):
    ids: list[str] = Field(description="Document ids, best first (score descending, then internal number).")
    scores: list[float] = Field(description="Their float32 scores; only documents with a score > 0.")


class SearchResponse(BaseModel):
    k: int
    results: list[Hits] = Field(description="One entry per query, in request order.")


class Problem(BaseModel):
    detail: str


SEARCH_RESPONSES = {
    400: {
        "model": Problem,
        "description": "Bad JSON, unknown token, bad k, empty or too large query, a score overflowing float32; "
        "or a Host header not allowed.",
    },
    401: {"model": Problem, "description": "A bearer token is required and was missing or wrong."},
    408: {"model": Problem, "description": "The body did not arrive within the body timeout."},
    413: {"model": Problem, "description": "The body is larger than the limit."},
    415: {"model": Problem, "description": "The body was not sent as application/json."},
    422: {"model": Problem, "description": "A field of the wrong type."},
    429: {"model": Problem, "description": "Too many requests in flight, or connections from this address; retry."},
    503: {"model": Problem, "description": "The server is shutting down."},
    504: {"model": Problem, "description": "Not answered within the request timeout."},
}
