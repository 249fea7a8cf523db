"""What every engine implements, and what every engine returns.

An engine scores one query batch against one index and returns its exact top-k on the
index's device (:class:`BatchResult`), following the contract of :mod:`gpusparse.exact`.
The registry and the one place that chooses an engine are in :mod:`gpusparse.engines`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from ..collection import SparseCollection
    from ..layout.postings import PostingLists

DEFAULT_MEMORY_BUDGET = 1 << 30
# Bytes of temporaries per (query, document) cell of one chunk: float64 accumulator,
# its float32 rounding and the int64 ranking key.
CELL_BYTES = 8 + 4 + 8
# Bytes of temporaries per expanded posting (pair, position, document, target, value).
POSTING_BYTES = 48


@dataclass(frozen=True)
class SearchPlan:
    """How one batch is searched: ``doc_chunk`` documents scored at a time (engines with a
    ``[B, doc_chunk]`` buffer), ``memory_budget`` bytes of temporaries, and ``cutoff``: for a
    batch whose results are merged with other searches' (shards), the tiled engine's hook
    that turns its candidates' lower bounds into a bound the merged k-th score reaches (see
    :func:`gpusparse.engines.tiled.engine.tiled_search`); other engines ignore it.
    ``to_host``: the caller takes the results to the host (:func:`gpusparse.search.complete_later`),
    so an engine may deliver them there itself (:attr:`BatchResult.host`). ``query_bits``: the
    queries are not yet quantized like the index's documents; the engine quantizes them to that
    many bits (:func:`gpusparse.quantize.quantize_queries`) before searching. Only for engines
    that say so (:attr:`Engine.quantizes_queries`)."""

    doc_chunk: int
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None
    to_host: bool = False
    query_bits: int | None = None


class HostDelivery(Protocol):
    """Results on their way to the host (:attr:`BatchResult.host`)."""

    def take(self, into: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor, ...]:
        """``(scores, ids, redo)`` as host tensors (one wait), ``scores``/``ids`` written into
        ``into`` (host tensors of their shapes) where given; ``redo`` may be ``None`` (no row
        flagged)."""
        ...


class BatchResult(NamedTuple):
    """One batch's top-k on the device, possibly before any host sync: ``scores``/``ids``
    ``[B, k]``; rows flagged in ``redo`` (bool ``[B]`` on the device; ``None``: no row) hold no
    valid results, and ``redo_search(rows)`` (host row numbers) returns theirs, ``(scores,
    ids)`` on the device. For a plan with ``to_host`` an engine may instead deliver the batch
    straight to the host: then ``host`` gives ``(scores, ids, redo)`` there and the three device
    fields are ``None``. ``repeat(queries, query_bits)``: where an engine has one, the same search
    of a later batch of queries (prepared as this one's, with the plan's ``query_bits``) with
    less host work, as a result delivered to the host; it returns ``None`` where it does not serve
    that batch (the caller then searches it the general way)."""

    scores: torch.Tensor | None
    ids: torch.Tensor | None
    redo: torch.Tensor | None = None
    redo_search: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]] | None = None
    host: HostDelivery | None = None
    repeat: Callable[[SparseCollection, int | None], BatchResult | None] | None = None

    def resolved(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, ids)`` on the device with the flagged rows searched again (one host sync
        when rows may be flagged). Not for results delivered to the host (``host``)."""
        if self.host is not None:
            raise RuntimeError("this batch's results were delivered to the host: take them with .host.take()")
        if self.redo is None:
            return self.scores, self.ids
        rows = self.redo.nonzero().flatten().cpu().numpy()
        if rows.size:
            if self.redo_search is None:
                raise RuntimeError("rows were flagged for another search, but no search was given")
            s2, i2 = self.redo_search(rows)
            at = torch.from_numpy(rows).to(self.scores.device)
            self.scores[at], self.ids[at] = s2, i2
        return self.scores, self.ids


class Engine(Protocol):
    """A search engine: a way to compute one batch's exact top-k.

    ``name`` is what ``kernel=`` and ``--kernel`` accept; ``auto_rank`` orders the engines
    ``kernel="auto"`` considers (the highest usable wins; 0: never chosen automatically);
    ``quantizes_queries``: it takes a plan's unquantized queries (:attr:`SearchPlan.query_bits`)
    and quantizes them itself (the tiled engine: on the device, in its CUDA graph).
    """

    name: ClassVar[str]
    auto_rank: ClassVar[int]
    quantizes_queries: ClassVar[bool]

    def unavailable(self, device: torch.device, *, auto: bool = False) -> str | None:
        """``None`` when the engine can run on ``device``, else the reason (a sentence).
        ``auto``: whether it should be chosen automatically there (an emulation or an
        interpreter can run, but is for tests, not speed)."""
        ...

    def search_batch(self, index: PostingLists, queries: SparseCollection, k: int, plan: SearchPlan) -> BatchResult:
        """Exact top-``k`` of one query batch, padded (see :func:`gpusparse.exact.pad_results`),
        on the index's device; or, for a ``plan`` with ``to_host``, possibly delivered to the host
        (:attr:`BatchResult.host`)."""
        ...


def plan_chunks(n_queries: int, n_docs: int, budget: int, batch_size: int | None) -> tuple[int, int]:
    """Queries per batch and documents per chunk so one chunk's cells fit ``budget``."""
    bq = max(1, min(n_queries, batch_size or 256))
    n_docs = max(1, n_docs)
    dc = budget // (bq * CELL_BYTES)
    floor = min(n_docs, 4096)
    if dc < floor and batch_size is None:
        bq = max(1, budget // (floor * CELL_BYTES))
        dc = budget // (bq * CELL_BYTES)
    if dc < 1:
        raise ValueError(f"memory_budget {budget} is too small for a batch of {bq} queries")
    return bq, int(min(n_docs, dc))
