"""The reference engine: scatter-add in PyTorch with float64 sums, on any device.

Exact by construction (float64 accumulators, then the certified top-k of
:func:`gpusparse.exact.select_exact_topk`); the other engines are tested against it and
against a float64 brute force, and the tiled engine sends it the rare rows whose scores
fall outside its fixed-point range.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ..exact import chunked_exact_topk, expand_ranges
from ..layout.postings import PostingLists, bisect_lists
from ..queries import QueryBatch, query_batch
from .base import POSTING_BYTES, BatchResult, SearchPlan

if TYPE_CHECKING:
    from ..collection import SparseCollection


class ReferenceEngine:
    """:func:`reference_search` behind the :class:`~gpusparse.engines.base.Engine` interface."""

    name: ClassVar[str] = "reference"
    auto_rank: ClassVar[int] = 10
    quantizes_queries: ClassVar[bool] = False

    def unavailable(self, device: torch.device, *, auto: bool = False) -> str | None:
        """Always usable."""
        return None

    def search_batch(self, index: PostingLists, queries: SparseCollection, k: int, plan: SearchPlan) -> BatchResult:
        """Exact top-``k`` of the batch (see :func:`reference_search`)."""
        out = reference_search(
            index, queries, k, doc_chunk=plan.doc_chunk, max_postings=plan.memory_budget // POSTING_BYTES
        )
        return BatchResult(*out)


def reference_search(
    index: PostingLists, queries: SparseCollection | QueryBatch, k: int, *, doc_chunk: int, max_postings: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter-add in PyTorch over documents in chunks of ``doc_chunk``, then exact top-k.

    Every (query, query-term) pair adds ``w_q · w_d`` for each posting of its term into a
    float64 ``[batch, doc_chunk]`` accumulator; each chunk's exact top-k is merged into the
    running top-k. Returns ``(scores, ids)`` ``[batch, k]`` on the index's device.
    """
    dev = index.device
    batch = queries if isinstance(queries, QueryBatch) else query_batch(queries, dev)
    bq, n = batch.padded_terms.shape[0], index.n_docs
    starts = index.offsets[batch.terms]
    ends = starts + index.lengths[batch.terms].to(torch.int64)
    weights64 = batch.weights.to(torch.float64)

    def fill(d0: int, width: int) -> torch.Tensor:
        if d0 == 0 and width == n:
            lo, hi = starts, ends
        else:
            lo = bisect_lists(index.doc_ids, starts, ends, d0)
            hi = bisect_lists(index.doc_ids, lo, ends, d0 + width)
        acc = torch.zeros(bq * width, dtype=torch.float64, device=dev)
        for pair, pos in expand_ranges(lo, hi, max_postings):
            target = batch.rows[pair] * width + (index.doc_ids[pos].to(torch.int64) - d0)
            acc.index_add_(0, target, weights64[pair] * index.scores[pos].to(torch.float64))
        return acc.view(bq, width)

    return chunked_exact_topk(index, batch, k, doc_chunk, fill)
