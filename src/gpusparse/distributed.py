"""Search beyond one device: shards over processes with a device-side merge, and streaming.

**Sharded search** (:func:`search_sharded`). The documents are cut into contiguous shards
(:mod:`gpusparse.shards`); each process of a ``torch.distributed`` group (one GPU each with
NCCL, or CPU processes with gloo) searches its shard for the whole query batch, giving
``[B, k]`` scores and global positions (shard offset + local number; ``0`` / ``-1`` padded
where a shard has fewer than ``k`` matches). The lists are all-gathered on the device and
merged there by score descending, then global position ascending
(:func:`merge_across_ranks`). Every kernel returns the canonical score of each
(query, document) pair whichever index holds the document, so the merged results equal
one process's search of the whole collection bit for bit, ties included. A search of
several batches is pipelined (batch i is launched and merged before batch i − 1 is waited
for), and each batch syncs once (rows a GPU flags for another search travel with the
merge). With the tiled engine the processes can first agree on a lower bound of the merged
k-th score (:func:`merged_floor`, :data:`TWO_ROUND`, off by default), so that each rescores
only candidates that can reach it.

**Streaming** (:class:`StreamedIndex`). An index (or shard) larger than the device's memory
stays in host memory (pinned, for a GPU) cut into document-range pieces. For each query
batch, piece ``i + 1`` is copied on a side CUDA stream while piece ``i`` is searched, and the
pieces' top-k are merged on the device the way shards' are. On a CPU the same loop runs
without streams. :func:`open_for_search` decides between resident and streamed from a
device-memory budget.

Every process must make the same calls in the same order (each reads the same queries);
an error on one process only would leave the others waiting in a collective, so setup
errors are shared first (:func:`first_error`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .collection import SparseCollection
from .errors import InputError
from .index import Index
from .search import (
    DEFAULT_MEMORY_BUDGET,
    BatchResult,
    SearchResults,
    check_search_args,
    choose_kernel,
    plan_chunks,
    prepare_queries,
    results_to_host,
    run_batches,
    search_batch,
    start_to_host,
)
from .shards import assign_shards, document_ranges, is_sharded, load_sharded, read_sharded_manifest, slice_documents
from .tiled import TiledIndex, search_layout
from .topk import merge_keys, merge_results, result_keys

# Share of the device's free memory an index may take when no budget is given.
FREE_MEMORY_SHARE = 0.9


class StreamedIndex:
    """An index kept in host memory in ``n_pieces`` document ranges, searched on ``device``
    piece by piece (see the module docstring). ``kernel`` is resolved once; for the tiled
    engine each piece's tiled layout is built once (on ``device``) and kept in host memory
    beside it, so a piece travels in both layouts (about 14 instead of 8 bytes a posting).

    Args:
        index: the documents, on any device (pieces are cut where it is, then moved to the host).
        n_pieces: document ranges (at most ``index.n_docs``); two are on the device at once.
        device: where to search.
        kernel: ``"auto"`` or a kernel name, as for :meth:`Index.search`.
    """

    def __init__(self, index: Index, n_pieces: int, device: str | torch.device, *, kernel: str = "auto") -> None:
        self.device = torch.device(device)
        self.kernel = choose_kernel(kernel, self.device)
        self.vocab = index.vocab
        self.quantization = index.quantization
        self.n_docs = index.n_docs
        self._ids = index._ids
        cuda = self.device.type == "cuda"
        self.pieces: list[tuple[int, Index]] = []
        for a, b in document_ranges(index.n_docs, n_pieces):
            piece = slice_documents(index, a, b)
            if cuda and self.kernel == "tiled":
                on_device = piece.to(self.device)
                search_layout(on_device, forward=False)  # the layout the search will ask for, to stream
                piece.cache.update(on_device.cache)
                del on_device
            self.pieces.append((a, _moved(piece, "cpu", pin=cuda)))
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None

    @property
    def ids(self) -> list[str]:
        """The documents' string ids, by document number."""
        if self._ids is None:
            self._ids = [str(i) for i in range(self.n_docs)]
        return self._ids

    @property
    def nbytes(self) -> int:
        """Host bytes of the pieces (both layouts)."""
        return sum(t.numel() * t.element_size() for _, p in self.pieces for t in _tensors(p))

    def search(
        self,
        queries: SparseCollection | object,
        k: int = 1000,
        *,
        batch_size: int | None = None,
        kernel: str = "auto",
        memory_budget: int | None = None,
        progress: bool = False,
    ) -> SearchResults:
        """Exact top-``k``, as :meth:`Index.search` (same results, bit for bit)."""
        return search_sharded(
            self,
            queries,
            k,
            distributed=False,
            batch_size=batch_size,
            kernel=kernel,
            memory_budget=memory_budget,
            progress=progress,
        )

    def search_batch(
        self, queries: SparseCollection, k: int, *, doc_chunk: int, memory_budget: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query batch over all pieces: ``(scores, ids)`` ``[B, k]`` on the device."""
        n_q = len(queries)
        best_s = torch.zeros((n_q, 0), dtype=torch.float32, device=self.device)
        best_i = torch.zeros((n_q, 0), dtype=torch.int64, device=self.device)
        arriving = self._fetch(0)
        for j, (base, _) in enumerate(self.pieces):
            piece = arriving
            if self._copy_stream is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_stream(self._copy_stream)  # piece j has arrived
                for t in _tensors(piece):  # its memory is reused only after this stream's work
                    t.record_stream(compute)
            # Piece j + 1 starts copying now, on the side stream, while piece j is searched.
            arriving = self._fetch(j + 1) if j + 1 < len(self.pieces) else None
            s, i = search_batch(piece, queries, k, kernel=self.kernel, doc_chunk=doc_chunk, memory_budget=memory_budget)
            i = torch.where(i >= 0, i + base, i)
            best_s, best_i = merge_results(torch.cat([best_s, s], 1), torch.cat([best_i, i], 1), k)
            del piece
        return best_s, best_i

    def _fetch(self, j: int) -> Index:
        piece = self.pieces[j][1]
        if self._copy_stream is None:
            return piece
        with torch.cuda.stream(self._copy_stream):
            return _moved(piece, self.device, non_blocking=True)

    def __repr__(self) -> str:
        return f"StreamedIndex(n_docs={self.n_docs}, pieces={len(self.pieces)}, device={self.device})"


def _tensors(index: Index) -> list[torch.Tensor]:
    out = list(index.arrays().values())
    for value in index.cache.values():
        if isinstance(value, TiledIndex):
            out += [getattr(value, f.name) for f in fields(value) if isinstance(getattr(value, f.name), torch.Tensor)]
    return out


def _moved(index: Index, device: str | torch.device, *, pin: bool = False, non_blocking: bool = False) -> Index:
    """A copy of ``index`` on ``device`` with its tiled layouts (``pin``: in pinned host memory)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if pin:  # straight into page-locked memory, without a pageable copy first
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return t.to(device, non_blocking=non_blocking)

    arrays = {k: move(v) for k, v in index.arrays().items()}
    out = Index(arrays, ids=None, vocab=index.vocab, n_docs=index.n_docs, quantization=index.quantization)
    for key, value in index.cache.items():
        if isinstance(value, TiledIndex):
            tensors = {f.name: getattr(value, f.name) for f in fields(value)}
            moved = {n: move(t) for n, t in tensors.items() if isinstance(t, torch.Tensor)}
            # Without the forward copy (8 more bytes a posting to stream): rescoring then
            # searches the inverted lists, with the same results.
            out.cache[key] = replace(value, **moved, forward=None)
    return out


def index_bytes(index: Index, kernel: str) -> int:
    """Device bytes ``index`` needs for ``kernel`` (the tiled engine: its layout and forward copy too)."""
    n = sum(t.numel() * t.element_size() for t in index.arrays().values())
    return 3 * n if kernel == "tiled" else n  # + the tiled layout (~6 bytes a posting) and the forward copy (8)


def open_for_search(
    index: Index,
    device: str | torch.device,
    *,
    kernel: str = "auto",
    index_memory: int | None = None,
    pieces: int | None = None,
    memory_budget: int | None = None,
) -> Index | StreamedIndex:
    """``index`` on ``device``, or streamed from host memory when it does not fit.

    ``pieces`` forces streaming in that many pieces. Otherwise the index is streamed when
    it needs more than ``index_memory`` bytes (default for an index not yet on the GPU: 90%
    of the GPU's free memory less ``memory_budget``; no limit on a CPU), in pieces small
    enough for two to fit.
    """
    dev = torch.device(device)
    name = choose_kernel(kernel, dev)
    if pieces is not None and pieces < 1:
        raise ValueError("pieces must be at least 1")
    if pieces is None and (index_memory is not None or index.device != dev):
        budget = index_memory
        if budget is None and dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            budget = int(free * FREE_MEMORY_SHARE) - (memory_budget or DEFAULT_MEMORY_BUDGET)
        need = index_bytes(index, name)
        if budget is not None and need > budget:
            pieces = min(index.n_docs, -(-2 * need // max(budget, 1)))
    if pieces is None:
        return index.to(dev)
    return StreamedIndex(index, pieces, dev, kernel=name)


def search_sharded(
    shard: Index | StreamedIndex,
    queries: SparseCollection | object,
    k: int = 1000,
    *,
    offset: int = 0,
    n_docs: int | None = None,
    distributed: bool = True,
    group: dist.ProcessGroup | None = None,
    batch_size: int | None = None,
    kernel: str = "auto",
    memory_budget: int | None = None,
    progress: bool = False,
) -> SearchResults:
    """Exact top-``k`` over all processes' shards; every process of ``group`` calls it.

    Args:
        shard: this process's documents (global numbers ``offset ..``), on its device.
        queries: the same queries on every process.
        n_docs: documents in all shards (sets the batch size; default: this shard's).
        distributed: merge over ``group``'s processes (``False``: this shard alone).
        batch_size, kernel, memory_budget, progress: as for :meth:`Index.search`; a
            :class:`StreamedIndex` searches with the kernel it was prepared for.

    Returns:
        On every process, :class:`~gpusparse.search.SearchResults` ``[n_queries, k]`` CPU
        tensors whose ids are global document numbers, equal to one index's search of all
        the documents.
    """
    budget = check_search_args(k, batch_size, memory_budget)
    dev = shard.device
    streamed = isinstance(shard, StreamedIndex)
    if streamed:
        if kernel not in ("auto", shard.kernel):
            raise ValueError(f"this StreamedIndex was prepared for kernel {shard.kernel!r}, not {kernel!r}")
        name = shard.kernel
    else:
        name = choose_kernel(kernel, dev)
    world = dist.get_world_size(group) if distributed else 1
    if world > 1 and dist.get_backend(group) == "nccl" and dev.type != "cuda":
        raise ValueError("an NCCL process group merges CUDA tensors: put the shard on this process's GPU")
    q = prepare_queries(queries, shard.vocab, shard.quantization)
    n_q = len(q)
    bq, dc = plan_chunks(n_q, shard.n_docs if n_docs is None else n_docs, budget, batch_size)
    cutoff = None
    if TWO_ROUND and world > 1 and _all_agree(not streamed and name == "tiled", dev, group):
        cutoff = functools.partial(merged_floor, k=k, group=group)

    # Every process makes the same collectives in the same order (redone rows merge when their
    # batch is waited for). Two CUDA streams taking turns between batches were slower
    # (bench/results/2026-11-26-H200x2-multigpu-v18.json).
    def launch(a: int, b: int, into: Sequence[torch.Tensor]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        part = q if (a, b) == (0, n_q) else q[a:b]
        if streamed:
            r = BatchResult(*shard.search_batch(part, k, doc_chunk=dc, memory_budget=budget))  # type: ignore[union-attr]
        else:
            r = search_batch(shard, part, k, kernel=name, doc_chunk=dc, memory_budget=budget,  # type: ignore[arg-type,assignment]
                             deferred=True, cutoff=cutoff)  # fmt: skip
        return _merge_later(r, offset, k, world > 1, group, into)

    return run_batches(n_q, k, bq, dev, launch, progress=progress)


def _merge_later(
    r: BatchResult,
    offset: int,
    k: int,
    merge: bool,
    group: dist.ProcessGroup | None,
    into: Sequence[torch.Tensor] = (),
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """One batch's shard results, merged over ``group``'s processes if ``merge`` (launched
    now); the returned function waits for them on the host. Rows that a process flagged
    (:class:`~gpusparse.search.BatchResult`) are then merged again: that process searches
    them again, the others send their rows as they were. ``into``: page-locked host
    ``(scores, ids)`` to fill (:func:`~gpusparse.search.output_buffers`)."""
    scores, ids = r.scores, torch.where(r.ids >= 0, r.ids + offset, r.ids)
    mine = r.redo if r.redo is not None else torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    flags = mine
    if merge:
        scores, ids, flags = merge_across_ranks(scores, ids, k, group, flags=mine)  # type: ignore[misc]
    (host_s, host_i, redo, own), done = start_to_host(scores, ids, flags, mine if merge else None, into=into)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        if done is not None:
            done.synchronize()
        if not bool(redo.any()):  # the same on every process: the flags were merged too
            return host_s, host_i
        rows = redo.nonzero().flatten().numpy()
        at_dev = torch.from_numpy(rows).to(r.scores.device)
        s2, i2 = r.scores[at_dev], r.ids[at_dev]
        again = np.flatnonzero((own if own is not None else redo).numpy()[rows])  # this process's flagged rows
        if again.size:
            assert r.redo_search is not None
            s3, i3 = r.redo_search(rows[again])
            at = torch.from_numpy(again).to(s2.device)
            s2[at], i2[at] = s3, i3
        i2 = torch.where(i2 >= 0, i2 + offset, i2)
        if merge:
            s2, i2 = merge_across_ranks(s2, i2, k, group)  # type: ignore[misc]
        at = torch.from_numpy(rows)
        host_s[at], host_i[at] = results_to_host(s2, i2)
        return host_s, host_i

    return finish


# Whether shards' searches exchange their candidates' lower bounds before rescoring
# (merged_floor), so that each rescores only candidates that may reach the merged top-k, not
# its own top-k. Off: since rescoring reads the forward copy it costs less than the exchange
# and the agreement (one all-reduce and a host sync per call) that it needs
# (bench/results/2026-11-26-H200x2-multigpu-v25.json; bench/NOTES.md).
TWO_ROUND = False


def merged_floor(lows: torch.Tensor, *, k: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """float32 ``[B]``: a score that the merged k-th result reaches, from every process's
    candidate lower bounds ``lows`` ``[B, W]`` (:func:`gpusparse.tiled.candidate_lows`, 0 for
    an empty slot): the smallest over the processes of each one's ``⌈k / world⌉``-th largest
    (together they hold k candidates whose scores reach it). Collective: one all-reduce of
    ``[B]`` (the exact k-th of all bounds would need them all gathered, and costs more than
    the few extra candidates this admits save)."""
    b, w = lows.shape
    j = -(-k // dist.get_world_size(group))
    if j <= w:
        floor = torch.topk(lows, j, dim=1, sorted=False).values.min(1).values.contiguous()
    else:  # fewer slots than candidates needed: no bound from this process
        floor = torch.zeros(b, dtype=lows.dtype, device=lows.device)
    dist.all_reduce(floor, op=dist.ReduceOp.MIN, group=group)
    return floor


def _all_agree(mine: bool, device: torch.device, group: dist.ProcessGroup | None) -> bool:
    """Whether ``mine`` holds on every process of ``group`` (one all-reduce, made by every
    process on every call: a process whose shard is streamed, or searched by another kernel,
    must not be left out of the lower-bound exchange the others would start)."""
    flag = torch.tensor([int(mine)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def merge_across_ranks(
    scores: torch.Tensor,
    ids: torch.Tensor,
    k: int,
    group: dist.ProcessGroup | None = None,
    *,
    flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather every process's ``[B, k]`` (scores, global ids) and merge them on the device:
    the top-``k`` of all, by score descending, then id ascending (every process gets it).
    Each result travels as one int64 ranking key, so one collective carries both; ``flags``
    (bool ``[B]``) travel in the same collective as one more column, and come back as a
    third output: each row's flag on any process. Each process's rows must be ranked (as
    search results are): with NCCL one kernel packs them and one merges the gathered lists
    (:mod:`gpusparse.kernels.rowsort`); elsewhere the same steps in PyTorch."""
    world = dist.get_world_size(group)
    if scores.is_cuda and dist.get_backend(group) == "nccl":
        from .kernels import rowsort

        if rowsort.available():  # one kernel each side of one all-gather into one tensor
            sent = rowsort.pack_results_cuda(scores.contiguous(), ids.contiguous(), flags)
            gathered = torch.empty((world * sent.shape[0], sent.shape[1]), dtype=torch.int64, device=sent.device)
            dist.all_gather_into_tensor(gathered, sent, group=group)
            out_s, out_i, out_f = rowsort.merge_gathered_cuda(gathered, world, k, flags=flags is not None)
            return (out_s, out_i) if out_f is None else (out_s, out_i, out_f)
    keys = result_keys(scores, ids)
    if flags is not None:
        keys = torch.cat([keys, flags.to(torch.int64)[:, None]], 1)
    keys = keys.contiguous()
    parts = [torch.empty_like(keys) for _ in range(world)]
    dist.all_gather(parts, keys, group=group)
    if flags is None:
        return merge_keys(torch.cat(parts, 1), k)
    merged = merge_keys(torch.cat([p[:, :-1] for p in parts], 1), k)
    return (*merged, torch.stack([p[:, -1] for p in parts]).any(0))


# -- processes ------------------------------------------------------------------------------


def init_from_env(device: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` describes in the environment.

    One GPU per process (``cuda:LOCAL_RANK``) with NCCL when CUDA is available and
    ``device`` is not ``"cpu"``; else the CPU with gloo. Returns ``(rank, world size, device)``.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise InputError(
            f"distributed search runs under torchrun ({', '.join(missing)} not set): "
            "torchrun --nproc-per-node=N $(which gpusparse) search ... --distributed"
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not (device or "").startswith("cpu")
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("CUDA is not available on this machine", field="--device")
    if cuda:
        if local >= torch.cuda.device_count():
            raise InputError(f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} GPU(s)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    return dist.get_rank(), dist.get_world_size(), dev


def first_error(error: str | None, group: dist.ProcessGroup | None = None) -> tuple[int, str] | None:
    """Share each process's setup error (``None`` if it has none): ``(rank, message)`` of the
    first process that failed, the same on every process, or ``None`` if none did."""
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    for rank, message in enumerate(errors):
        if message:
            return rank, message
    return None


def load_shard(path: str | Path, rank: int = 0, world_size: int = 1, *, verify: bool = True) -> tuple[Index, int, int]:
    """The documents process ``rank`` of ``world_size`` searches in a sharded or plain index
    folder (a plain one is a single shard), loaded on the CPU (memory-mapped): ``(index,
    global number of its first document, documents in the whole folder)``."""
    if is_sharded(path):
        m = read_sharded_manifest(path)
        index, offset = load_sharded(path, assign_shards(len(m["shards"]), world_size, rank), verify=verify)
        return index, offset, m["n_docs"]
    assign_shards(1, world_size, rank)
    index = Index.load(path, verify=verify)
    return index, 0, index.n_docs
