"""Independent exact reference: dense float64 scores and the tie-broken top-k."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from gpusparse import SparseCollection


def random_collection(
    rng: np.random.Generator,
    n: int,
    n_terms: int,
    mean_nnz: float,
    *,
    quantized: bool = False,
    empty_fraction: float = 0.0,
    skew: float = 1.0,
) -> SparseCollection:
    """Random sparse vectors: term popularity ~ Zipf-like(skew), weights in (0, 3]."""
    p = 1.0 / np.arange(1, n_terms + 1) ** skew
    p = rng.permutation(p / p.sum())
    rows, cols, vals = [], [], []
    for i in range(n):
        if rng.random() < empty_fraction:
            continue
        m = int(min(n_terms, rng.poisson(mean_nnz)))
        terms = rng.choice(n_terms, size=m, p=p)  # with repetition: duplicates get summed
        w = rng.integers(1, 25, size=m) / 8.0 if quantized else rng.uniform(0.01, 3.0, size=m)
        rows += [i] * m
        cols += terms.tolist()
        vals += w.tolist()
    mat = sp.csr_matrix((np.asarray(vals, np.float32), (rows, cols)), shape=(n, n_terms))
    return SparseCollection.from_scipy(mat)


def dense_scores(docs: SparseCollection, queries: SparseCollection) -> np.ndarray:
    """``[n_queries, n_docs]`` float64 scores from dense matrices."""
    v = max(len(docs.vocab), len(queries.vocab))
    d = np.zeros((len(docs), v))
    q = np.zeros((len(queries), v))
    d[:, : len(docs.vocab)] = docs.to_scipy().toarray()
    q[:, : len(queries.vocab)] = queries.to_scipy().toarray()
    return q @ d.T


def canonical_scores(docs: SparseCollection, queries: SparseCollection) -> np.ndarray:
    """``[n_queries, n_docs]`` float64 scores summed in **ascending term order**.

    The canonical score of the search contract (:mod:`gpusparse.exact`): for each query,
    ``Σ_t w_q[t] · w_d[t]`` accumulated in float64 over the query's terms in ascending term
    order. Products of two float32 weights are exact in float64, so only the order of the
    additions matters; rounding the result once to float32 gives the contract's score bit
    for bit (``dense_scores`` sums in BLAS order, which can differ in the last float64 bit).
    """
    v = max(len(docs.vocab), len(queries.vocab))
    d = sp.csc_matrix(docs.to_scipy())
    d.sum_duplicates()  # in float32, as the collection holds them
    d = d.astype(np.float64)
    q = sp.csr_matrix(queries.to_scipy())
    q.sum_duplicates()
    q.sort_indices()
    q = q.astype(np.float64)
    out = np.zeros((len(queries), len(docs)))
    for i in range(q.shape[0]):
        acc = out[i]
        for t, w in zip(q.indices[q.indptr[i] : q.indptr[i + 1]], q.data[q.indptr[i] : q.indptr[i + 1]], strict=True):
            if t >= d.shape[1] or t >= v:
                continue
            col = np.zeros(len(docs))
            lo, hi = d.indptr[t], d.indptr[t + 1]
            col[d.indices[lo:hi]] = d.data[lo:hi]
            acc += w * col  # one addition per document, in ascending term order
    return out


def reference_topk(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k: float32-rounded score descending, then doc id ascending; only score > 0.

    Returns ``(scores float32 [n, k], ids int64 [n, k])`` padded with 0 / -1.
    """
    n_q, n_d = scores.shape
    s32 = scores.astype(np.float32)
    out_s = np.zeros((n_q, k), np.float32)
    out_i = np.full((n_q, k), -1, np.int64)
    for q in range(n_q):
        order = np.lexsort((np.arange(n_d), -s32[q]))
        order = order[s32[q][order] > 0][:k]
        out_s[q, : order.size] = s32[q][order]
        out_i[q, : order.size] = order
    return out_s, out_i


def order_sensitive_collection(rng: np.random.Generator, n: int, n_terms: int) -> SparseCollection:
    """Documents whose float32 score against an all-ones query depends on the summation order.

    Each document holds a weight ``a`` (magnitudes from 2^-20 to 2^20), ``b`` = half a float32
    ulp of ``a`` (so ``a + b`` is a float32 rounding midpoint, which rounds to even), and a few
    weights of a quarter float64 ulp of ``a``: each is lost when added to ``a`` alone, but
    together, added before ``a``, they tip the midpoint upwards. The terms are random, so
    ascending term order gives one float32 score and other orders (descending, BLAS,
    pairwise) another for a good share of the documents.
    """
    rows, cols, vals = [], [], []
    for i in range(n):
        a = np.float32(rng.uniform(1.0, 2.0) * 2.0 ** int(rng.integers(-20, 21)))
        b = np.float32(np.spacing(a) / 2)
        tiny = np.float32(np.spacing(np.float64(a)) / 4)
        m = int(rng.integers(2, 7))
        terms = rng.choice(n_terms, size=2 + m, replace=False)
        rows += [i] * (2 + m)
        cols += terms.tolist()
        vals += [a, b] + [tiny] * m
    mat = sp.csr_matrix((np.asarray(vals, np.float32), (rows, cols)), shape=(n, n_terms))
    return SparseCollection.from_scipy(mat)
