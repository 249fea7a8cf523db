"""Document orders for the block-max measurement (bench/block_max.py).

* :func:`bp_order`: recursive graph bisection (BP; Dhulipala et al., KDD 2016, as PISA's
  ``reorder-docids --recursive-graph-bisection`` and BMP use it) over the document–term
  bipartite graph, with the log-gap cost ``Σ_t d_A(t)·log2(n_A/(d_A(t)+1)) + same for B``
  and the usual swap step: every document's move gain, both halves sorted by gain, pairs
  swapped while their summed gain is positive, ``iters`` rounds per node. Halves are cut
  at a power of two (the left child of ``n`` documents holds ``2**ceil(log2(n/2))``), so
  every power-of-two tile of at most ``leaf`` documents lies inside one leaf and the tiles
  of any size up to the root's split follow the bisection's boundaries.
* :func:`top_term_order`: a cheap proxy: documents sorted by their highest-weighted term,
  then by that weight descending.

Both return ``perm``: ``perm[i]`` is the original id of the document at position ``i``.
"""

from __future__ import annotations

import numpy as np


def _log_gap_cost(d_a: np.ndarray, d_b: np.ndarray, n_a: int, n_b: int) -> np.ndarray:
    return d_a * np.log2(n_a / (d_a + 1.0)) + d_b * np.log2(n_b / (d_b + 1.0))


def _left_size(n: int) -> int:
    """Documents in the left half of a node of ``n``: the power of two at or above ``n/2``."""
    p = 1
    while p < (n + 1) // 2:
        p *= 2
    return min(p, n - 1)


def _node_postings(indptr: np.ndarray, indices: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(local document index, term) of every posting of ``docs``."""
    lens = indptr[docs + 1] - indptr[docs]
    local = np.repeat(np.arange(len(docs)), lens)
    starts = np.repeat(indptr[docs] - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    terms = indices[np.arange(int(lens.sum())) + starts]
    return local, terms


def _bisect(docs: np.ndarray, indptr: np.ndarray, indices: np.ndarray, n_terms: int, iters: int) -> np.ndarray:
    """``docs`` reordered so that its first ``_left_size`` documents form one side of a BP cut."""
    n = len(docs)
    n_a = _left_size(n)
    n_b = n - n_a
    local, terms = _node_postings(indptr, indices, docs)
    # Compact the node's terms so the degree arrays are as small as its vocabulary.
    uniq, terms = np.unique(terms, return_inverse=True)
    v = len(uniq)
    side = np.zeros(n, dtype=bool)  # False = A (left), True = B
    side[n_a:] = True
    for _ in range(iters):
        p_side = side[local]
        d_b = np.bincount(terms[p_side], minlength=v).astype(np.float64)
        d_a = np.bincount(terms[~p_side], minlength=v).astype(np.float64)
        here = _log_gap_cost(d_a, d_b, n_a, n_b)
        gain_a_to_b = here - _log_gap_cost(np.maximum(d_a - 1, 0), d_b + 1, n_a, n_b)
        gain_b_to_a = here - _log_gap_cost(d_a + 1, np.maximum(d_b - 1, 0), n_a, n_b)
        per_posting = np.where(p_side, gain_b_to_a[terms], gain_a_to_b[terms])
        gain = np.bincount(local, weights=per_posting, minlength=n)
        a_idx = np.flatnonzero(~side)
        b_idx = np.flatnonzero(side)
        a_sorted = a_idx[np.argsort(-gain[a_idx], kind="stable")]
        b_sorted = b_idx[np.argsort(-gain[b_idx], kind="stable")]
        m = min(len(a_sorted), len(b_sorted))
        pair_gain = gain[a_sorted[:m]] + gain[b_sorted[:m]]
        swaps = int(np.count_nonzero(pair_gain > 0))  # non-increasing: a prefix
        if swaps == 0:
            break
        side[a_sorted[:swaps]] = True
        side[b_sorted[:swaps]] = False
    return np.concatenate([docs[~side], docs[side]])


def bp_order(indptr: np.ndarray, indices: np.ndarray, n_terms: int, *, leaf: int = 2048, iters: int = 20) -> np.ndarray:
    """Recursive graph bisection of the CSR documents ``(indptr, indices)`` down to ``leaf``
    documents a node; returns ``perm`` (see the module docstring)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    n = len(indptr) - 1
    order = np.arange(n, dtype=np.int64)
    stack = [(0, n)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo <= leaf:
            continue
        order[lo:hi] = _bisect(order[lo:hi], indptr, indices, n_terms, iters)
        mid = lo + _left_size(hi - lo)
        stack += [(lo, mid), (mid, hi)]
    return order


def top_term_order(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Documents sorted by (highest-weighted term, its weight descending); empty ones last."""
    indptr = np.asarray(indptr, dtype=np.int64)
    n = len(indptr) - 1
    lens = np.diff(indptr)
    row = np.repeat(np.arange(n), lens)
    # Per row, the position of its largest weight: sort postings by (row, -weight).
    by = np.lexsort((-np.asarray(data, dtype=np.float64), row))
    first = indptr[:-1][lens > 0]
    top = by[first]
    key_term = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    key_w = np.zeros(n)
    key_term[lens > 0] = np.asarray(indices, dtype=np.int64)[top]
    key_w[lens > 0] = np.asarray(data, dtype=np.float64)[top]
    return np.lexsort((np.arange(n), -key_w, key_term))
