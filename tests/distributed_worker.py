"""A process of the sharded-search tests: joins a gloo group, searches its shards, saves results.

Started by ``torch.multiprocessing.spawn`` from ``tests/test_distributed.py``; kept apart so
the children import only what they need.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from gpusparse import read_vectors
from gpusparse.distributed import load_shard, open_for_search, search_sharded


def search_worker(rank: int, world: int, tmp: str, folders: list[str], ks: list[int], kernels: list[str]) -> None:
    """For each folder, pieces (resident, or streamed in 2) and k: this rank's merged results,
    saved to ``tmp/rank{rank}.pt`` as ``{(folder, pieces, kernel, k): (scores, ids)}``."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        out = {}
        for folder in folders:
            host, offset, n_docs = load_shard(folder, rank, world)
            queries = read_vectors(Path(tmp) / "queries.jsonl", host.vocab, progress=False)
            for kernel in kernels:
                for pieces in (None, 2):
                    shard = open_for_search(host, "cpu", kernel=kernel, pieces=pieces)
                    for k in ks:
                        res = search_sharded(
                            shard, queries, k, offset=offset, n_docs=n_docs, batch_size=4, kernel=kernel
                        )
                        out[(Path(folder).name, pieces, kernel, k)] = (res.scores, res.ids)
        torch.save(out, Path(tmp) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
