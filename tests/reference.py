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
