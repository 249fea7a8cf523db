"""Queries from what users pass to a batch on a device, in the shapes kernels read.

:func:`as_queries` accepts a :class:`~gpusparse.collection.SparseCollection`, a scipy sparse
matrix, a torch sparse tensor (COO or CSR) or a list of ``{token: weight}`` dicts and checks
the vocabulary against the index's;
:func:`prepare_queries` also quantizes them like a quantized index's documents
(:func:`prepare_queries_deferred`: or leaves that to an engine that does it itself);
:func:`query_batch` lays a batch out on a device (:class:`QueryBatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import scipy.sparse as sp
import torch

from .collection import SparseCollection, is_torch_sparse
from .errors import InputError
from .quantize import quantize_queries
from .queries_native import pad_rows
from .transfer import to_device
from .vocab import Vocabulary

F32_MAX = float(np.finfo(np.float32).max)

if TYPE_CHECKING:
    from .quantize import Quantization


def as_queries(queries: object, vocab: Vocabulary) -> SparseCollection:
    """Turn what :meth:`Index.search` accepts into a collection checked against ``vocab``."""
    if isinstance(queries, SparseCollection):
        q = queries
    elif sp.issparse(queries):
        q = SparseCollection.from_scipy(queries)
    elif is_torch_sparse(queries):
        q = SparseCollection.from_torch_sparse(queries)  # type: ignore[arg-type]
    elif isinstance(queries, Sequence) and all(isinstance(v, Mapping) for v in queries):
        q = SparseCollection.from_dicts(queries, vocab=vocab)
    else:
        raise TypeError(
            "queries must be a SparseCollection, a scipy sparse matrix, a torch sparse tensor (COO or CSR) "
            "or a list of {token: weight} dicts"
        )
    check_vocab(q.vocab, vocab)
    return q


def prepare_queries(
    queries: object,
    vocab: Vocabulary,
    quantization: Quantization | None,
    max_scores: np.ndarray,
    largest: float | None = None,
) -> SparseCollection:
    """:func:`as_queries`, then quantized like the index's documents when they are, then
    refused if a score could overflow float32 (:func:`check_score_bound` with the index's
    per-term largest weights ``max_scores``, and ``largest``, their maximum, where the caller
    has it). Every search passes through here."""
    q = as_queries(queries, vocab)
    if quantization is not None:
        q = quantize_queries(q, quantization.bits)
    check_score_bound(q, max_scores, largest)
    return q


def prepare_queries_deferred(
    queries: object,
    vocab: Vocabulary,
    quantization: Quantization | None,
    max_scores: np.ndarray,
    largest: float | None = None,
    *,
    defer: bool = False,
) -> tuple[SparseCollection, int | None]:
    """:func:`prepare_queries` as ``(queries, None)``; with ``defer`` (an engine that quantizes
    queries itself) and a quantized index, the queries still unquantized and the bits to
    quantize them to, where no quantized query can be refused: every quantized weight is below
    twice its row's largest (its power-of-two step ``s`` has ``(2**bits - 1) · s / 2 <`` that
    weight), so ``2 · max w · largest · nnz ≤ 2**100`` with ``2 · max w`` within float32 passes
    :func:`check_score_bound`'s first test for the quantized queries too. Else they are
    quantized and checked here: ``(queries, None)``."""
    if not defer or quantization is None:
        return prepare_queries(queries, vocab, quantization, max_scores, largest), None
    q = as_queries(queries, vocab)
    largest = _largest(max_scores, largest)
    if as_they_are(q, quantization, max_scores, largest, defer=True):
        return q, quantization.bits
    q = quantize_queries(q, quantization.bits)
    check_score_bound(q, max_scores, largest)
    return q, None


def as_they_are(
    queries: SparseCollection,
    quantization: Quantization | None,
    max_scores: np.ndarray,
    largest: float | None = None,
    *,
    defer: bool = False,
) -> bool:
    """Whether :func:`prepare_queries_deferred` takes ``queries`` (an :func:`as_queries` result)
    as they are, with nothing to refuse: no quantization left to the host (an index without it,
    or ``defer``), and the score bound proven from two reductions (for quantized queries to come,
    from twice the largest weight; see :func:`prepare_queries_deferred`)."""
    if quantization is not None and not defer:
        return False
    values = queries.values
    if not values.size:
        return True
    top = float(values.max())
    if quantization is not None:
        top *= 2.0
        if not top <= F32_MAX:
            return False
    return _bound_proven(top, _largest(max_scores, largest), values.size)


def score_bounds(queries: SparseCollection, max_scores: np.ndarray) -> np.ndarray:
    """float64 ``[n_queries]``: ``Σ_t w_q[t] · max_scores[t]``, no document's score exceeds it."""
    m = np.asarray(max_scores, dtype=np.float64)
    products = queries.values.astype(np.float64) * m[queries.indices]  # exact: 24-bit × 24-bit mantissas
    rows = np.repeat(np.arange(len(queries)), np.diff(queries.indptr))
    return np.bincount(rows, weights=products, minlength=len(queries)).astype(np.float64)


def _largest(max_scores: np.ndarray, largest: float | None) -> float:
    """``largest`` where the caller keeps it, else ``max_scores``' maximum (a pass over the vocabulary)."""
    return float(np.asarray(max_scores).max(initial=0.0)) if largest is None else largest


def _bound_proven(max_weight: float, largest: float, nnz: int) -> bool:
    """:func:`check_score_bound`'s proof, from two reductions: every bound is at most
    ``nnz · max w_q · max max_scores`` (over all terms: no gather of the queries' own); at most
    2**100 (float64 rounding aside, below 2**-40 relative here) a bound widened by
    ``(n + 1) · 2⁻²³`` (n < 2**40) stays below 2**120 < F32_MAX: nothing to refuse, the exact
    sums would find the same. SPLADE's largest are ~1e4."""
    return max_weight * largest * nnz <= 2.0**100


def check_score_bound(queries: SparseCollection, max_scores: np.ndarray, largest: float | None = None) -> None:
    """Refuse (:class:`InputError`, naming the first query) a query whose score bound
    (:func:`score_bounds`) reaches float32's largest value: a document could score ``inf``.
    ``largest``: ``max_scores``' maximum where the caller keeps it (else computed here, a
    pass over the vocabulary).

    The bound is widened by the float32 rounding of a sum of that many terms
    (``(n + 1) · 2⁻²³`` relative), so a query that passes cannot round up to ``inf`` either.
    """
    values = queries.values
    if not values.size:
        return
    if _bound_proven(float(values.max()), _largest(max_scores, largest), values.size):
        return
    bounds = score_bounds(queries, max_scores)
    lengths = np.diff(queries.indptr)
    bad = bounds * (1.0 + (lengths + 1) * 2.0**-23) > F32_MAX
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(
            f"query {queries.ids[i]!r}: its weights are too large: a score could overflow float32 (up to "
            f"{bounds[i]:.3g}, beyond {F32_MAX:.3g}); scale the query's weights down",
            field="vector",
        )


def check_vocab(query_vocab: Vocabulary, index_vocab: Vocabulary) -> None:
    """Refuse queries whose term ids would mean other tokens than the index's.

    An integer (anonymous) query vocabulary is compatible with any index vocabulary at
    least as large; two token vocabularies must be identical.
    """
    if query_vocab is index_vocab:
        return
    if query_vocab.is_integer or index_vocab.is_integer:
        if len(query_vocab) > len(index_vocab):
            raise InputError(
                f"queries use a vocabulary of {len(query_vocab)} terms but the index has {len(index_vocab)}",
                field="vocabulary",
            )
        if not (query_vocab.is_integer or len(query_vocab) == len(index_vocab)):
            raise InputError("queries use a token vocabulary of another size than the index's", field="vocabulary")
        return
    if query_vocab != index_vocab:
        raise InputError(
            f"the queries' vocabulary ({query_vocab.fingerprint[:12]}, {len(query_vocab)} tokens) is not the "
            f"index's ({index_vocab.fingerprint[:12]}, {len(index_vocab)} tokens)",
            field="vocabulary",
        )


class QueryBatch(NamedTuple):
    """A query batch on a device, in the two shapes kernels want.

    ``rows``/``terms``/``weights``: one entry per (query, term) pair, in CSR order;
    ``padded_terms``/``padded_weights``: ``[B, T]`` with ``-1``/``0`` padding, terms
    ascending in each row (the canonical summation order); ``n_terms``: ``[B]``.
    """

    rows: torch.Tensor
    terms: torch.Tensor
    weights: torch.Tensor
    padded_terms: torch.Tensor
    padded_weights: torch.Tensor
    n_terms: torch.Tensor
    # The same padded terms, weights and lengths on the host (for host-side planning).
    host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Padded terms, padded weights and lengths on the host (copied back if not kept)."""
        if self.host is not None:
            return self.host
        return self.padded_terms.cpu().numpy(), self.padded_weights.cpu().numpy(), self.n_terms.cpu().numpy()


def query_batch(queries: SparseCollection, device: torch.device) -> QueryBatch:
    """Move a (canonical, term-sorted) query batch to ``device``.

    Laid out on the host and moved in one copy (:func:`to_device`): a batch is small, and
    each device operation costs more host time than the arithmetic.
    """
    return _batch_from_csr(queries.indptr, queries.indices, queries.values, device)


def batch_rows(batch: QueryBatch, rows: np.ndarray, device: torch.device) -> QueryBatch:
    """The queries ``rows`` of ``batch`` as a batch of their own (from its host arrays)."""
    terms, weights, lengths = (a[rows] for a in batch.host_arrays())
    return _batch_from_csr(*unpadded(terms, weights, lengths), device)


def unpadded(terms: np.ndarray, weights: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded rows (``terms`` / ``weights`` ``[B, W]``, ``-1`` after each row's ``lengths``
    terms, as :func:`padded_host` lays them out) back as CSR: int64 row pointers from 0, the
    rows' terms and weights (their dtypes kept)."""
    indptr = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    valid = terms >= 0  # padding sits at the end of each row: row-major order is CSR order
    return indptr, terms[valid], weights[valid]


def padded_host(
    queries: SparseCollection, width: Callable[[int], int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (canonical) query batch's padded terms (int64, ``-1`` padding) and weights (float32,
    0 padding) ``[B, T]`` and its lengths (int64 ``[B]``), on the host: what
    :class:`QueryBatch` holds in ``host``. ``T`` is the longest row, or ``width(longest)``."""
    return _padded(queries.indptr, queries.indices, queries.values, width)


def _padded(
    indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, widen: Callable[[int], int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = (indptr[1:] - indptr[:-1]).astype(np.int64, copy=False)
    b = len(lengths)
    width = (int(lengths.max()) if b > 1 else indices.size) if b else 0
    width = widen(width) if widen is not None else width
    terms, weights = np.empty((b, width), dtype=np.int64), np.empty((b, width), dtype=np.float32)
    _pad(indptr, indices, values, terms, weights, lengths)
    return terms, weights, lengths


def _pad(
    indptr: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray,
    terms: np.ndarray,
    weights: np.ndarray,
    lengths: np.ndarray | None = None,
) -> None:
    """Rows into ``terms`` / ``weights`` ``[B, W]``, ``-1`` / ``0`` after each row's end: one C
    pass where the module is built (:func:`~gpusparse.queries_native.pad_rows`), else numpy."""
    if pad_rows(indptr, indices, values, terms, weights):
        return
    terms.fill(-1)  # np.full costs a microsecond more (a Python function around these two)
    weights.fill(0)
    if len(terms) == 1:  # one row: two slices (a mask costs three numpy calls more)
        terms[0, : indices.size] = indices
        weights[0, : indices.size] = values
        return
    lengths = indptr[1:] - indptr[:-1] if lengths is None else lengths
    real = np.arange(terms.shape[1]) < lengths[:, None]  # row-major order of the real slots is CSR order
    terms[real] = indices
    weights[real] = values


def _batch_from_csr(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, device: torch.device) -> QueryBatch:
    terms, weights, lengths = _padded(indptr, indices, values)
    b, width = terms.shape
    nnz = int(indices.size)
    ints = np.empty(2 * nnz + b * width + b, dtype=np.int64)  # rows | terms | padded terms | lengths
    ints[:nnz] = np.repeat(np.arange(b, dtype=np.int64), lengths)
    ints[nnz : 2 * nnz] = indices
    ints[2 * nnz : 2 * nnz + b * width] = terms.reshape(-1)
    ints[2 * nnz + b * width :] = lengths
    floats = np.empty(nnz + b * width, dtype=np.float32)  # weights | padded weights
    floats[:nnz] = values
    floats[nnz:] = weights.reshape(-1)
    ints_d, floats_d = to_device([ints, floats], device)
    return QueryBatch(
        ints_d[:nnz],
        ints_d[nnz : 2 * nnz],
        floats_d[:nnz],
        ints_d[2 * nnz : 2 * nnz + b * width].view(b, width),
        floats_d[nnz:].view(b, width),
        ints_d[2 * nnz + b * width :],
        (terms, weights, lengths),
    )
