"""Exact scores and the exact top-k from approximate scores: the search contract's arithmetic.

Contract of every search path (engines and kernels included):

* ``score(q, d) = Σ_t w_q[t] · w_d[t]``, summed in float64 in ascending term order and
  rounded once to float32 (the *canonical* score), so that every path returns the same
  scores bit for bit;
* results are ranked by that float32 score, descending, ties broken by the lower
  internal document number;
* only documents sharing a term with the query (score > 0) are results; empty slots
  hold id ``-1`` and score ``0`` (:func:`pad_results`).

Fast paths score approximately, keep candidates with a proven error bound, and rescore the
uncertain ones canonically (:func:`exact_scores`, one CUDA launch on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .kernels import rescore
from .layout.postings import PostingLists, bisect_lists
from .queries import QueryBatch
from .topk import certified_candidates, merge_topk, topk_by_key


def exact_scores(
    index: PostingLists, batch: QueryBatch, rows: torch.Tensor, docs: torch.Tensor, *, max_cells: int = 1 << 22
) -> torch.Tensor:
    """Canonical scores of the pairs (query ``rows[i]``, document ``docs[i]``): float32 ``[M]``.

    Each score is the float64 sum of ``w_q[t] · w_d[t]`` over the query's terms in
    ascending term order (each posting found by binary search in the term's list),
    rounded once to float32. Every search path reports these scores, so all paths agree
    bit for bit.
    """
    m = docs.numel()
    out = torch.zeros(m, dtype=torch.float32, device=docs.device)
    width = batch.padded_terms.shape[1]
    if m == 0 or width == 0 or index.doc_ids.numel() == 0:
        return out
    if docs.is_cuda and rescore.available():  # one launch; same summation order, same bits
        return rescore.exact_scores_cuda(
            index.doc_ids, index.scores, index.offsets, index.lengths,
            batch.padded_terms.contiguous(), batch.padded_weights.contiguous(),
            rows.contiguous(), docs.contiguous().to(torch.int64),
        )  # fmt: skip
    valid = batch.padded_terms >= 0
    terms = torch.where(valid, batch.padded_terms, torch.zeros_like(batch.padded_terms))
    lo_q = torch.where(valid, index.offsets[terms], torch.zeros_like(terms))  # [B, T]
    hi_q = lo_q + torch.where(valid, index.lengths[terms].to(torch.int64), torch.zeros_like(terms))
    qw = batch.padded_weights.to(torch.float64)
    last = max(index.doc_ids.numel() - 1, 0)
    step = max(1, max_cells // width)  # pairs per step: [step, T] temporaries
    for a in range(0, m, step):
        r, d = rows[a : a + step], docs[a : a + step, None]
        lo, hi = lo_q[r], hi_q[r]
        pos = bisect_lists(index.doc_ids, lo, hi, d).clamp_max(last)
        found = (pos < hi) & (index.doc_ids[pos].to(torch.int64) == d)
        prod = torch.where(found, index.scores[pos].to(torch.float64), 0.0) * qw[r]
        acc = torch.zeros(r.numel(), dtype=torch.float64, device=docs.device)
        for j in range(width):  # sequential: the canonical summation order
            acc += prod[:, j]
        out[a : a + step] = acc.to(torch.float32)
    return out


def select_exact_topk(
    index: PostingLists, batch: QueryBatch, approx: torch.Tensor, k: int, base: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of one document chunk from approximate scores ``approx`` ``[B, W]``.

    Candidates are chosen with a proven error bound (:func:`certified_candidates`). A
    candidate's canonical float32 score is known without rescoring when both ends of its
    error interval round to the same float32 (the common case for float64 sums); the
    others are rescored canonically (:func:`exact_scores`). Then rank with the tie-break.
    """
    cols = certified_candidates(approx, k, batch.n_terms)
    docs = cols + base
    approx_c = approx.gather(1, cols).to(torch.float64)
    u = 2.0**-53 if approx.dtype == torch.float64 else 2.0**-24
    # Both the approximate and the canonical sum are within γ of the exact one: 2γ apart.
    g = 2 * (batch.n_terms.to(torch.float64)[:, None] + 1) * u / (1 - (batch.n_terms[:, None] + 1) * u)
    low, high = (approx_c * (1 - g)).to(torch.float32), (approx_c * (1 + g)).to(torch.float32)
    scores = low.clone()
    unsure = low != high
    if bool(unsure.any()):
        r, c = unsure.nonzero(as_tuple=True)
        scores[r, c] = exact_scores(index, batch, r, docs[r, c])
    return topk_by_key(scores, docs, k)


def chunked_exact_topk(
    index: PostingLists,
    batch: QueryBatch,
    k: int,
    doc_chunk: int,
    fill: Callable[[int, int], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k over documents in chunks: ``fill(d0, width)`` gives approximate scores
    ``[B, width]`` of documents ``d0 .. d0 + width - 1``; each chunk's exact top-k
    (:func:`select_exact_topk`) is merged into the running one. ``(scores, ids)`` ``[B, k]``."""
    bq, n = batch.padded_terms.shape[0], index.n_docs
    best = None
    for d0 in range(0, n, doc_chunk):
        width = min(doc_chunk, n - d0)
        top = select_exact_topk(index, batch, fill(d0, width), k, d0)
        best = top if best is None else merge_topk(best, top, k)
    return pad_results(best, k, bq, index.device)


def pad_results(
    best: tuple[torch.Tensor, torch.Tensor] | None, k: int, bq: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to ``k`` columns and blank out non-matching documents (score 0 → id -1)."""
    scores = torch.zeros((bq, k), dtype=torch.float32, device=dev)
    ids = torch.full((bq, k), -1, dtype=torch.int64, device=dev)
    if best is not None:
        s, i = best
        kk = s.shape[1]
        hit = s > 0
        scores[:, :kk] = torch.where(hit, s, torch.zeros_like(s))
        ids[:, :kk] = torch.where(hit, i, torch.full_like(i, -1))
    return scores, ids


def expand_ranges(lo: torch.Tensor, hi: torch.Tensor, max_postings: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """All positions of the ranges ``[lo[p], hi[p])``, as (pair, position), in pieces.

    Pieces hold at most ``max_postings`` positions (a range may span pieces), and
    positions come in pair order, so accumulation order does not depend on the pieces.
    """
    counts = (hi - lo).clamp_min(0)
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if ends.numel() else 0
    step = max(1, int(max_postings))
    first = ends - counts
    for a in range(0, total, step):
        flat = torch.arange(a, min(total, a + step), device=lo.device)
        pair = torch.searchsorted(ends, flat, right=True)
        yield pair, lo[pair] + (flat - first[pair])
