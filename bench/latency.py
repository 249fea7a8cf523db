"""Small-batch latency and the host's cost of launching a batch (issue 23), one call.

Usage (GPU machine):
    python bench/latency.py --out $OUT/latency.json --commit SHA [--n 8841823] [--quantize 0 8]

For each index (float32, and 8-bit levels with ``--quantize 8``) on the same generated
collection, it records:

* ``h2h_ms``: ``Index.search`` of B queries at top-k, host to host (median; the issue's
  "batch 1, top-10, host to host");
* ``engine_ms``: the engine's search of an already laid-out batch, ``.resolved()`` and synced;
* ``replay_ms``: the captured CUDA graph of that search replayed alone and synced (the device's
  time plus one launch: the floor of this design at that batch);
* ``device_busy_ms``: the device time of one ``Index.search`` (torch.profiler: kernels and copies;
  measured last, as the profiler slows the host's later operations);
* ``host_us``: inclusive host microseconds of each step of ``Index.search`` (perf_counter wrappers);
* ``host_launch_ms``: for batch 256 at top-1000, the host time of launching one batch while the
  device is busy with the batch before (``search_batch`` up to its return, no sync).

Every search's results are checked identical to the scatter kernel's (exact) on the same
queries. GPU bytes over every allocator are recorded (bench/gpu_peaks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_peaks import gpu_memory  # noqa: E402
from gpusparse import Index, SparseCollection, Vocabulary  # noqa: E402
from gpusparse.config import engine_config, override_config  # noqa: E402
from gpusparse.engines import choose  # noqa: E402
from gpusparse.engines.base import SearchPlan  # noqa: E402
from gpusparse.engines.tiled.engine import tiled_search  # noqa: E402
from gpusparse.layout.statistics import max_scores_host  # noqa: E402
from gpusparse.queries import prepare_queries, query_batch  # noqa: E402
from gpusparse.synthetic import generate  # noqa: E402
from search_timing import timed_search  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _busy_ms(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / 1e3


def small_batch(index: Index, queries: SparseCollection, b: int, k: int, reps: int) -> dict:
    q = queries[0:b]
    ref = index.search(q, k, kernel="scatter")
    res = index.search(q, k)
    exact = bool(torch.equal(res.ids, ref.ids) and torch.equal(res.scores, ref.scores))
    h2h = _median_ms(lambda: index.search(q, k), reps)
    idx = index.resident_on(index.device)
    batch = query_batch(prepare_queries(q, idx.vocab, idx.quantization, max_scores_host(idx)), idx.device)
    engine = _median_ms(lambda: tiled_search(idx, batch, k).resolved(), reps)
    graphs = idx.derived.graphs
    replay = None
    if graphs:
        graph = next(reversed(graphs.values()))
        if graph:
            if hasattr(graph, "slots"):  # the graph copies its inputs in and its results out
                replay = _median_ms(graph.slots[0].graph.replay, reps)
            else:  # older trees
                replay = _median_ms(graph.graph.replay if hasattr(graph, "graph") else graph[0].replay, reps)
    return {"batch": b, "k": k, "exact": exact, "h2h_ms": h2h, "engine_ms": engine, "replay_ms": replay}


BREAKDOWN = [
    ("gpusparse.search", "prepare_queries"),
    ("gpusparse.search", "search_batches"),
    ("gpusparse.search", "complete_later"),
    ("gpusparse.search", "start_to_host"),
    ("gpusparse.search", "padded"),
    ("gpusparse.engines.tiled.engine", "query_batch"),
    ("gpusparse.engines.tiled.engine", "tiled_search"),
    ("gpusparse.engines.tiled.engine", "layout_for_search"),
    ("gpusparse.engines.tiled.engine", "fixed_point"),
    ("gpusparse.engines.tiled.engine", "integer_weights"),
    ("gpusparse.engines.tiled.engine", "device_search"),
    ("gpusparse.engines.tiled.engine", "graphed_batch_search"),
    ("gpusparse.engines.tiled.engine", "padded_host"),
    ("gpusparse.engines.tiled.engine", "fixed_point_host"),
    ("gpusparse.engines.tiled.engine", "graphed_steps"),
    ("gpusparse.engines.tiled.device", "match_floor"),
    ("gpusparse.engines.tiled.device", "_graphed_search"),
]


def breakdown(index: Index, queries: SparseCollection, b: int, k: int, reps: int) -> dict:
    """Inclusive host microseconds a call of each step of ``Index.search`` (nested steps are
    inside their callers), from perf_counter wrappers; the search synced at the end only."""
    import importlib

    totals: dict[str, list[float]] = {}
    saved = []

    def wrap(name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)

        return timed

    for mod_name, attr in BREAKDOWN:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, attr, None)
        if fn is None:  # an older tree (bench run against the code before)
            continue
        saved.append((mod, attr, fn))
        setattr(mod, attr, wrap(f"{mod_name.rsplit('.', 1)[-1]}.{attr}", fn))
    q = queries[0:b]
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            index.search(q, k)
            totals.setdefault("Index.search", []).append((time.perf_counter() - t0) * 1e6)
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
    return {name: statistics.median(v) for name, v in totals.items()}


def host_launch(index: Index, queries: SparseCollection, b: int, k: int, reps: int) -> dict:
    """Host ms of launching batch i while the device still runs batch i - 1."""
    idx = index.resident_on(index.device)
    eng = choose("auto", idx.device)
    q = prepare_queries(queries[0:b], idx.vocab, idx.quantization, max_scores_host(idx))
    plan = SearchPlan(doc_chunk=idx.n_docs, memory_budget=1 << 34)
    eng.search_batch(idx, q, k, plan).resolved()
    torch.cuda.synchronize()
    times, busy_after = [], []
    prev = eng.search_batch(idx, q, k, plan)
    for _ in range(reps):
        t0 = time.perf_counter()
        cur = eng.search_batch(idx, q, k, plan)
        times.append((time.perf_counter() - t0) * 1e3)
        # the device was still busy when the launch returned: it did not wait for the batch before
        busy_after.append(not torch.cuda.current_stream().query())
        prev.resolved()
        prev = cur
    prev.resolved()
    torch.cuda.synchronize()
    return {"batch": b, "k": k, "host_launch_ms": statistics.median(times),
            "device_still_busy_frac": sum(busy_after) / len(busy_after)}  # fmt: skip


def pipelined(index: Index, queries: SparseCollection, b: int, k: int) -> dict:
    """All queries in batches of ``b`` by one ``Index.search`` (batches pipelined): ms a batch
    (bench/search_timing.timed_search: median of 3 after a first call, repeats identical) and
    the first batch's agreement with the scatter kernel's."""
    timing = timed_search(index, queries, k, b, 3)
    per_batch = timing["median_ms"] / -(-len(queries) // b)
    res = index.search(queries, k, batch_size=b)
    ref = index.search(queries[0:b], k, kernel="scatter")
    exact = bool(torch.equal(res.ids[:b], ref.ids) and torch.equal(res.scores[:b], ref.scores))
    return {"pipelined_ms_per_batch": per_batch, "pipelined_qps": b / per_batch * 1e3,
            "pipelined_first_batch_exact": exact, "pipelined_checksum": timing["checksum"]}  # fmt: skip


def probe() -> dict:
    """Host speed of this process now: microseconds of 10 small numpy operations (median),
    Python threads and OS threads (a slow host path may be contention, not code)."""
    import os
    import threading

    import numpy as np

    a = np.arange(64)
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        for _ in range(10):
            np.maximum(a, 3)
        times.append((time.perf_counter() - t0) * 1e6)
    return {"numpy_10_ops_us": statistics.median(times), "python_threads": [t.name for t in threading.enumerate()],
            "os_threads": len(os.listdir("/proc/self/task"))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8_841_823)
    p.add_argument("--quantize", type=int, nargs="+", default=[0, 8])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="unknown")
    p.add_argument(
        "--doc-order", default=None, help="EngineConfig.doc_order for the searches (default: the configured)"
    )
    args = p.parse_args()
    scope = override_config(doc_order=args.doc_order) if args.doc_order else contextlib.nullcontext()
    with scope:
        run(args)


def run(args) -> None:
    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n, 2048, seed=0, device="cuda")
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    out = {"card": torch.cuda.get_device_name(0), "commit": args.commit, "n_docs": args.n,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": [],
           "doc_order": engine_config().doc_order}  # fmt: skip
    out["probe_start"] = probe()
    print("probe at start", out["probe_start"], flush=True)
    for bits in args.quantize:
        index = Index.from_csr(di, dt_, dw, vocab, device="cuda", quantize=bits or None)
        out[f"probe_{bits}"] = probe()
        print("probe after the build", out[f"probe_{bits}"], flush=True)
        label = "8-bit" if bits else "float32"
        for b, k in ((1, 10), (8, 10)):
            row = {"weights": label, **small_batch(index, queries, b, k, args.reps)}
            row["host_us"] = breakdown(index, queries, b, k, args.reps)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
        row = {"weights": label, **host_launch(index, queries, 256, 1000, 20)}
        row.update(pipelined(index, queries, 256, 1000))
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        # last: the profiler leaves the host slower for the operations after it
        for row in out["rows"]:
            if row["weights"] == label and "h2h_ms" in row:
                q = queries[0 : row["batch"]]
                row["device_busy_ms"] = _busy_ms(functools.partial(index.search, q, row["k"]))
        out[f"gpu_memory_{label}"] = gpu_memory()
        del index
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=2))
    print(f"{'weights':8} {'B':>4} {'k':>5} {'h2h ms':>8} {'engine':>8} {'replay':>8} {'busy':>8} {'launch':>8} "
          f"{'pipe ms':>8}")  # fmt: skip
    for r in out["rows"]:
        if "host_us" in r:
            print(f"{r['weights']} B={r['batch']}: " + ", ".join(f"{n} {v:.0f}" for n, v in r["host_us"].items()))
    for r in out["rows"]:
        cols = [r.get(c) for c in ("h2h_ms", "engine_ms", "replay_ms", "device_busy_ms", "host_launch_ms",
                                   "pipelined_ms_per_batch")]  # fmt: skip
        print(f"{r['weights']:8} {r['batch']:>4} {r['k']:>5} " + " ".join(
            f"{c:8.3f}" if isinstance(c, float) else f"{'-':>8}" for c in cols))  # fmt: skip


if __name__ == "__main__":
    main()
