"""Checking a search request: its JSON, ``k``, the queries, their count and size.

The body is decoded by the file reader's decoder (:func:`gpusparse.formats.decode_json_line`)
and each ``{token: weight}`` vector checked by the reader's :func:`gpusparse.collection.parse_vector`,
so the server and the reader cannot drift: the same types, the same limits, repeated tokens
summed, the same messages. Pydantic (:mod:`.schemas`) checks the rest of the request (``k``,
the field names, texts). Sparse queries become canonical ``(term ids, weights)`` arrays, as
:class:`SparseCollection` makes them; every refusal is an :class:`~gpusparse.errors.InputError`
with a one-line message naming the query at fault. Edge cases are answered as
:meth:`Index.search` answers them: ``k`` larger than the collection, an empty vector or one
whose weights are all zero (no results), an empty ``queries`` list (no results).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..collection import SparseCollection, parse_vector
from ..errors import InputError
from ..formats import decode_json_line
from .config import ServerConfig

if TYPE_CHECKING:
    from ..vocab import Vocabulary

REQUEST_KEYS = ("query", "queries", "k")


def decode_request(raw: bytes) -> tuple[dict[str, Any], dict[tuple[str, int | None], object]]:
    """The request object of a body, decoded as the file reader decodes a line, with its
    ``{token: weight}`` vectors taken out: ``(request, vectors)``. In ``request`` each vector
    is replaced by ``{}`` (for pydantic to check the rest); ``vectors`` maps ``("query", None)``
    or ``("queries", i)`` to the vector as decoded (a dict, or the ``(token, weight)`` pairs of
    one with a repeated token).

    Raises:
        InputError: malformed JSON, not an object, or a request key given twice.
    """
    body = decode_json_line(raw)
    if isinstance(body, tuple):  # an object with a repeated key
        seen: set[str] = set()
        for key, _ in body:
            if key in seen and key in REQUEST_KEYS:
                raise InputError(f"key {key!r} given twice")
            seen.add(key)
        body = dict(body)
    if not isinstance(body, dict):
        return body, {}  # pydantic says what it should be
    vectors: dict[tuple[str, int | None], object] = {}
    if _is_vector(body.get("query")):
        vectors["query", None] = body["query"]
        body["query"] = {}
    if isinstance(body.get("queries"), list):
        items = body["queries"] = list(body["queries"])
        for i, q in enumerate(items):
            if _is_vector(q):
                vectors["queries", i] = q
                items[i] = {}
    return body, vectors


def _is_vector(value: object) -> bool:
    return isinstance(value, dict) or (isinstance(value, tuple) and all(type(p) is tuple for p in value))


def check_queries(
    queries: Sequence[object],
    k: int,
    vocab: Vocabulary,
    *,
    has_encoder: bool,
    limits: ServerConfig,
) -> list[str | tuple[np.ndarray, np.ndarray]]:
    """Validate a request's queries and ``k``; sparse ones become canonical ``(term ids, weights)``.

    ``queries``: texts, or vectors as :func:`decode_request` took them out (dicts or pairs).

    Raises:
        InputError: with a message naming the query at fault (HTTP 400).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"k must be a positive integer, not {k!r}", field="k")
    if len(queries) > limits.max_queries_per_request:
        raise InputError(
            f"{len(queries)} queries in one request; at most {limits.max_queries_per_request}", field="queries"
        )
    out: list[str | tuple[np.ndarray, np.ndarray]] = []
    for i, q in enumerate(queries):
        where = f"query {i}: " if len(queries) > 1 else ""
        if isinstance(q, str):
            if not q.strip():
                raise InputError(f"{where}empty query text", field="queries")
            if not has_encoder:
                raise InputError(
                    f"{where}text queries need an encoder; start the server with --model, or send "
                    '{"token": weight} vectors',
                    field="queries",
                )
            if len(q) > limits.max_text_chars:
                raise InputError(
                    f"{where}text of {len(q):,} characters; at most {limits.max_text_chars:,}", field="queries"
                )
            out.append(q)
            continue
        if not _is_vector(q):
            raise InputError(f"{where}a query is a text or a {{token: weight}} object", field="queries")
        if len(q) > limits.max_query_terms:  # type: ignore[arg-type]
            raise InputError(f"{where}{len(q):,} query terms; at most {limits.max_query_terms:,}", field="queries")  # type: ignore[arg-type]
        try:
            out.append(canonical_vector(q, vocab, unknown=limits.unknown_tokens))  # type: ignore[arg-type]
        except InputError as exc:
            raise InputError(f"{where}{exc.reason}", field="queries") from None
    return out


def canonical_vector(
    vector: dict[str, object] | tuple[tuple[str, object], ...], vocab: Vocabulary, *, unknown: str = "error"
) -> tuple[np.ndarray, np.ndarray]:
    """``(term ids, weights)`` of one ``{token: weight}`` query, as the file reader makes them.

    Checked by the reader's :func:`~gpusparse.collection.parse_vector` (``unknown``: its
    policy for tokens missing from ``vocab``), then canonical as :class:`SparseCollection`
    makes it: term ids ascending (int32), repeated terms summed in float32, zeros dropped.
    ``vector`` may be the ``(token, weight)`` pairs :func:`~gpusparse.formats.decode_json_line`
    gives for an object with a repeated token. This is the per-request path of the server:
    a collection is built only when a term repeats.
    """
    parsed = parse_vector(vector, vocab, unknown=unknown)
    terms, weights = parsed.terms, parsed.weights
    order = np.argsort(terms, kind="stable")
    terms = terms[order]
    if terms.size > 1 and bool((terms[1:] == terms[:-1]).any()):
        # A repeated token, or two spellings of one term (an integer vocabulary's "7" and "07"):
        # summed as the reader sums them, the slow way.
        try:
            coll = SparseCollection(
                np.array([0, terms.size]), parsed.terms, parsed.weights, vocab=vocab, check_ids=False
            )
        except InputError:  # the sum overflowed: in the reader's words
            raise InputError("duplicate terms sum to a weight that overflows float32", field="vector") from None
        return coll.indices, coll.values
    values = weights[order].astype(np.float32)
    keep = values != 0
    return terms[keep], values[keep]


def describe_validation_errors(errors: list[Any]) -> tuple[int, str]:
    """HTTP status (400 for malformed JSON, else 422) and a one-line message for pydantic's errors."""
    # A union (text or vector) fails once per branch: report the deepest, most specific error.
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    status = 400 if first.get("type") == "json_invalid" else 422
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "str", "dict[str,float]"))
    if first.get("type") == "json_invalid":
        message = f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg', 'invalid'))}"
    else:
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return status, message
