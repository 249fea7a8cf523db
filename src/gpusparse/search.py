"""Exact batched search: the one place that chooses a kernel, and the reference path.

Contract of every search path (kernels included):

* ``score(q, d) = Σ_t w_q[t] · w_d[t]``, computed in float64 and rounded once to float32,
  so that every path returns the same scores bit for bit;
* results are ranked by that float32 score, descending, ties broken by the lower
  internal document number;
* only documents sharing a term with the query (score > 0) are results; empty slots
  hold id ``-1`` and score ``0``;
* temporaries stay under a memory budget: queries and documents are processed in
  chunks, and the result does not depend on the chunking.
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

from .collection import SparseCollection
from .errors import InputError
from .topk import certified_candidates, merge_topk, topk_by_key

if TYPE_CHECKING:
    from .index import Index
    from .quantize import Quantization
    from .vocab import Vocabulary

DEFAULT_MEMORY_BUDGET = 1 << 30
KERNELS = ("reference", "scatter", "docpar", "tiled")
TRITON_KERNELS = ("scatter", "docpar")
# Bytes of temporaries per (query, document) cell of one chunk: float64 accumulator,
# its float32 rounding and the int64 ranking key.
_CELL_BYTES = 8 + 4 + 8
# Bytes of temporaries per expanded posting (pair, position, document, target, value).
_POSTING_BYTES = 48


class SearchResults(NamedTuple):
    """Top-k results: ``scores`` float32 and ``ids`` int64, both ``[n_queries, k]``."""

    scores: torch.Tensor
    ids: torch.Tensor


def available_kernels() -> tuple[str, ...]:
    """Kernel names accepted by ``kernel=`` (besides ``"auto"``)."""
    return KERNELS


def choose_kernel(kernel: str, device: torch.device) -> str:
    """Resolve ``kernel="auto"`` for ``device``; validate an explicit choice.

    ``auto`` takes the tiled engine on a CUDA device with CuPy (its kernel is compiled at run
    time), else the fused scatter-add kernel on a CUDA device with Triton, else the PyTorch
    reference path (Triton's CPU interpreter and the tiled engine's PyTorch emulation are
    for tests, not speed). Measured in ``bench/results/``.
    """
    from .kernels import triton_available

    if kernel == "auto":
        from .kernels import tiled

        if device.type == "cuda" and tiled.available():
            return "tiled"
        return "scatter" if device.type == "cuda" and triton_available() else "reference"
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of: auto, {', '.join(KERNELS)}")
    if kernel in TRITON_KERNELS and not triton_available():
        raise ValueError(
            f"kernel {kernel!r} needs Triton and a CUDA device (or TRITON_INTERPRET=1 for Triton's CPU interpreter)"
        )
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if kernel in TRITON_KERNELS and device.type != "cuda" and not (device.type == "cpu" and interpreted):
        raise ValueError(
            f"kernel {kernel!r} runs on CUDA devices (or on the CPU under TRITON_INTERPRET=1), not on {device}"
        )
    return kernel


def as_queries(queries: object, vocab: Vocabulary) -> SparseCollection:
    """Turn what :meth:`Index.search` accepts into a collection checked against ``vocab``."""
    if isinstance(queries, SparseCollection):
        q = queries
    elif sp.issparse(queries):
        q = SparseCollection.from_scipy(queries)
    elif isinstance(queries, Sequence) and all(isinstance(v, Mapping) for v in queries):
        q = SparseCollection.from_dicts(queries, vocab=vocab)
    else:
        raise TypeError("queries must be a SparseCollection, a scipy sparse matrix or a list of {token: weight} dicts")
    check_vocab(q.vocab, vocab)
    return q


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


def prepare_queries(queries: object, vocab: Vocabulary, quantization: Quantization | None) -> SparseCollection:
    """:func:`as_queries`, then quantized like the index's documents when they are."""
    q = as_queries(queries, vocab)
    if quantization is not None:
        from .quantize import quantize_queries

        q = quantize_queries(q, quantization.bits)
    return q


def check_vocab(query_vocab: Vocabulary, index_vocab: Vocabulary) -> None:
    """Refuse queries whose term ids would mean other tokens than the index's.

    An integer (anonymous) query vocabulary is compatible with any index vocabulary at
    least as large; two token vocabularies must be identical.
    """
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


# Results come back from a GPU through page-locked host memory (one sync for both tensors)
# instead of two pageable copies: -0.8 ms at 8.8M x 256, k = 1000
# (bench/results/2026-11-26-H200-anatomy-v14.json; bench/anatomy.py times both).
PINNED_RESULTS = True


def results_to_host(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Device tensors (a batch's scores, ids, and any flags) on the host, after one sync
    (from a GPU through page-locked memory); ``None`` stays ``None``."""
    out, done = start_to_host(*tensors)
    if done is not None:
        done.synchronize()
    return out


def start_to_host(
    *tensors: torch.Tensor | None, into: Sequence[torch.Tensor | None] = ()
) -> tuple[tuple[torch.Tensor | None, ...], torch.cuda.Event | None]:
    """:func:`results_to_host` without the wait: host tensors that hold the values once the
    returned CUDA event has completed (``None``: already done, off a GPU). ``into``: page-locked
    host tensors to copy the first tensors into (as :func:`output_buffers` gives)."""
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type != "cuda" or not PINNED_RESULTS:
        host = [None if t is None else t.cpu() for t in tensors]
        for i, target in enumerate(into):
            if target is not None and host[i] is not None:
                host[i] = target.copy_(host[i])
        return tuple(host), None
    targets = list(into) + [None] * (len(tensors) - len(into))
    dev = present[0].device
    # On a side stream (a copy engine), after the work queued so far: the copies overlap the
    # next batch's kernels instead of holding up the compute stream.
    side = _copy_stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        out = tuple(
            None
            if t is None
            else (target if target is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)).copy_(
                t, non_blocking=True
            )
            for t, target in zip(tensors, targets, strict=True)
        )
    for t in present:
        t.record_stream(side)  # not reused by the compute stream before the copy has read it
    done = torch.cuda.Event()
    done.record(side)
    return out, done


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


# The results of a search of several batches go straight from the GPU into one page-locked
# output (no host copy per batch) when it takes at most this many bytes.
PINNED_OUTPUT_MAX = 1 << 28


def output_buffers(n_queries: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Host ``(scores, ids)`` ``[n_queries, k]`` for a search's results (every row is written),
    page-locked when the search runs on a GPU and they are small enough (then the third
    value is ``True``: batches may copy into them directly)."""
    pinned = device.type == "cuda" and PINNED_RESULTS and n_queries * k * 12 <= PINNED_OUTPUT_MAX
    scores = torch.empty((n_queries, k), dtype=torch.float32, pin_memory=pinned)
    return scores, torch.empty((n_queries, k), dtype=torch.int64, pin_memory=pinned), pinned


class BatchResult(NamedTuple):
    """One batch's top-k on the device before any host sync (:func:`search_batch` with
    ``deferred``): ``scores``/``ids`` ``[B, k]``; rows flagged in ``redo`` (bool ``[B]`` on the
    device; ``None``: no row) hold no valid results, and ``redo_search(rows)`` (host row
    numbers) returns theirs, ``(scores, ids)`` on the device."""

    scores: torch.Tensor
    ids: torch.Tensor
    redo: torch.Tensor | None = None
    redo_search: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]] | None = None


def complete_later(
    result: BatchResult, into: Sequence[torch.Tensor] = ()
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A :class:`BatchResult` on the host, in two steps: the copies start now, and the returned
    function waits for them (one sync), then searches flagged rows again. In between the host
    can prepare and launch the next batch while the device still works on this one. ``into``:
    the page-locked host ``(scores, ids)`` to fill (see :func:`output_buffers`)."""
    (scores, ids, redo), done = start_to_host(result.scores, result.ids, result.redo, into=into)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        if done is not None:
            done.synchronize()
        if redo is not None and bool(redo.any()):
            rows = redo.nonzero().flatten().numpy()
            assert result.redo_search is not None
            s2, i2 = results_to_host(*result.redo_search(rows))
            at = torch.from_numpy(rows)
            scores[at], ids[at] = s2, i2  # type: ignore[index]
        return scores, ids  # type: ignore[return-value]

    return finish


def search(
    index: Index,
    queries: object,
    k: int = 1000,
    *,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    kernel: str = "auto",
    memory_budget: int | None = None,
    progress: bool = False,
) -> SearchResults:
    """Exact top-``k`` search; see :meth:`gpusparse.Index.search`."""
    budget = check_search_args(k, batch_size, memory_budget)
    dev = index.device if device is None else torch.device(device)
    q = prepare_queries(queries, index.vocab, index.quantization)
    name = choose_kernel(kernel, dev)
    idx = index.to(dev)
    bq, dc = plan_chunks(len(q), idx.n_docs, budget, batch_size)

    def launch(a: int, b: int, into: Sequence[torch.Tensor]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        part = q if (a, b) == (0, len(q)) else q[a:b]
        r = search_batch(idx, part, k, kernel=name, doc_chunk=dc, memory_budget=budget, deferred=True)
        return complete_later(r, into)  # type: ignore[arg-type]

    return run_batches(len(q), k, bq, dev, launch, progress=progress)


def run_batches(
    n_queries: int,
    k: int,
    batch_size: int,
    device: torch.device,
    launch: Callable[[int, int, Sequence[torch.Tensor]], Callable[[], tuple[torch.Tensor, torch.Tensor]]],
    *,
    progress: bool = False,
) -> SearchResults:
    """A search's batches of ``batch_size`` queries, pipelined: ``launch(a, b, into)`` starts
    queries ``a:b`` and returns the function that waits for their host ``(scores, ids)``
    (written into ``into``, page-locked slices of the output, when given). Batch i is launched
    before batch i - 1 is waited for, so the host's part of a batch (query layout, parameters,
    launches) overlaps the device's work on the one before. One batch's results are returned
    as they come."""
    if n_queries == 0:
        return SearchResults(torch.zeros((0, k), dtype=torch.float32), torch.zeros((0, k), dtype=torch.int64))
    bar = tqdm(total=n_queries, unit="q", desc="searching", disable=not progress or None, leave=False)
    if n_queries <= batch_size:
        out = SearchResults(*launch(0, n_queries, ())())
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
            bar.update(b0 - a0)
    bar.close()
    return SearchResults(out_scores, out_ids)


def search_batch(
    index: Index,
    queries: SparseCollection,
    k: int,
    *,
    kernel: str,
    doc_chunk: int,
    memory_budget: int,
    deferred: bool = False,
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | BatchResult:
    """Exact top-``k`` of one query batch with a resolved ``kernel`` (:func:`choose_kernel`):
    ``(scores, ids)`` ``[batch, k]`` left on the index's device, padded as :func:`search`'s.

    ``doc_chunk`` documents are scored at a time (see :func:`plan_chunks`). Callers that
    merge results on the device (shards, streamed pieces) use this instead of :func:`search`.
    ``deferred``: a :class:`BatchResult` instead, before the host sync that the tiled
    engine's GPU path otherwise makes to learn which rows to search again. ``cutoff``: the
    tiled engine's, for results to be merged with other searches' (see
    :func:`gpusparse.tiled.tiled_search`); other kernels ignore it.
    """
    if kernel == "tiled":
        from .tiled import tiled_search

        return tiled_search(index, query_batch(queries, index.device), k, deferred=deferred, cutoff=cutoff)
    if kernel == "reference":
        out = reference_search(index, queries, k, doc_chunk=doc_chunk, max_postings=memory_budget // _POSTING_BYTES)
    else:
        out = kernel_search(index, queries, k, kernel=kernel, doc_chunk=doc_chunk)
    return BatchResult(*out) if deferred else out


def plan_chunks(n_queries: int, n_docs: int, budget: int, batch_size: int | None) -> tuple[int, int]:
    """Queries per batch and documents per chunk so one chunk's cells fit ``budget``."""
    bq = max(1, min(n_queries, batch_size or 256))
    n_docs = max(1, n_docs)
    dc = budget // (bq * _CELL_BYTES)
    floor = min(n_docs, 4096)
    if dc < floor and batch_size is None:
        bq = max(1, budget // (floor * _CELL_BYTES))
        dc = budget // (bq * _CELL_BYTES)
    if dc < 1:
        raise ValueError(f"memory_budget {budget} is too small for a batch of {bq} queries")
    return bq, int(min(n_docs, dc))


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
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    valid = terms >= 0  # padding sits at the end of each row: row-major order is CSR order
    return _batch_from_csr(indptr, terms[valid], weights[valid], device)


def _batch_from_csr(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, device: torch.device) -> QueryBatch:
    lengths = np.diff(indptr).astype(np.int64)
    b, nnz = len(lengths), int(indices.size)
    width = int(lengths.max()) if b else 0
    real = np.arange(width) < lengths[:, None]  # row-major order of the real slots is CSR order
    rows = np.repeat(np.arange(b, dtype=np.int64), lengths)
    ints = np.empty(2 * nnz + b * width + b, dtype=np.int64)  # rows | terms | padded terms | lengths
    ints[:nnz] = rows
    ints[nnz : 2 * nnz] = indices
    padded = ints[2 * nnz : 2 * nnz + b * width].reshape(b, width)
    padded.fill(-1)
    padded[real] = indices
    ints[2 * nnz + b * width :] = lengths
    floats = np.zeros(nnz + b * width, dtype=np.float32)  # weights | padded weights
    floats[:nnz] = values
    floats[nnz:].reshape(b, width)[real] = values
    ints_d, floats_d = to_device([ints, floats], device)
    return QueryBatch(
        ints_d[:nnz],
        ints_d[nnz : 2 * nnz],
        floats_d[:nnz],
        ints_d[2 * nnz : 2 * nnz + b * width].view(b, width),
        floats_d[nnz:].view(b, width),
        ints_d[2 * nnz + b * width :],
        (padded, floats[nnz:].reshape(b, width), lengths),
    )


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """numpy ``arrays`` as tensors on ``device`` (same dtypes and shapes) in one copy: to a GPU
    through one page-locked buffer, without waiting for the copy (the allocator keeps the
    buffer until the copy is done). A copy costs more host time than a small batch's bytes."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    starts, total = [], 0
    for a in arrays:
        starts.append(total)
        total += -(-a.nbytes // 8) * 8  # every array 8-byte aligned, so each view is legal
    host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for a, start in zip(arrays, starts, strict=True):
        staging[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    moved = host.to(device, non_blocking=True)
    return [
        moved[start : start + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
        for a, start in zip(arrays, starts, strict=True)
    ]


def exact_scores(
    index: Index, batch: QueryBatch, rows: torch.Tensor, docs: torch.Tensor, *, max_cells: int = 1 << 22
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
    from .kernels import rescore

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
        pos = lower_bound(index.doc_ids, lo, hi, d).clamp_max(last)
        found = (pos < hi) & (index.doc_ids[pos].to(torch.int64) == d)
        prod = torch.where(found, index.scores[pos].to(torch.float64), 0.0) * qw[r]
        acc = torch.zeros(r.numel(), dtype=torch.float64, device=docs.device)
        for j in range(width):  # sequential: the canonical summation order
            acc += prod[:, j]
        out[a : a + step] = acc.to(torch.float32)
    return out


def select_exact_topk(
    index: Index, batch: QueryBatch, approx: torch.Tensor, k: int, base: int
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
    index: Index,
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
    return finalize(best, k, bq, index.device)


def reference_search(
    index: Index, queries: SparseCollection | QueryBatch, k: int, *, doc_chunk: int, max_postings: int
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
            lo = lower_bound(index.doc_ids, starts, ends, d0)
            hi = lower_bound(index.doc_ids, lo, ends, d0 + width)
        acc = torch.zeros(bq * width, dtype=torch.float64, device=dev)
        for pair, pos in expand_ranges(lo, hi, max_postings):
            target = batch.rows[pair] * width + (index.doc_ids[pos].to(torch.int64) - d0)
            acc.index_add_(0, target, weights64[pair] * index.scores[pos].to(torch.float64))
        return acc.view(bq, width)

    return chunked_exact_topk(index, batch, k, doc_chunk, fill)


def kernel_search(
    index: Index, queries: SparseCollection, k: int, *, kernel: str, doc_chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Triton kernel fills float32 scores chunk by chunk; each chunk's exact top-k is merged.

    Returns ``(scores, ids)`` ``[batch, k]`` on the index's device.
    """
    from .kernels import docpar_scores, scatter_add_scores

    dev = index.device
    bq, n = len(queries), index.n_docs
    batch = query_batch(queries, dev)
    forward = forward_copy(index) if kernel == "docpar" else None
    buf = torch.empty(bq * min(doc_chunk, max(n, 1)), dtype=torch.float32, device=dev)

    def fill(d0: int, width: int) -> torch.Tensor:
        out = buf[: bq * width].view(bq, width)
        if kernel == "scatter":
            return scatter_add_scores(index, batch, d0, width, out)
        return docpar_scores(index, batch, d0, width, forward, out)

    return chunked_exact_topk(index, batch, k, doc_chunk, fill)


def forward_copy(index: Index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The index's document-major copy (:func:`~gpusparse.kernels.forward_index`), made once
    per index object: the doc-parallel kernel and the tiled engine's rescoring read it."""
    from .kernels import forward_index

    cached = index.cache.get("forward")
    if cached is None:
        cached = index.cache["forward"] = forward_index(index)
    return cached


def finalize(
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


def lower_bound(doc_ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, value: int | torch.Tensor) -> torch.Tensor:
    """For each list slice ``doc_ids[lo:hi]`` (ascending), the first position with id ≥ ``value``.

    ``value`` is one document number or a tensor of them, one per slice. A vectorised
    binary search: all slices advance together for ``ceil(log2(longest slice + 1))``
    steps, with one device synchronisation in all (to learn the longest slice).
    """
    lo, hi = lo.clone(), hi.clone()
    if lo.numel() == 0:
        return lo
    steps = int((hi - lo).max()).bit_length()
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        below = doc_ids[torch.where(active, mid, torch.zeros_like(mid))].to(torch.int64) < value
        lo = torch.where(active & below, mid + 1, lo)
        hi = torch.where(active & ~below, mid, hi)
    return lo


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
