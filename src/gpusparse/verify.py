"""Exactness report: a run against an independent exact scorer.

The scorer shares no code with the index's search: it multiplies the queries by the
documents with **scipy sparse products in float64 on the CPU**, streaming over chunks of
documents so that only ``[queries × chunk]`` scores exist at a time, and keeps the exact
top-k of each query under the contract of :mod:`gpusparse.search` (score rounded to
float32, descending; ties by the lower document number; only scores > 0).

The report gives, for k in (10, 100, 1000):

* ``Recall@k``: the share of the exact top-k that the run's first k results hold,
  averaged over the queries that match at least one document;
* the largest ``|run score − exact float64 score|`` over all results of the run, also in
  float32 ulps of the exact score (≤ 0.5 means the run's score is the exact score
  correctly rounded to float32). Run scores are taken as float32 values, which is what
  GPUSparse writes (in their shortest decimal form).

Documents come from the index's own arrays (read as a CSC matrix, no index code) or, for
a check that trusts nothing built by GPUSparse, from the original vector files.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
from tqdm.auto import tqdm

from .collection import SparseCollection
from .errors import InputError

DEFAULT_KS = (10, 100, 1000)
DEFAULT_BUDGET = 256 << 20  # bytes of float64 scores per chunk
ULP_TOLERANCE = 0.5 + 1e-6  # correctly rounded float32, plus the exact scorer's own float64 error

Run = Mapping[str, Sequence[tuple[str, float]]]


@dataclass(frozen=True)
class ExactTopK:
    """The exact top-k of each query: internal document numbers (``-1`` = none) and float64 scores."""

    ids: np.ndarray
    scores: np.ndarray


@dataclass
class VerifyReport:
    """How a run compares with exact search."""

    n_queries: int
    n_docs: int
    depth: int
    recall: dict[int, float | None]
    identical_queries: dict[int, int]
    queries_with_matches: int
    max_abs_diff: float
    max_ulp_diff: float
    worst: tuple[str, str, float, float] | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Every reported recall is 1 and every score is the exact one rounded to float32."""
        recalls = [r for r in self.recall.values() if r is not None]
        return all(r == 1.0 for r in recalls) and self.max_ulp_diff <= ULP_TOLERANCE

    def lines(self) -> list[str]:
        """The report as printed by ``gpusparse verify``."""
        out = [
            f"checked {self.n_queries:,} queries ({self.queries_with_matches:,} match a document) against an exact "
            f"float64 scorer over {self.n_docs:,} documents in {self.seconds:.1f} s"
        ]
        for k, r in self.recall.items():
            if r is None:
                out.append(f"Recall@{k:<6} n/a (the run holds at most {self.depth} results per query)")
            else:
                out.append(
                    f"Recall@{k:<6} {r:.6f}  ({self.identical_queries[k]:,} of {self.queries_with_matches:,} "
                    "queries identical)"
                )
        where = ""
        if self.worst is not None:
            where = f"; query {self.worst[0]!r}, document {self.worst[1]!r}"
        out.append(f"max |score - exact| {self.max_abs_diff:.3g} ({self.max_ulp_diff:.3g} float32 ulp{where})")
        out.extend(self.notes)
        out.append("exact: yes" if self.exact else "exact: NO")
        return out

    def as_dict(self) -> dict[str, Any]:
        """For JSON output."""
        return {
            "queries": self.n_queries,
            "documents": self.n_docs,
            "queries_with_matches": self.queries_with_matches,
            "depth": self.depth,
            "recall": {f"R@{k}": r for k, r in self.recall.items()},
            "identical_queries": {f"@{k}": n for k, n in self.identical_queries.items()},
            "max_abs_score_diff": self.max_abs_diff,
            "max_ulp_score_diff": self.max_ulp_diff,
            "exact": self.exact,
        }


def documents_from_index_arrays(
    doc_ids: np.ndarray, scores: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, n_docs: int
) -> sp.csr_matrix:
    """The ``[n_docs, V]`` document matrix held by inverted-index arrays (padding left out).

    Reads the posting lists as the columns of a CSC matrix and converts it with scipy.
    """
    doc_ids = np.asarray(doc_ids)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n_terms = lengths.size
    starts = np.repeat(offsets, lengths)
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    take = starts + within
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    csc = sp.csc_matrix(
        (np.asarray(scores)[take].astype(np.float32), doc_ids[take].astype(np.int64), indptr), shape=(n_docs, n_terms)
    )
    return csc.tocsr()


def exact_topk(
    docs: sp.csr_matrix | SparseCollection,
    queries: SparseCollection | sp.csr_matrix,
    k: int,
    *,
    pairs: tuple[np.ndarray, np.ndarray] | None = None,
    memory_budget: int = DEFAULT_BUDGET,
    progress: bool = False,
) -> tuple[ExactTopK, np.ndarray | None]:
    """Exact top-``k`` of every query by streamed float64 scipy products.

    Args:
        docs: ``[n_docs, V]`` document vectors.
        queries: ``[n_queries, V']`` query vectors (``V' <= V``).
        k: results per query.
        pairs: optional ``(query rows, document numbers)`` whose exact scores to return too.
        memory_budget: bytes of dense float64 scores per chunk.
        progress: show a progress bar.

    Returns:
        ``(ExactTopK, scores of pairs or None)``.
    """
    d = docs.to_scipy() if isinstance(docs, SparseCollection) else sp.csr_matrix(docs)
    q = queries.to_scipy() if isinstance(queries, SparseCollection) else sp.csr_matrix(queries)
    if q.shape[1] > d.shape[1]:
        raise InputError(f"queries have {q.shape[1]} terms but the documents {d.shape[1]}", field="vocabulary")
    q = sp.csr_matrix((q.data.astype(np.float64), q.indices, q.indptr), shape=(q.shape[0], d.shape[1]))
    n_q, n_d = q.shape[0], d.shape[0]
    best_ids = np.full((n_q, k), -1, dtype=np.int64)
    best_s = np.zeros((n_q, k), dtype=np.float64)
    pair_scores = None
    if pairs is not None:
        pq, pd = (np.asarray(a, dtype=np.int64) for a in pairs)
        by_doc = np.argsort(pd, kind="stable")
        pq_sorted, pd_sorted = pq[by_doc], pd[by_doc]
        pair_scores = np.zeros(pq.size, dtype=np.float64)
    chunk = max(1, min(n_d, memory_budget // (8 * max(1, n_q))))
    bar = tqdm(total=n_d, unit="doc", desc="exact scoring", disable=not progress or None, leave=False)
    for a in range(0, n_d, chunk):
        b = min(n_d, a + chunk)
        block = d[a:b]
        dchunk = sp.csr_matrix((block.data.astype(np.float64), block.indices, block.indptr), shape=block.shape)
        s = (q @ dchunk.T).toarray()  # [n_q, b - a] float64
        _merge_topk(best_ids, best_s, s, a)
        if pairs is not None:
            lo, hi = np.searchsorted(pd_sorted, [a, b])
            pair_scores[by_doc[lo:hi]] = s[pq_sorted[lo:hi], pd_sorted[lo:hi] - a]
        bar.update(b - a)
    bar.close()
    return ExactTopK(best_ids, best_s), pair_scores


def _merge_topk(best_ids: np.ndarray, best_s: np.ndarray, s: np.ndarray, base: int) -> None:
    """Merge chunk scores ``s`` (documents ``base ..``) into the running top-k, in place."""
    k = best_ids.shape[1]
    s32 = s.astype(np.float32)
    kk = min(k, s.shape[1])
    # A threshold per query: every document of the chunk's top-k scores at least it (ties included).
    thr = -np.partition(-s32, kk - 1, axis=1)[:, kk - 1]
    for i in range(s.shape[0]):
        cand = np.flatnonzero((s32[i] >= thr[i]) & (s32[i] > 0))
        if cand.size == 0:
            continue
        have = best_ids[i] >= 0
        ids = np.concatenate([best_ids[i][have], cand + base])
        sc = np.concatenate([best_s[i][have], s[i][cand]])
        order = np.lexsort((ids, -sc.astype(np.float32)))[:k]
        best_ids[i, : order.size], best_s[i, : order.size] = ids[order], sc[order]


def verify_run(
    run: Run,
    queries: SparseCollection,
    docs: sp.csr_matrix | SparseCollection,
    doc_ids: Sequence[str],
    *,
    ks: Sequence[int] = DEFAULT_KS,
    memory_budget: int = DEFAULT_BUDGET,
    progress: bool = False,
    run_name: str | None = None,
) -> VerifyReport:
    """Compare ``run`` (``{qid: [(docid, score), ...]}`` in rank order) with exact search.

    ``queries`` must hold every query of the run (a query of ``queries`` missing from the
    run has no results); every document of the run must be in ``doc_ids``.
    """
    t0 = time.perf_counter()
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError("ks must be positive")
    qrow = {q: i for i, q in enumerate(queries.ids)}
    dnum = {d: i for i, d in enumerate(doc_ids)}
    unknown_q = [q for q in run if q not in qrow]
    if unknown_q:
        raise InputError(
            f"{len(unknown_q):,} queries of the run are not in the queries file (e.g. {unknown_q[0]!r})", path=run_name
        )
    pq: list[int] = []
    pd: list[int] = []
    ps: list[float] = []
    ranked: dict[int, list[int]] = {}
    for q, rows in run.items():
        lst = ranked.setdefault(qrow[q], [])
        for doc, score in rows:
            n = dnum.get(doc)
            if n is None:
                raise InputError(f"query {q!r}: document {doc!r} is not in the index", path=run_name)
            pq.append(qrow[q])
            pd.append(n)
            ps.append(score)
            lst.append(n)
    depth = max((len(v) for v in ranked.values()), default=0)
    top, exact_pair = exact_topk(
        docs, queries, max(ks), pairs=(np.asarray(pq), np.asarray(pd)), memory_budget=memory_budget, progress=progress
    )
    n_match = np.count_nonzero(top.ids >= 0, axis=1)
    matching = np.flatnonzero(n_match > 0)
    recall: dict[int, float | None] = {}
    identical: dict[int, int] = {}
    notes: list[str] = []
    for k in ks:
        if k > depth and np.any(n_match > depth):
            recall[k], identical[k] = None, 0
            continue
        shares = []
        same = 0
        for i in matching:
            want = top.ids[i, : min(k, int(n_match[i]))]
            got = ranked.get(int(i), [])[:k]
            hit = np.intersect1d(want, got).size
            shares.append(hit / want.size)
            same += int(hit == want.size and len(got) == want.size)
        recall[k] = float(np.mean(shares)) if shares else 1.0
        identical[k] = same
    # Scores are float32 values (GPUSparse writes their shortest decimal form): read them as such.
    ps_arr = np.asarray(ps, dtype=np.float64).astype(np.float32).astype(np.float64)
    ex = exact_pair if exact_pair is not None else np.zeros(0)
    worst = None
    max_abs = max_ulp = 0.0
    if ps_arr.size:
        diff = np.abs(ps_arr - ex)
        ulp = np.spacing(np.abs(ex).astype(np.float32)).astype(np.float64)
        ulps = diff / np.maximum(ulp, np.finfo(np.float32).smallest_subnormal)
        j = int(np.argmax(ulps))
        max_abs, max_ulp = float(diff.max()), float(ulps[j])
        worst = (queries.ids[pq[j]], doc_ids[pd[j]], float(ps_arr[j]), float(ex[j]))
        zero = int(np.count_nonzero(ex == 0))
        if zero:
            notes.append(f"{zero:,} results of the run share no term with their query (exact score 0)")
    return VerifyReport(
        n_queries=len(queries),
        n_docs=len(doc_ids),
        depth=depth,
        recall=recall,
        identical_queries=identical,
        queries_with_matches=int(matching.size),
        max_abs_diff=max_abs,
        max_ulp_diff=max_ulp,
        worst=worst,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )
