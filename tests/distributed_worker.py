"""A process of the sharded-search tests: joins a gloo group, searches its shards, saves results.

Started by ``torch.multiprocessing.spawn`` from ``tests/test_distributed.py``; kept apart so
the children import only what they need.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import gpusparse.distributed as distributed_mod
from gpusparse import engines, read_vectors
from gpusparse.config import override_config
from gpusparse.distributed import load_shard, search_sharded
from gpusparse.engines.base import BatchResult
from gpusparse.engines.tiled import waves
from gpusparse.streaming import open_for_search


class Flagging:
    """An engine whose results flag every third row (which ones depends on ``seed``) and hold
    garbage there, as a GPU search's rows to search again do; asked again, it gives their
    real results. Merges must come out exact all the same."""

    def __init__(self, engine, seed: int) -> None:
        self.engine, self.seed = engine, seed
        self.name, self.auto_rank = engine.name, engine.auto_rank
        self.quantizes_queries = engine.quantizes_queries  # plans pass through to it unchanged

    def unavailable(self, device, *, auto=False):
        return self.engine.unavailable(device, auto=auto)

    def search_batch(self, index, queries, k, plan) -> BatchResult:
        scores, ids = self.engine.search_batch(index, queries, k, plan).resolved()
        flags = (torch.arange(len(queries)) + self.seed) % 3 == 0
        bad_s, bad_i = scores.clone(), ids.clone()
        bad_s[flags], bad_i[flags] = 1e30, 0  # would win every merge if it were used

        def again(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            at = torch.from_numpy(rows)
            return scores[at].clone(), ids[at].clone()

        return BatchResult(bad_s, bad_i, flags, again)


def flagging(choose: Callable, seed: int) -> Callable:
    """``engines.choose`` whose engines flag rows (see :class:`Flagging`)."""

    def wrapped(name, device):
        return Flagging(choose(name, device), seed)

    return wrapped


def search_worker(rank: int, world: int, tmp: str, folders: list[str], ks: list[int], kernels: list[str]) -> None:
    """For each folder, pieces (resident, or streamed in 2) and k: this rank's merged results,
    saved to ``tmp/rank{rank}.pt`` as ``{(folder, pieces, kernel, k): (scores, ids)}``."""
    # a process left out of a collective fails the test in a minute instead of hanging it
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    plain, floor = engines.choose, distributed_mod.merged_floor
    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return floor(*a, **kw)

    distributed_mod.merged_floor = counted
    try:
        out = {}
        for folder in folders:
            host, offset, n_docs = load_shard(folder, rank, world)
            queries = read_vectors(Path(tmp) / "queries.jsonl", host.vocab, progress=False)
            for name in kernels:
                # "tiled-whole": one batch of more than 8 queries; "tiled-exchange": the same with the
                # shards exchanging lower bounds (EngineConfig.shard_lower_bounds, off by default);
                # "tiled-mixed": that with one process's shard streamed (then no exchange)
                whole = ("tiled-whole", "tiled-exchange", "tiled-mixed")
                kernel = "reference" if name == "flagged" else "tiled" if name in whole else name
                batch_size = None if name in whole else 4
                exchange = name in ("tiled-exchange", "tiled-mixed")
                # "flagged": the reference kernel, some rows to search again (others on each process)
                engines.choose = flagging(plain, rank) if name == "flagged" else plain
                for pieces in (None, 2):
                    mixed = name == "tiled-mixed" and rank % 2 == 1  # resident beside streamed, then swapped
                    shard = open_for_search(
                        host, "cpu", kernel=kernel, pieces=(2 if pieces is None else None) if mixed else pieces
                    )
                    for k in ks:
                        with override_config(shard_lower_bounds=exchange):
                            res = search_sharded(
                                shard, queries, k, offset=offset, n_docs=n_docs, batch_size=batch_size, kernel=kernel
                            )
                        out[(Path(folder).name, pieces, name, k)] = (res.scores, res.ids)
                out[("merged_floor calls", Path(folder).name, name)] = len(calls)
                calls.clear()
        torch.save(out, Path(tmp) / f"rank{rank}.pt")
    finally:
        engines.choose, distributed_mod.merged_floor = plain, floor
        dist.destroy_process_group()


def nccl_worker(rank: int, world: int, tmp: str, n_docs: int, n_queries: int, ks: list[int]) -> None:
    """One GPU's process of a synthetic sharded search (NCCL): results of each k (one batch, and
    batches of 16) saved to ``tmp/nccl{rank}.pt``."""
    from gpusparse import Index, SparseCollection, Vocabulary
    from gpusparse.shards import document_ranges
    from gpusparse.synthetic import generate

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous-nccl", rank=rank, world_size=world)
    try:
        (di, dt, dw), (qi, qt, qw) = generate(n_docs, n_queries, seed=3)
        a, b = document_ranges(n_docs, world)[rank]
        lo, hi = int(di[a]), int(di[b])
        shard = Index.from_csr(di[a : b + 1] - lo, dt[lo:hi], dw[lo:hi], Vocabulary.bert(), device=f"cuda:{rank}")
        queries = SparseCollection(qi.numpy(), qt.numpy(), qw.numpy(), vocab=Vocabulary.bert())
        out = {}
        for k in ks:
            for batch_size in (None, 16):
                res = search_sharded(shard, queries, k, offset=a, n_docs=n_docs, batch_size=batch_size)
                out[(k, batch_size)] = (res.scores, res.ids)
        capacity = waves.initial_capacity
        waves.initial_capacity = lambda k, first_wave: 8  # every row overflows: searched again, merged again
        try:
            for batch_size in (None, 16):
                res = search_sharded(shard, queries, max(ks), offset=a, n_docs=n_docs, batch_size=batch_size)
                out[("rerun", max(ks), batch_size)] = (res.scores, res.ids)
        finally:
            waves.initial_capacity = capacity
        torch.save(out, Path(tmp) / f"nccl{rank}.pt")
    finally:
        dist.destroy_process_group()


def bound_worker(rank: int, world: int, tmp: str) -> None:
    """Two shards, the large weights in rank 1's only: each rank records the refusal of a
    query overflowing through that shard, and a huge k's results, to ``tmp/bound{rank}.pt``."""
    from gpusparse import Index, SparseCollection, Vocabulary
    from gpusparse.errors import InputError

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        vocab = Vocabulary.integer(4)
        docs = [{"0": 1.0, "1": 1.0}, {"0": 2.0}] if rank == 0 else [{"2": 4.0, "3": 4.0}, {"0": 1.0, "2": 1.0}]
        shard = Index.build(SparseCollection.from_dicts(docs, vocab=vocab))
        out: dict[str, object] = {"n_docs": 4}
        try:  # through shard 1 alone: 4 · 5e37 + 4 · 5e37 = 4e38
            search_sharded(shard, [{"2": 5e37, "3": 5e37}], 3, offset=2 * rank, n_docs=None)
            out["refused"] = ""
        except InputError as exc:
            out["refused"] = str(exc)
        res = search_sharded(shard, [{"0": 1.0, "2": 1.0}], 100_000_000_000, offset=2 * rank)
        out["width"], out["ids"] = res.ids.shape[1], res.ids
        torch.save(out, Path(tmp) / f"bound{rank}.pt")
    finally:
        dist.destroy_process_group()


def snapshot_worker(rank: int, world: int, tmp: str) -> None:
    """``same_snapshot`` on manifests that agree, then on ones that differ on one process:
    writes ``tmp/snapshot{rank}.txt`` with what each call did (``ok`` or ``refused``)."""
    from gpusparse.distributed import same_snapshot
    from gpusparse.errors import InputError

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    seen = []
    try:
        for manifest in ({"generation": 3}, {"generation": 3 + (rank == world - 1)}, None):
            try:
                same_snapshot(manifest)
                seen.append("ok")
            except InputError as exc:
                seen.append("refused" if "changed while the processes loaded it" in str(exc) else str(exc))
    finally:
        dist.destroy_process_group()
    (Path(tmp) / f"snapshot{rank}.txt").write_text(" ".join(seen), encoding="utf-8")
