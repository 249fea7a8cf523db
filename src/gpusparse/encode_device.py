"""SPLADE vectors on the device: pooling, pruning and each batch's non-zeros, without waiting.

:func:`sparse_batches` takes :class:`~gpusparse.encode_tokens.TokenBatch` es and a
``forward`` (token ids and attention mask on the device → ``[b, V]`` float32 vectors) and
yields each batch's non-zeros as :class:`SparseBatch` CSR arrays on the host. Everything
per batch runs on the device: the copy of the (pinned) token ids, the model, pooling,
``--prune-threshold``, the non-zero counts, the top-``k`` of ``--prune-top`` and the
extraction of the non-zeros, as one ``topk`` of the batch's largest count followed by a
sort of the kept term ids. Their results come back to pinned host memory asynchronously.

The host keeps the device's queue two batches deep: a batch's counts are read (to size
its extraction) only after the models of the next two batches are queued, and its
extracted arrays after the one after that (with ``prune_top`` the extraction has a known
size and is queued with the model, so its arrays are read at the first of those). So when
the host waits for a batch, the device still has a whole batch to run, which absorbs the
host's hiccups (the tokenising thread holding the GIL, a garbage collection). On the CPU
the same code runs synchronously. :func:`assemble` puts the batches' rows back in input
order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .encode_tokens import TokenBatch

Pooling = Literal["max", "sum"]
POOLINGS = ("max", "sum")
Forward = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
_AHEAD = 2  # batches queued on the device beyond those the host waits for


def splade_pool(
    logits: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling = "max", *, shortest: int = 0
) -> torch.Tensor:
    """``[B, L, V]`` masked-LM logits → ``[B, V]`` float32 SPLADE vectors.

    Max pooling: ``w[v] = max_t log(1 + relu(z[t, v])) · mask[t]``; sum pooling: the sum
    over ``t``. Overwrites ``logits``. Max pooling takes the maximum of the logits first
    and applies ``log(1 + relu(.))`` to it: the function is monotone and maps padding
    (set to 0) to 0, so this is the same number, at a fraction of the cost. ``shortest``:
    a number of leading positions known to be real tokens in every row (the batch's
    shortest text): only the positions after them are masked, the maximum being exact
    whatever the order it is taken in.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    padding = (attention_mask == 0).unsqueeze(-1)
    if pooling == "max":
        s, length = min(max(shortest, 0), logits.shape[1]), logits.shape[1]
        if s == length:
            top = logits.amax(dim=1)
        else:
            top = logits[:, s:].masked_fill_(padding[:, s:], 0).amax(dim=1)
            if s > 0:
                top = torch.maximum(logits[:, :s].amax(dim=1), top)
        return torch.log1p_(torch.relu_(top.float()))
    w = logits.float() if logits.dtype != torch.float32 else logits
    w = torch.log1p_(torch.relu_(w)).masked_fill_(padding, 0)
    return w.sum(dim=1)


def prune(vectors: torch.Tensor, *, top: int | None = None, threshold: float | None = None) -> torch.Tensor:
    """Keep the ``top`` largest weights of each row and/or those ``>= threshold`` (in place)."""
    if threshold is not None:
        vectors.masked_fill_(vectors < threshold, 0.0)
    if top is not None and top < vectors.shape[1]:
        kth = torch.topk(vectors, top, dim=1).indices
        keep = torch.zeros_like(vectors, dtype=torch.bool).scatter_(1, kth, True)
        vectors.masked_fill_(~keep, 0.0)
    return vectors


@dataclass
class SparseBatch:
    """One encoded batch on the host: row ``j`` is the vector of input text ``rows[j]``.

    Attributes:
        rows: int64 ``[b]``: positions of the batch's texts in the input.
        indptr: int64 ``[b + 1]``: row offsets into ``terms`` / ``weights``.
        terms: int32 ``[nnz]``: term ids, ascending inside each row.
        weights: float32 ``[nnz]``: weights, all > 0.
        nnz_before: int64 ``[b]``: non-zeros of each vector before pruning.
        truncated: texts of the batch that were truncated.
    """

    rows: np.ndarray
    indptr: np.ndarray
    terms: np.ndarray
    weights: np.ndarray
    nnz_before: np.ndarray
    truncated: int


class _InFlight:
    """One batch between the device and the host: :meth:`advance` takes it one step further.

    Steps: ``reps`` (the vectors, counts on their way to the host) → ``extracted`` (the
    ``[b, k]`` term ids and weights on their way) → ``result`` (a :class:`SparseBatch`).
    """

    def __init__(self, tb: TokenBatch, reps: torch.Tensor, prune_top: int | None, threshold: float | None) -> None:
        self.tb, self.device = tb, reps.device
        self.result: SparseBatch | None = None
        before = (reps > 0).sum(dim=1)
        if threshold is not None:
            reps.masked_fill_(reps < threshold, 0.0)
        if prune_top is not None and prune_top < reps.shape[1]:
            # A known size: extract now, with the model, without waiting for the counts.
            weights, terms = _extract(reps, prune_top)
            self.counts = _to_host(torch.stack([before, (weights > 0).sum(dim=1)]))
            self.reps: torch.Tensor | None = None
            self.extracted: tuple[torch.Tensor, torch.Tensor] | None = (_to_host(weights), _to_host(terms))
        else:
            self.counts = _to_host(torch.stack([before, (reps > 0).sum(dim=1)]))
            self.reps, self.extracted = reps, None
        self.event = _record(self.device)

    @torch.inference_mode()
    def advance(self, timer: dict[str, float] | None = None) -> bool:
        """Wait for the last step queued and queue the next; ``True`` once ``result`` is set.
        ``timer``: adds the seconds waited for the device (``"wait_device"``)."""
        t0 = time.perf_counter()
        _wait(self.event)
        if timer is not None:
            timer["wait_device"] = timer.get("wait_device", 0.0) + time.perf_counter() - t0
        if self.reps is not None:  # the counts are in: extract the batch's largest count
            k = int(self.counts[1].max())
            weights, terms = _extract(self.reps, k)
            self.reps = None
            self.extracted = (_to_host(weights), _to_host(terms))
            self.event = _record(self.device)
            return False
        if self.extracted is None:
            raise RuntimeError("advance() after the result")
        w, t = self.extracted[0].numpy(), self.extracted[1].numpy()
        keep = w > 0
        lengths = keep.sum(axis=1)
        indptr = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        self.result = SparseBatch(
            rows=self.tb.rows,
            indptr=indptr,
            terms=t[keep],
            weights=w[keep],
            nnz_before=self.counts[0].numpy().astype(np.int64),
            truncated=self.tb.truncated,
        )
        self.extracted = None
        return True


def _extract(reps: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest weights of each row and their int32 term ids, in term order
    (zeros among them, where a row has fewer than ``k`` non-zeros, are dropped on the host)."""
    weights, terms = torch.topk(reps, k, dim=1)
    terms, order = torch.sort(terms, dim=1)
    return torch.gather(weights, 1, order), terms.to(torch.int32)


def sparse_batches(
    batches: Iterable[TokenBatch],
    forward: Forward,
    device: torch.device,
    *,
    prune_top: int | None = None,
    prune_threshold: float | None = None,
    timer: dict[str, float] | None = None,
) -> Iterator[SparseBatch]:
    """Encode ``batches`` on ``device``; their non-zeros in the order of ``batches``.

    ``forward(input_ids, attention_mask, shortest)``: int64 ``[b, L]`` ids and mask on
    the device and the batch's shortest length → ``[b, V]`` float32 vectors. ``timer``
    (when given) adds this thread's seconds by stage: waiting for the next token batch
    (``"wait_tokens"``), queuing a batch's work on the device (``"launch"``), waiting for the
    device (``"wait_device"``) and the host's own work on the results (``"host"``).
    """
    timer = {} if timer is None else timer
    clock = time.perf_counter

    def add(stage: str, seconds: float) -> None:
        timer[stage] = timer.get(stage, 0.0) + seconds

    pending: deque[_InFlight] = deque()
    source = iter(batches)
    while True:
        t0 = clock()
        tb = next(source, None)
        t1 = clock()
        add("wait_tokens", t1 - t0)
        if tb is None:
            break
        pending.append(_launch(tb, forward, device, prune_top, prune_threshold))
        t2 = clock()
        add("launch", t2 - t1)
        waited = timer.get("wait_device", 0.0)
        for fl in list(pending)[:-_AHEAD]:  # older batches, one step each: the newer ones keep the device busy
            fl.advance(timer)
        add("host", clock() - t2 - (timer.get("wait_device", 0.0) - waited))
        while pending and pending[0].result is not None:
            yield _done(pending.popleft())
    while pending:
        t0, waited = clock(), timer.get("wait_device", 0.0)
        while not pending[0].advance(timer):
            pass
        add("host", clock() - t0 - (timer.get("wait_device", 0.0) - waited))
        yield _done(pending.popleft())


@torch.inference_mode()
def _launch(
    tb: TokenBatch, forward: Forward, device: torch.device, prune_top: int | None, prune_threshold: float | None
) -> _InFlight:
    ids = tb.input_ids.to(device, non_blocking=True).long()
    lengths = tb.lengths_t.to(device, non_blocking=True)
    mask = (torch.arange(ids.shape[1], device=device)[None, :] < lengths[:, None]).long()
    reps = forward(ids, mask, int(tb.lengths.min()))
    return _InFlight(tb, reps, prune_top, prune_threshold)


def _done(fl: _InFlight) -> SparseBatch:
    if fl.result is None:
        raise RuntimeError("the batch is not done")
    return fl.result


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to the host: asynchronously into pinned memory from a CUDA device."""
    if t.device.type != "cuda":
        return t.clone() if t.device.type == "cpu" else t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _record(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()


def assemble(
    batches: Sequence[SparseBatch], n: int, *, chunk_postings: int = 1 << 25
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR ``(indptr, terms, weights)`` of ``n`` rows in input order from ``batches``
    (rows no batch holds are empty), reordered ``chunk_postings`` postings at a time."""
    lengths_sorted = np.concatenate([np.diff(b.indptr) for b in batches]) if batches else np.zeros(0, np.int64)
    rows = np.concatenate([b.rows for b in batches]) if batches else np.zeros(0, np.int64)
    terms = np.concatenate([b.terms for b in batches]) if batches else np.zeros(0, np.int32)
    weights = np.concatenate([b.weights for b in batches]) if batches else np.zeros(0, np.float32)
    row_len = np.zeros(n, dtype=np.int64)
    row_len[rows] = lengths_sorted
    src_start = np.zeros(n, dtype=np.int64)
    src_start[rows] = np.cumsum(lengths_sorted) - lengths_sorted
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(row_len, out=indptr[1:])
    out_terms = np.empty(terms.size, dtype=np.int32)
    out_weights = np.empty(weights.size, dtype=np.float32)
    r0 = 0
    while r0 < n:  # rows [r0, r1) hold about chunk_postings postings (one row at least)
        r1 = max(r0 + 1, int(np.searchsorted(indptr, indptr[r0] + chunk_postings, side="right")) - 1)
        r1 = min(r1, n)
        a, b = int(indptr[r0]), int(indptr[r1])
        if b > a:
            lens = row_len[r0:r1]
            gather = np.repeat(src_start[r0:r1] - indptr[r0:r1], lens) + np.arange(a, b, dtype=np.int64)
            out_terms[a:b] = terms[gather]
            out_weights[a:b] = weights[gather]
        r0 = r1
    return indptr, out_terms, out_weights
