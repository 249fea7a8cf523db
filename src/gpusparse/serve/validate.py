"""Checking a parsed search request: ``k``, the queries, their count and size.

Sparse queries become canonical ``(term ids, weights)`` arrays, as
:meth:`SparseCollection.from_dicts` makes them; every refusal is an
:class:`~gpusparse.errors.InputError` with a one-line message naming the query at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..collection import SparseCollection, _check_weights
from ..errors import InputError
from .config import ServerConfig

if TYPE_CHECKING:
    from ..index import Index
    from ..vocab import Vocabulary


def check_queries(
    queries: Sequence[object], k: int, index: Index, *, has_encoder: bool, limits: ServerConfig
) -> list[str | tuple[np.ndarray, np.ndarray]]:
    """Validate a request's queries and ``k``; sparse ones become canonical ``(term ids, weights)``.

    Raises:
        InputError: with a message naming the query at fault (HTTP 400).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"k must be a positive integer, not {k!r}", field="k")
    if k > index.n_docs:
        raise InputError(f"k = {k} is larger than the collection ({index.n_docs:,} documents)", field="k")
    if not queries:
        raise InputError("no queries: give 'query' or a non-empty 'queries' list", field="queries")
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
        if not isinstance(q, dict):
            raise InputError(f"{where}a query is a text or a {{token: weight}} object", field="queries")
        if not q:
            raise InputError(f"{where}empty query vector", field="queries")
        if len(q) > limits.max_query_terms:
            raise InputError(f"{where}{len(q):,} query terms; at most {limits.max_query_terms:,}", field="queries")
        try:
            terms, weights = canonical_vector(q, index.vocab)
        except (InputError, TypeError) as exc:
            reason = exc.reason if isinstance(exc, InputError) else str(exc)
            raise InputError(f"{where}{reason}", field="queries") from None
        if terms.size == 0:
            raise InputError(f"{where}every weight is zero", field="queries")
        out.append((terms, weights))
    return out


def canonical_vector(vector: dict[str, float], vocab: Vocabulary) -> tuple[np.ndarray, np.ndarray]:
    """``(term ids, weights)`` of one ``{token: weight}`` query, as :meth:`SparseCollection.from_dicts` makes them.

    Term ids ascending (int32), float32 weights with zeros dropped; the same checks and
    messages (unknown token, negative, non-finite or float32-overflowing weight). This is
    the per-request path of the server, so it skips building a collection: a vocabulary
    lookup per token and a few small numpy calls.
    """
    get = vocab.get
    term_ids = [get(token) for token in vector]
    if None in term_ids:
        token = next(t for t, i in zip(vector, term_ids, strict=True) if i is None)
        raise InputError(f"unknown token {token!r}", field="vector")
    # As the file reader: a weight is a JSON number; true/false and "1.5" are not (numpy
    # would take them as 1.0 and 1.5).
    for w in vector.values():
        if type(w) not in (int, float):
            raise InputError(f"weight {w!r:.40} is not a number", field="vector")
    try:
        weights = np.fromiter(vector.values(), dtype=np.float64, count=len(vector))
    except OverflowError:  # an integer past float64; the reader says the same
        raise InputError("a weight overflows float32", field="vector") from None
    _check_weights(weights)
    terms = np.array(term_ids, dtype=np.int32)
    order = np.argsort(terms, kind="stable")
    terms = terms[order]
    if terms.size > 1 and bool((terms[1:] == terms[:-1]).any()):
        # Two spellings of one term (an integer vocabulary's "7" and "07"): summed, the slow way.
        coll = SparseCollection.from_dicts([vector], vocab=vocab, unknown="error")
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
