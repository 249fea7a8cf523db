"""The request and response models of ``POST /search`` (pydantic), for parsing and the OpenAPI schema.

Imported only when an app is created: pydantic comes with fastapi, an optional dependency.
"""

from pydantic import BaseModel, ConfigDict, Field


class SearchRequest(BaseModel):
    """One query (``query``) or several (``queries``): texts or ``{token: weight}`` vectors."""

    model_config = ConfigDict(extra="forbid")
    query: str | dict[str, float] | None = Field(None, description="A single query.")
    queries: list[str | dict[str, float]] | None = Field(None, description="Several queries.")
    k: int = Field(10, ge=1, description="Results per query (at most the collection's size).")


class Hits(BaseModel):
    ids: list[str] = Field(description="Document ids, best first (score descending, then internal number).")
    scores: list[float] = Field(description="Their float32 scores; only documents with a score > 0.")


class SearchResponse(BaseModel):
    k: int
    results: list[Hits] = Field(description="One entry per query, in request order.")


class Problem(BaseModel):
    detail: str


SEARCH_RESPONSES = {
    400: {"model": Problem, "description": "Bad JSON, unknown token, bad k, empty or too large query."},
    422: {"model": Problem, "description": "A field of the wrong type."},
    429: {"model": Problem, "description": "Too many requests in flight; retry later."},
    503: {"model": Problem, "description": "The server is shutting down."},
    504: {"model": Problem, "description": "Not answered within the request timeout."},
}
