"""Exactness report: a run against an independent exact scorer.

The scorer shares no code with the index's search: it multiplies the queries by the
documents with **scipy sparse products in float64 on the CPU**, streaming over chunks of
documents so that only ``[queries × chunk]`` scores exist at a time. scipy's CSR product
adds each query's terms in their stored (ascending) order, so its float64 sum rounded to
float32 is the contract's canonical score. The check is strict:

* every score of the run, read as a float32, **equals** float32(exact float64 sum);
* every returned list is the exact ranking, in order: score descending, ties by the lower
  document number, only scores > 0, as many results as the run's depth allows;
* the rank column (when the run has one) counts 1, 2, 3, ... in the listed order.

The report lists the first mismatches (query, rank, what differs) and, for k in
(10, 100, 1000), ``Recall@k`` of the exact top-k and the queries whose list is identical.
``sample`` checks a random subset of the queries, reading only the posting lists of their
terms (bounded memory and time at any collection size).

What it shares with GPUSparse: none of the search code (an import-linter contract forbids
index, layout, search, engines, kernels, exact, topk and queries). :func:`quantize_levels`
and :func:`quantize_query_rows` re-implement the quantization rule here; :func:`read_run`
parses TREC runs here. The CLI reads the query and ``--docs`` vector files with
:func:`gpusparse.formats.read_vectors`, the same reader indexing uses.
"""

from __future__ import annotations

import gzip
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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
    mismatches: list[str] = field(default_factory=list)
    n_mismatches: dict[str, int] = field(default_factory=dict)
    sampled: int | None = None

    @property
    def exact(self) -> bool:
        """Every score equals float32(exact float64 sum), every list is the exact ranking in
        order (ties by document number) and every rank column counts 1, 2, 3, ..."""
        return not any(self.n_mismatches.values())

    def lines(self) -> list[str]:
        """The report as printed by ``gpusparse verify``."""
        which = f"{self.n_queries:,} queries"
        if self.sampled is not None:
            which = f"a random sample of {self.sampled:,} of {self.n_queries:,} queries"
        out = [
            f"checked {which} ({self.queries_with_matches:,} match a document) against an exact "
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
        out.append(f"max |score - exact| {self.max_abs_diff:.3g} ({self.max_ulp_diff:.0f} float32 steps{where})")
        counts = ", ".join(f"{n:,} {kind}" for kind, n in self.n_mismatches.items())
        out.append(f"mismatches: {counts}")
        if self.mismatches:
            out.append(f"first mismatches ({len(self.mismatches)} shown):")
            out.extend(f"  {m}" for m in self.mismatches)
        out.extend(self.notes)
        out.append("exact: yes" if self.exact else "exact: NO")
        return out

    def as_dict(self) -> dict[str, Any]:
        """For JSON output."""
        return {
            "queries": self.n_queries,
            "sampled_queries": self.sampled,
            "documents": self.n_docs,
            "queries_with_matches": self.queries_with_matches,
            "depth": self.depth,
            "recall": {f"R@{k}": r for k, r in self.recall.items()},
            "identical_queries": {f"@{k}": n for k, n in self.identical_queries.items()},
            "max_abs_score_diff": self.max_abs_diff,
            "max_ulp_score_diff": self.max_ulp_diff,
            "mismatches": self.n_mismatches,
            "first_mismatches": self.mismatches,
            "exact": self.exact,
        }


def read_run(path: str | Path) -> dict[str, list[tuple[str, float, int]]]:
    """A TREC run (``qid Q0 docid rank score tag``) as ``{qid: [(docid, score, rank), ...]}`` in
    file order. Parsed here, independently of :mod:`gpusparse.trec`."""
    path = Path(path)
    run: dict[str, list[tuple[str, float, int]]] = {}
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                parts = line.split()
                if not parts:
                    continue
                if len(parts) != 6:
                    raise InputError(
                        f"expected 6 columns (qid Q0 docid rank score tag), got {len(parts)}", path=path, line=lineno
                    )
                try:
                    rank, score = int(parts[3]), float(parts[4])
                except ValueError:
                    raise InputError(f"bad rank {parts[3]!r} or score {parts[4]!r}", path=path, line=lineno) from None
                if not math.isfinite(score):
                    raise InputError(f"score {parts[4]!r} is not finite", path=path, line=lineno)
                run.setdefault(parts[0], []).append((parts[2], score, rank))
    except OSError as e:
        raise InputError(f"cannot read the run: {e.strerror or e}", path=path) from None
    return run


def power_of_two_step(max_weight: float, bits: int) -> float:
    """The smallest power of two ``step`` with ``max_weight / step <= 2**bits - 1`` (1 for none)."""
    top = (1 << bits) - 1
    if not max_weight > 0:
        return 1.0
    m, e = math.frexp(max_weight / top)  # max/top = m · 2**e, m in [0.5, 1)
    step = math.ldexp(1.0, e - 1 if m == 0.5 else e)
    while max_weight / step > top:
        step *= 2
    return step


def quantize_levels(matrix: sp.csr_matrix, steps: np.ndarray | float, bits: int) -> sp.csr_matrix:
    """Weights as ``round_half_even(w / step) · step`` (float32), levels clipped to
    ``0 .. 2**bits - 1``, zero levels dropped; ``steps``: one step, or one per row."""
    m = sp.csr_matrix(matrix, dtype=np.float32, copy=True)
    per_value = np.repeat(np.asarray(steps, dtype=np.float64), np.diff(m.indptr)) if np.ndim(steps) else steps
    lev = np.clip(np.rint(m.data.astype(np.float64) / per_value), 0, (1 << bits) - 1)
    m.data = (lev * per_value).astype(np.float32)
    m.eliminate_zeros()
    return m


def quantize_query_rows(queries: sp.csr_matrix, bits: int) -> sp.csr_matrix:
    """Each query quantized with its own power-of-two step (that of its largest weight)."""
    q = sp.csr_matrix(queries)
    row_max = np.zeros(q.shape[0])
    nz = np.diff(q.indptr) > 0
    row_max[nz] = np.maximum.reduceat(q.data.astype(np.float64), q.indptr[:-1][nz])
    return quantize_levels(q, np.array([power_of_two_step(float(x), bits) for x in row_max]), bits)


def documents_from_index_arrays(
    doc_ids: np.ndarray,
    scores: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    n_docs: int,
    terms: np.ndarray | None = None,
) -> sp.csr_matrix:
    """The ``[n_docs, V]`` document matrix held by inverted-index arrays (padding left out).

    Reads the posting lists as the columns of a CSC matrix and converts it with scipy.
    ``terms``: read only these terms' lists (the others are empty columns), so a sample of
    queries needs memory for its own terms' postings only.
    """
    doc_ids = np.asarray(doc_ids)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if terms is not None:
        keep = np.zeros(lengths.size, dtype=bool)
        keep[np.asarray(terms, dtype=np.int64)] = True
        lengths = np.where(keep, lengths, 0)
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
    q = sp.csr_matrix(q, copy=True)
    q.sum_duplicates()  # and sorts each row's terms: scipy then adds them in ascending term order
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


def sample_rows(n_queries: int, sample: int | None, seed: int = 0) -> np.ndarray:
    """The query rows a check covers: all, or ``sample`` drawn at random with ``seed`` (sorted)."""
    if sample is None or sample >= n_queries:
        return np.arange(n_queries)
    if sample < 1:
        raise ValueError("sample must be positive")
    return np.sort(np.random.default_rng(seed).choice(n_queries, size=int(sample), replace=False))


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
    sample: int | None = None,
    seed: int = 0,
    max_shown: int = 10,
) -> VerifyReport:
    """Compare ``run`` (``{qid: [(docid, score) or (docid, score, rank), ...]}`` in rank order)
    with exact search, strictly (see the module's docstring).

    ``queries`` must hold every query of the run (a query of ``queries`` missing from the
    run has no results); every document of the run must be in ``doc_ids``. ``sample``:
    check only that many queries drawn at random (``seed``) from ``queries``.
    """
    t0 = time.perf_counter()
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError("ks must be positive")
    qrow = {q: i for i, q in enumerate(queries.ids)}
    unknown_q = [q for q in run if q not in qrow]
    if unknown_q:
        raise InputError(
            f"{len(unknown_q):,} queries of the run are not in the queries file (e.g. {unknown_q[0]!r})", path=run_name
        )
    qmat = queries.to_scipy()
    rows = sample_rows(len(queries), sample, seed)
    qids = [queries.ids[i] for i in rows]
    dnum = {d: i for i, d in enumerate(doc_ids)}
    pq: list[int] = []
    pd: list[int] = []
    ps: list[float] = []
    pr: list[int] = []  # rank column, 0 when absent
    ranked: dict[int, list[int]] = {}
    for j, q in enumerate(qids):
        lst = ranked.setdefault(j, [])
        for row in run.get(q, ()):
            doc, score = row[0], row[1]
            n = dnum.get(doc)
            if n is None:
                raise InputError(f"query {q!r}: document {doc!r} is not in the index", path=run_name)
            pq.append(j)
            pd.append(n)
            ps.append(score)
            pr.append(int(row[2]) if len(row) > 2 else len(lst) + 1)
            lst.append(n)
    depth = max((len(v) for v in run.values()), default=0)
    top, exact_pair = exact_topk(
        docs,
        qmat[rows],
        max(max(ks), depth, 1),
        pairs=(np.asarray(pq, dtype=np.int64), np.asarray(pd, dtype=np.int64)),
        memory_budget=memory_budget,
        progress=progress,
    )
    n_match = np.count_nonzero(top.ids >= 0, axis=1)
    matching = np.flatnonzero(n_match > 0)
    recall: dict[int, float | None] = {}
    identical: dict[int, int] = {}
    for k in ks:
        if k > depth and np.any(n_match > depth):
            recall[k], identical[k] = None, 0
            continue
        shares = []
        same = 0
        for i in matching:
            want = top.ids[i, : min(k, int(n_match[i]))]
            got = ranked.get(int(i), [])[:k]
            shares.append(np.intersect1d(want, got).size / want.size)
            same += int(len(got) == want.size and np.array_equal(want, got))
        recall[k] = float(np.mean(shares)) if shares else 1.0
        identical[k] = same
    counts = {"scores": 0, "order": 0, "rank column": 0}
    shown: list[str] = []

    def report(kind: str, text: str) -> None:
        counts[kind] += 1
        if len(shown) < max_shown:
            shown.append(text)

    # Scores are float32 values (GPUSparse writes their shortest decimal form): read them as such.
    run32 = np.asarray(ps, dtype=np.float64).astype(np.float32)
    ex = exact_pair if exact_pair is not None else np.zeros(0)
    ex32 = ex.astype(np.float32)
    # Ranking: each list must be the exact one, in order, as deep as the run allows.
    for j in range(len(rows)):
        got = ranked.get(j, [])
        want = top.ids[j, : min(depth, int(n_match[j]))]
        for r in range(max(len(got), want.size)):
            if r >= len(got):
                report(
                    "order",
                    f"query {qids[j]!r}: missing rank {r + 1}, document {doc_ids[want[r]]!r} "
                    f"(exact score {np.float32(top.scores[j, r])})",
                )
                break
            if r >= want.size:
                report(
                    "order",
                    f"query {qids[j]!r} rank {r + 1}: document {doc_ids[got[r]]!r} is past the "
                    f"{want.size} documents that match the query",
                )
                break
            if got[r] != want[r]:
                report(
                    "order",
                    f"query {qids[j]!r} rank {r + 1}: document {doc_ids[got[r]]!r}, the exact ranking "
                    f"has {doc_ids[want[r]]!r} "
                    f"(score {np.float32(top.scores[j, r])}; ties by document number)",
                )
                break
    pq_arr = np.asarray(pq, dtype=np.int64)
    position = np.arange(pq_arr.size) - np.searchsorted(pq_arr, pq_arr) + 1  # 1-based, within the query's list
    bad_score = run32 != ex32
    bad_rank = np.asarray(pr, dtype=np.int64) != position
    for p in np.flatnonzero(bad_score | bad_rank).tolist():
        q, d = qids[pq[p]], doc_ids[pd[p]]
        if bad_score[p]:
            report(
                "scores",
                f"query {q!r} document {d!r}: score {run32[p]}, exact float32 {ex32[p]} (float64 {ex[p]})",
            )
        if bad_rank[p]:
            report(
                "rank column", f"query {q!r} document {d!r}: rank column says {pr[p]}, listed at position {position[p]}"
            )
    worst = None
    max_abs = max_ulp = 0.0
    notes: list[str] = []
    if run32.size:
        diff = np.abs(run32.astype(np.float64) - ex)
        steps = np.abs(run32.view(np.int32).astype(np.int64) - ex32.view(np.int32).astype(np.int64))
        p = int(np.argmax(steps)) if steps.any() else int(np.argmax(diff))
        max_abs, max_ulp = float(diff.max()), float(steps[p])
        worst = (qids[pq[p]], doc_ids[pd[p]], float(run32[p]), float(ex[p]))
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
        mismatches=shown,
        n_mismatches=counts,
        sampled=len(rows) if sample is not None else None,
    )
