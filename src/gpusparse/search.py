"""Exact batched search: argument checks, the batch plan and the pipelined batch loop.

This module orchestrates; it computes nothing itself. The engine is chosen once per call
by :func:`gpusparse.engines.choose` and searches one batch at a time
(:meth:`~gpusparse.engines.base.Engine.search_batch`); the results' contract is
:mod:`gpusparse.exact`'s. Batch ``i + 1`` is launched before batch ``i`` is waited for
(:func:`run_batches`), so the host's part of a batch overlaps the device's work.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from tqdm.auto import tqdm

from . import engines
from .engines.base import DEFAULT_MEMORY_BUDGET, BatchResult, SearchPlan, plan_chunks
from .layout.statistics import max_score, max_scores_host
from .queries import as_queries, as_they_are, prepare_queries_deferred
from .transfer import output_buffers, results_to_host, start_to_host

if TYPE_CHECKING:
    from .collection import SparseCollection
    from .layout.postings import PostingLists


# Results are padded up to k columns when k is at most this (or the collection's size);
# a larger k than both gets exactly one column per document (see result_width).
MAX_PADDED_K = 10_000


class _ScoresIds(NamedTuple):
    scores: torch.Tensor
    ids: torch.Tensor


class SearchResults(_ScoresIds):
    """Top-k results: ``scores`` float32 and ``ids`` int64, both ``[n_queries, w]`` with
    ``w = result_width(k, n_docs)``.

    ``ids`` are the index's internal **row numbers** (``0 .. n_docs - 1``; ``-1`` pads), not
    the document ids of the collection: ``index.ids[i]`` names row ``i``, and
    :meth:`gpusparse.Index.doc_ids_of` turns a whole result into string ids. It unpacks as
    ``scores, ids = res``; ``engine`` (an attribute, not a tuple field) names the engine
    that searched (``"tiled"``, ``"scatter"``, ``"reference"`` ...; ``""`` when unknown).
    """

    engine: str

    def __new__(cls, scores: torch.Tensor, ids: torch.Tensor, engine: str = "") -> SearchResults:
        self = super().__new__(cls, scores, ids)
        self.engine = engine
        return self

    def __getnewargs__(self) -> tuple[torch.Tensor, torch.Tensor, str]:  # type: ignore[override]
        return (self.scores, self.ids, self.engine)

    def _replace(self, **changes: torch.Tensor) -> SearchResults:  # type: ignore[override]
        return SearchResults(changes.get("scores", self.scores), changes.get("ids", self.ids), self.engine)


def result_width(k: int, n_docs: int) -> int:
    """Columns of a search's results: ``k``, padded beyond the ``n_docs`` documents while
    ``k <= MAX_PADDED_K``; a ``k`` larger than both gets ``n_docs`` columns (every document's
    slot; padding to ``k = 10**11`` would need terabytes)."""
    return k if k <= max(n_docs, MAX_PADDED_K) else n_docs


def search_width(k: int, n_docs: int) -> int:
    """The ``k`` an engine searches with: at most the ``n_docs`` documents (at least 1), so that
    a huge ``k`` costs no more than ``k = n_docs``."""
    return max(1, min(k, n_docs))


def padded(results: SearchResults, width: int) -> SearchResults:
    """``results`` cut or padded (score 0, id -1) to ``width`` columns."""
    n, have = results.scores.shape
    if have == width:
        return results
    if have > width:  # only padding columns go (width >= the documents searched)
        return SearchResults(
            results.scores[:, :width].contiguous(), results.ids[:, :width].contiguous(), results.engine
        )
    scores = torch.zeros((n, width), dtype=results.scores.dtype, device=results.scores.device)
    ids = torch.full((n, width), -1, dtype=results.ids.dtype, device=results.ids.device)
    scores[:, :have], ids[:, :have] = results.scores, results.ids
    return SearchResults(scores, ids, results.engine)


def check_search_args(k: object, batch_size: int | None, memory_budget: int | None) -> int:
    """Refuse a bad ``k``, ``batch_size`` or ``memory_budget``; the budget in bytes."""
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive integer, not {k!r}")
    if batch_size is not None and batch_size <= 0:
        raise ValueError("batch_size must be positive")
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
    if budget < 1 << 16:
        raise ValueError("memory_budget must be at least 64 KiB")
    return budget


class Search:
    """A search's arguments resolved against an index once: the checks of ``k``, ``batch_size``
    and ``memory_budget``, the engine (:func:`gpusparse.engines.choose`), the statistics queries
    are checked against, and (at the first call, after its queries are checked) the lists on
    the device. Calling it searches as :func:`search` does; :meth:`gpusparse.Index.search`
    keeps one per set of arguments, so that a batch's host time goes to the batch (a few µs
    of resolution each, measured at ~0.02 ms of a small batch's latency on an H200's host).
    A call of one batch keeps its engine's :attr:`~gpusparse.engines.base.BatchResult.repeat`:
    the next call, where it is one batch the repeat serves, goes there without the batch loop
    (its vocabulary checked before the launch, its score bound while the device works; at 8.8M
    x 256 on an H200, 8-bit, top-10: 3.184 against 3.237 ms host to host in one process)."""

    def __init__(
        self,
        index: PostingLists,
        k: int = 1000,
        *,
        batch_size: int | None = None,
        device: str | torch.device | None = None,
        kernel: str = "auto",
        memory_budget: int | None = None,
    ) -> None:
        self.budget = check_search_args(k, batch_size, memory_budget)
        self.source = index
        self.device = index.device if device is None else torch.device(device)
        self.engine = engines.choose(kernel, self.device)
        # an engine that quantizes the queries itself (the tiled engine: on the device) gets them as they are
        self.defer = self.engine.quantizes_queries
        # the bits prepare_queries_deferred leaves the engine to quantize to, where it proves the bound
        self.bits = index.quantization.bits if self.defer and index.quantization is not None else None
        self.statistics = max_scores_host(index), max_score(index)
        self.k, self.batch_size = k, batch_size
        self.index: PostingLists | None = None  # the lists on the device: at the first call
        # the engine's repeat of the last call's one batch (BatchResult.repeat)
        self.repeat: Callable[[SparseCollection, int | None], BatchResult | None] | None = None
        self.width: int | None = None  # the results' width where it is not the searched k's

    def __call__(self, queries: object, *, progress: bool = False) -> SearchResults:
        src = self.source
        if self.repeat is not None and not progress:
            # A call of one batch as the last one was: the engine's repeat, without the batch loop's
            # layers. The vocabulary is checked before the launch (it guards the term ids), the score
            # bound while the device works: where it is not proven from two reductions, the results
            # are dropped and the batch is prepared (quantized on the host, or refused) as any other.
            queries = as_queries(queries, src.vocab)
            res = self.repeat(queries, self.bits)
            if res is not None:
                if as_they_are(queries, src.quantization, *self.statistics, defer=self.defer):
                    out = SearchResults(*complete_later(res)(), engine=self.engine.name)
                    return out if self.width is None else padded(out, self.width)
                if res.host is not None:
                    res.host.take()
        q, bits = prepare_queries_deferred(queries, src.vocab, src.quantization, *self.statistics, defer=self.defer)
        idx = self.index
        if idx is None:
            idx = self.index = src.resident_on(self.device)
        engine, kk = self.engine, search_width(self.k, idx.n_docs)
        made: list[BatchResult] = []

        def one(part: SparseCollection, plan: SearchPlan) -> BatchResult:
            made.append(engine.search_batch(idx, part, kk, plan))
            return made[-1]

        res = search_batches(
            one, q, kk, idx.n_docs, self.device, budget=self.budget, batch_size=self.batch_size, progress=progress,
            engine=engine.name, query_bits=bits,
        )  # fmt: skip
        # one batch: its engine's repeat serves the next call of that batch's shape
        self.repeat = made[0].repeat if len(made) == 1 else None
        width = result_width(self.k, idx.n_docs)
        self.width = None if width == kk else width
        return padded(res, width)


def search(
    index: PostingLists,
    queries: object,
    k: int = 1000,
    *,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    kernel: str = "auto",
    memory_budget: int | None = None,
    progress: bool = False,
) -> SearchResults:
    """Exact top-``k`` search; see :meth:`gpusparse.Index.search`. An index on another
    device than ``device`` is copied there once and kept for later searches
    (:meth:`~gpusparse.layout.postings.PostingLists.resident_on`)."""
    return Search(index, k, batch_size=batch_size, device=device, kernel=kernel, memory_budget=memory_budget)(
        queries, progress=progress
    )


def search_batches(
    search_batch: Callable[[SparseCollection, SearchPlan], BatchResult],
    queries: SparseCollection,
    k: int,
    n_docs: int,
    device: torch.device,
    *,
    budget: int,
    batch_size: int | None,
    progress: bool = False,
    engine: str = "",
    query_bits: int | None = None,
) -> SearchResults:
    """Prepared ``queries`` in batches (:func:`~gpusparse.engines.base.plan_chunks` for
    ``n_docs`` documents and ``budget`` bytes), each searched by ``search_batch(part, plan)``
    and brought to the host pipelined (:func:`run_batches`); ``engine`` names it in the results.
    ``query_bits``: the queries are still to be quantized (:attr:`SearchPlan.query_bits`)."""
    bq, dc = plan_chunks(len(queries), n_docs, budget, batch_size)
    plan = SearchPlan(doc_chunk=dc, memory_budget=budget, to_host=True, query_bits=query_bits)

    def launch(a: int, b: int, into: Sequence[torch.Tensor]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        part = queries if (a, b) == (0, len(queries)) else queries[a:b]
        return complete_later(search_batch(part, plan), into)

    return run_batches(len(queries), k, bq, device, launch, progress=progress, engine=engine)


def run_batches(
    n_queries: int,
    k: int,
    batch_size: int,
    device: torch.device,
    launch: Callable[[int, int, Sequence[torch.Tensor]], Callable[[], tuple[torch.Tensor, torch.Tensor]]],
    *,
    progress: bool = False,
    engine: str = "",
) -> SearchResults:
    """A search's batches of ``batch_size`` queries, pipelined: ``launch(a, b, into)`` starts
    queries ``a:b`` and returns the function that waits for their host ``(scores, ids)``
    (written into ``into``, page-locked slices of the output, when given). Batch i is launched
    before batch i - 1 is waited for, so the host's part of a batch (query layout, parameters,
    launches) overlaps the device's work on the one before. One batch's results are returned
    as they come. ``engine``: the name the results carry (:attr:`SearchResults.engine`)."""
    if n_queries == 0:
        empty = torch.zeros((0, k), dtype=torch.float32), torch.zeros((0, k), dtype=torch.int64)
        return SearchResults(*empty, engine=engine)
    # no bar object unless asked for: even disabled, one costs ~10 µs, a tenth of a small search's host time
    bar = tqdm(total=n_queries, unit="q", desc="searching", disable=None, leave=False) if progress else None
    if n_queries <= batch_size:
        out = SearchResults(*launch(0, n_queries, ())(), engine=engine)
        if bar is not None:
            bar.update(n_queries)
            bar.close()
        return out
    out_scores, out_ids, direct = output_buffers(n_queries, k, device)
    in_flight: collections.deque = collections.deque()
    for a in range(0, n_queries, batch_size):
        b = min(n_queries, a + batch_size)
        in_flight.append((a, b, launch(a, b, (out_scores[a:b], out_ids[a:b]) if direct else ())))
        while len(in_flight) == 2 or (b == n_queries and in_flight):
            a0, b0, finish = in_flight.popleft()
            s0, i0 = finish()
            if not direct:
                out_scores[a0:b0], out_ids[a0:b0] = s0, i0
            if bar is not None:
                bar.update(b0 - a0)
    if bar is not None:
        bar.close()
    return SearchResults(out_scores, out_ids, engine=engine)


def complete_later(
    result: BatchResult, into: Sequence[torch.Tensor] = ()
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A :class:`BatchResult` on the host, in two steps: the copies start now, and the returned
    function waits for them (one sync), then searches flagged rows again. In between the host
    can prepare and launch the next batch while the device still works on this one. ``into``:
    the page-locked host ``(scores, ids)`` to fill (see :func:`output_buffers`). Results the
    engine delivers to the host itself (:attr:`BatchResult.host`) are taken as they are."""
    host = result.host
    if host is None:
        copies, done = start_to_host(result.scores, result.ids, result.redo, into=into)

    def taken() -> tuple:
        if host is not None:
            return host.take(into)
        if done is not None:
            done.synchronize()
        return copies

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        scores, ids, redo = taken()
        if redo is not None and bool(redo.numpy().any()):  # numpy: a few µs less than torch here
            rows = redo.nonzero().flatten().numpy()
            if result.redo_search is None:
                raise RuntimeError("rows were flagged for another search, but no search was given")
            s2, i2 = results_to_host(*result.redo_search(rows))
            at = torch.from_numpy(rows)
            scores[at], ids[at] = s2, i2  # type: ignore[index]
        return scores, ids  # type: ignore[return-value]

    return finish
