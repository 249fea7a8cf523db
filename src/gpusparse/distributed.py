"""Search beyond one process: shards over processes with a device-side merge.

**Sharded search** (:func:`search_sharded`). The documents are cut into contiguous shards
(:mod:`gpusparse.shards`); each process of a ``torch.distributed`` group (one GPU each with
NCCL, or CPU processes with gloo) searches its shard for the whole query batch, giving
``[B, k]`` scores and global positions (shard offset + local number; ``0`` / ``-1`` padded
where a shard has fewer than ``k`` matches). The lists are all-gathered on the device and
merged there by score descending, then global position ascending
(:func:`merge_across_ranks`). Every engine returns the canonical score of each
(query, document) pair whichever index holds the document, so the merged results equal
one process's search of the whole collection bit for bit, ties included. A search of
several batches is pipelined (batch i is launched and merged before batch i − 1 is waited
for), and each batch syncs once (rows a GPU flags for another search travel with the
merge). With the tiled engine the processes can first agree on a lower bound of the merged
k-th score (:func:`merged_floor`, :attr:`~gpusparse.config.EngineConfig.shard_lower_bounds`,
off by default), so that each rescores only candidates that can reach it. A shard too large
for its device is streamed (:mod:`gpusparse.streaming`).

Every process must make the same calls in the same order (each reads the same queries);
an error on one process only would leave the others waiting in a collective, so setup
errors are shared first (:func:`first_error`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import engines
from .collection import SparseCollection
from .config import engine_config
from .engines.base import BatchResult, SearchPlan, plan_chunks
from .errors import InputError
from .index import Index
from .kernels import rowsort
from .layout.postings import PostingLists
from .layout.statistics import max_scores_host
from .queries import prepare_queries
from .search import SearchResults, check_search_args, padded, result_width, run_batches, search_width
from .shards import assign_shards, is_sharded, load_sharded, read_sharded_manifest
from .streaming import StreamedIndex
from .topk import merge_keys, result_keys
from .transfer import results_to_host, start_to_host


def search_sharded(
    shard: PostingLists | StreamedIndex,
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
        n_docs: documents in all shards (sets the batch size, default this shard's; and the
            result width, :func:`~gpusparse.search.result_width`, default all shards').
        distributed: merge over ``group``'s processes (``False``: this shard alone).
        batch_size, kernel, memory_budget, progress: as for :meth:`Index.search`; a
            :class:`StreamedIndex` searches with the kernel it was prepared for.

    Returns:
        On every process, :class:`~gpusparse.search.SearchResults` ``[n_queries, width]`` CPU
        tensors whose ids are global document numbers, equal to one index's search of all
        the documents (``width``: as :meth:`Index.search`'s for all shards' documents).

    Raises:
        InputError: on every process, a query whose scores could overflow float32
            (checked against the largest weights of all shards).
    """
    budget = check_search_args(k, batch_size, memory_budget)
    dev = shard.device
    streamed = isinstance(shard, StreamedIndex)
    if streamed:
        shard.check_kernel(kernel)  # type: ignore[union-attr]
        name = shard.kernel
    else:
        engine = engines.choose(kernel, dev)
        name = engine.name
    world = dist.get_world_size(group) if distributed else 1
    if world > 1 and dist.get_backend(group) == "nccl" and dev.type != "cuda":
        raise ValueError("an NCCL process group merges CUDA tensors: put the shard on this process's GPU")
    # Every process checks the queries against the largest weights of all shards, and searches
    # with the same k: all refuse, or none does (one refusing would leave the others waiting).
    local_max = shard.term_max_scores if streamed else max_scores_host(shard)  # type: ignore[union-attr]
    total = shard.n_docs if n_docs is None else n_docs
    if world > 1:
        maxima = torch.from_numpy(np.asarray(local_max, dtype=np.float64)).to(dev)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        local_max = maxima.cpu().numpy()
        if n_docs is None:  # the documents of all shards
            count = torch.tensor([total], dtype=torch.int64, device=dev)
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
            total = int(count.item())
    q = prepare_queries(queries, shard.vocab, shard.quantization, local_max)
    n_q = len(q)
    kk, k_asked = search_width(k, total), k
    k = kk
    bq, dc = plan_chunks(n_q, shard.n_docs if n_docs is None else n_docs, budget, batch_size)
    cutoff = None
    if engine_config().shard_lower_bounds and world > 1 and _all_agree(not streamed and name == "tiled", dev, group):
        cutoff = functools.partial(merged_floor, k=k, group=group)
    plan = SearchPlan(doc_chunk=dc, memory_budget=budget, cutoff=cutoff)

    # Every process makes the same collectives in the same order (redone rows merge when their
    # batch is waited for). Two CUDA streams taking turns between batches were slower
    # (bench/results/2026-11-26-H200x2-multigpu-v18.json).
    def launch(a: int, b: int, into: Sequence[torch.Tensor]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        part = q if (a, b) == (0, n_q) else q[a:b]
        r = (
            BatchResult(*shard.search_pieces(part, k, plan))  # type: ignore[union-attr]
            if streamed
            else engine.search_batch(shard, part, k, plan)  # type: ignore[arg-type]
        )
        return _merge_later(r, offset, k, world > 1, group, into)

    return padded(run_batches(n_q, k, bq, dev, launch, progress=progress, engine=name), result_width(k_asked, total))


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
    (:class:`~gpusparse.engines.base.BatchResult`) are then merged again: that process searches
    them again, the others send their rows as they were. ``into``: page-locked host
    ``(scores, ids)`` to fill (:func:`~gpusparse.transfer.output_buffers`)."""
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
            if r.redo_search is None:
                raise RuntimeError("rows were flagged for another search, but no search was given")
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


def merged_floor(lows: torch.Tensor, *, k: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """float32 ``[B]``: a score that the merged k-th result reaches, from every process's
    candidate lower bounds ``lows`` ``[B, W]`` (:func:`gpusparse.engines.tiled.waves.candidate_lows`, 0 for
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
    if scores.is_cuda and dist.get_backend(group) == "nccl" and rowsort.available():
        # one kernel each side of one all-gather into one tensor
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


def load_shard(
    path: str | Path,
    rank: int = 0,
    world_size: int = 1,
    *,
    verify: bool = True,
    manifest: dict[str, Any] | None = None,
) -> tuple[Index, int, int]:
    """The documents process ``rank`` of ``world_size`` searches in a sharded or plain index
    folder (a plain one is a single shard), loaded on the CPU (memory-mapped): ``(index,
    global number of its first document, documents in the whole folder)``. ``manifest``: a
    sharded folder's manifest as the caller read it, to load that state (see
    :func:`same_snapshot`)."""
    if is_sharded(path):
        m = manifest or read_sharded_manifest(path)
        shards = assign_shards(len(m["shards"]), world_size, rank)
        lists, offset = load_sharded(path, shards, verify=verify, manifest=m)
        return Index.from_postings(lists), offset, m["n_docs"]
    assign_shards(1, world_size, rank)
    index = Index.load(path, verify=verify)
    return index, 0, index.n_docs


def same_snapshot(manifest: dict[str, Any] | None, group: dist.ProcessGroup | None = None) -> None:
    """Refuse, on every process, a search whose processes loaded different states of a sharded
    folder (``gpusparse add``/``delete``/``compact`` committed while they loaded it): their
    shards would not be one collection. ``manifest``: the one each process loaded."""
    token = None if manifest is None else json.dumps(manifest, sort_keys=True)
    tokens: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(tokens, token, group=group)
    if len(set(tokens)) > 1:
        raise InputError(
            "the index folder changed while the processes loaded it (gpusparse add, delete or compact "
            "committed meanwhile): run the search again"
        )
