"""Timing an index's searches the same way in every benchmark: a first call, then ``reps``
timed calls host to host, the results checked identical and summarised by a checksum."""

from __future__ import annotations

import hashlib
import statistics
import time


def timed_search(index, queries, k: int, batch: int, reps: int) -> dict:
    """``first_s`` (the first call: compiles, builds layouts), ``ms`` of each repeated call, their
    ``median_ms``, a ``checksum`` of ids and scores, and the ``engine`` that answered."""
    import torch

    t0 = time.perf_counter()
    first = index.search(queries, k, batch_size=batch)
    first_s = time.perf_counter() - t0
    times, res = [], first
    for _ in range(reps):
        t0 = time.perf_counter()
        res = index.search(queries, k, batch_size=batch)
        times.append((time.perf_counter() - t0) * 1e3)
    if not (torch.equal(res.ids, first.ids) and torch.equal(res.scores, first.scores)):
        raise RuntimeError("a repeated search returned other results")
    digest = hashlib.sha256(res.ids.numpy().tobytes() + res.scores.numpy().tobytes()).hexdigest()[:16]
    return {"first_s": first_s, "median_ms": statistics.median(times) if times else float("nan"), "ms": times,
            "checksum": digest, "engine": getattr(res, "engine", None)}  # fmt: skip
