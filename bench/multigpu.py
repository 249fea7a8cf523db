"""One GPU against several in the same run, and the streamed mode (issue #8).

Launched by torchrun, one process per GPU. Process 0 generates a seeded synthetic MS
MARCO-scale collection and a query batch on its GPU (``gpusparse.synthetic``; nothing is
read from disk) and broadcasts them to the others, then:

1. **1 GPU, resident**: process 0 indexes all documents and times
   ``search_sharded(..., distributed=False)`` (queries in from the host, top-k back to it);
   its top-k on the first ``--exact-sample`` queries is checked against the exact
   reference kernel.
2. **N GPUs, resident**: each process indexes its contiguous shard and all time
   ``search_sharded`` together (per-shard top-k, NCCL all_gather, device-side merge); the
   merged results must equal step 1's (ids and score bits, every query).
3. **Streamed** (forced): the same index, then each shard, kept in pinned host memory in
   ``--stream-pieces`` document ranges, piece ``i + 1`` copied on a side stream while piece
   ``i`` is searched; timed on 1 GPU and on N, results checked against step 1. The pinned
   host-to-device copy rate is measured in the same run.

Timing: ``--warmup`` calls, then ``--reps`` calls started together (a barrier before each),
timed with CUDA events on process 0; medians are reported. Writes
``<out>/<date>-<card>-<name>.json`` and prints a short table last.

Usage, from the repository root on a 2-GPU machine:
    python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multigpu.py --out $OUT
CPU dry run (gloo, tiny sizes):
    torchrun --standalone --nproc-per-node=2 bench/multigpu.py --cpu --docs 20000 --batch 32 --k 100 --out /tmp/mg
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse import Index, SparseCollection, Vocabulary, engines
from gpusparse.config import engine_config, override_config
from gpusparse.distributed import init_from_env, search_sharded
from gpusparse.search import SearchResults
from gpusparse.shards import document_ranges
from gpusparse.streaming import StreamedIndex
from gpusparse.synthetic import MSMARCO_TARGETS, format_stats, generate, synthetic_stats
from gpusparse_bench.runner import RunConfig, environment, time_once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8_841_823)
    ap.add_argument("--batch", type=int, default=256, help="queries per batch (one batch is timed)")
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument(
        "--batches", type=int, default=8, help="batches timed in one call, pipelined (0: no pipelined rows)"
    )
    ap.add_argument(
        "--long-batches", type=int, default=0, help="also time calls of this many batches (a dev set's worth; 0: no)"
    )
    ap.add_argument(
        "--ab-two-round", action="store_true", help="also time the N-GPU rows with the lower-bound exchange switched"
    )
    ap.add_argument("--host-reps", type=int, default=10, help="timed host launches of one batch with the GPU kept busy")
    ap.add_argument(
        "--ab",
        nargs="*",
        default=[],
        choices=sorted(VARIANTS),
        help="also time the resident rows (1 and N GPUs, one batch and pipelined) with these variants",
    )
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stream-pieces", type=int, default=4, help="pieces of each streamed index")
    ap.add_argument("--stream-reps", type=int, default=5, help="timed streamed calls (0: no streamed rows)")
    ap.add_argument("--exact-sample", type=int, default=32, help="queries checked against the reference kernel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with gloo")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default="multigpu")
    ap.add_argument("--commit", help="git commit to record [default: git rev-parse HEAD]")
    ap.add_argument(
        "--profile", action="store_true", help="also profile one resident search per mode (timeline under --out)"
    )
    args = ap.parse_args()

    rank, world, dev = init_from_env("cpu" if args.cpu else None)
    cuda = dev.type == "cuda"
    start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    cfg = RunConfig(device=str(dev), commit=args.commit, command=" ".join(["bench/multigpu.py", *sys.argv[1:]]))
    env = environment(cfg)
    cards: list[str | None] = [None] * world
    dist.all_gather_object(cards, torch.cuda.get_device_name(dev) if cuda else "cpu")
    env |= {"world_size": world, "backend": dist.get_backend(), "cards_per_process": cards}
    kernel = engines.choose("auto", dev).name
    log(f"{world} processes on {', '.join(str(c) for c in cards)}; kernel {kernel}")

    # -- the collection: generated by process 0, sent to the others ----------------------------
    t0 = time.perf_counter()
    docs, qcsr = broadcast_collection(args, rank, dev)
    _sync(dev)
    t_gen = time.perf_counter() - t0
    vocab = Vocabulary.bert()
    all_queries = SparseCollection(qcsr[0].cpu().numpy(), qcsr[1].cpu().numpy(), qcsr[2].cpu().numpy(), vocab=vocab)
    queries = all_queries[: args.batch]  # the single batch
    piped = all_queries[: args.batch * max(1, args.batches)]  # the pipelined rows
    long_q = all_queries[: args.batch * args.long_batches]  # the long rows
    collection: dict[str, object] = {"n_docs": args.docs, "n_postings": int(docs[1].numel()), "generate_s": t_gen}
    if rank == 0:
        stats = synthetic_stats(docs, qcsr)
        collection["stats"] = stats
        log(f"generated {args.docs:,} documents in {t_gen:.1f} s\n{format_stats(stats)}")
    del qcsr
    rows: list[dict] = []

    # -- 1 GPU, resident ----------------------------------------------------------------------
    one: SearchResults | None = None
    one_all: SearchResults | None = None
    one_long: SearchResults | None = None
    full: Index | None = None
    if rank == 0:
        t0 = time.perf_counter()
        full = Index.from_csr(*docs, vocab, device=dev)
        _sync(dev)
        collection |= {"index_s": time.perf_counter() - t0, "index_bytes": _nbytes(full)}
        _reset_peak(dev)
        times, one = timed(lambda: search_sharded(full, queries, args.k, distributed=False), dev, args, lockstep=False)
        rows.append(_row("resident", 1, times, args, dev, identical=True))
        collection["layout_bytes"] = full.derived.device_bytes()
        if cuda:
            rows[-1]["host_launch_ms"] = host_launch_ms(full, queries, args.k, 1, 0, args.host_reps)
            log(f"1 GPU: host launch of one batch {rows[-1]['host_launch_ms']:.2f} ms")
        if args.profile:
            trace = args.out / "trace-1gpu-rank0.json"
            rows[-1]["profile"] = profile_call(
                lambda: search_sharded(full, queries, args.k, distributed=False), dev, trace
            )
        n = min(args.exact_sample, len(queries))
        ref = full.search(queries[:n], args.k, kernel="reference")
        exact = torch.equal(ref.ids, one.ids[:n]) and ref.scores.numpy().tobytes() == one.scores[:n].numpy().tobytes()
        collection |= {"exact_vs_reference": exact, "exact_sample": n}
        log(f"1 GPU: median {rows[-1]['median_ms']:.1f} ms; {n} queries equal to the reference kernel's: {exact}")
        if args.batches > 0:
            one_all = pipelined_row(rows, 1, lambda: search_sharded(full, piped, args.k, distributed=False,
                                                                   batch_size=args.batch), dev, args, None)  # fmt: skip
        if args.long_batches > 0:
            one_long = pipelined_row(rows, 1, lambda: search_sharded(full, long_q, args.k, distributed=False,
                                     batch_size=args.batch), dev, args, None, f"pipe-{args.long_batches}",
                                     batches=args.long_batches)  # fmt: skip
        for name in args.ab:
            with VARIANTS[name](full):
                times, res = timed(lambda: search_sharded(full, queries, args.k, distributed=False), dev, args,
                                   lockstep=False)  # fmt: skip
                rows.append(_row(name, 1, times, args, dev, identical=_same(res, one)))
                if cuda:
                    rows[-1]["host_launch_ms"] = host_launch_ms(full, queries, args.k, 1, 0, args.host_reps)
                if args.batches > 0:
                    pipelined_row(rows, 1, lambda: search_sharded(full, piped, args.k, distributed=False,
                                  batch_size=args.batch), dev, args, one_all, f"pipe-{name}")  # fmt: skip
    dist.barrier()

    # -- N GPUs, resident ---------------------------------------------------------------------
    a, b = document_ranges(args.docs, world)[rank]
    indptr, terms, weights = docs
    lo, hi = int(indptr[a]), int(indptr[b])
    shard = Index.from_csr(indptr[a : b + 1] - lo, terms[lo:hi], weights[lo:hi], vocab, device=dev)
    del docs, indptr, terms, weights
    _reset_peak(dev)

    def sharded() -> SearchResults:
        return search_sharded(shard, queries, args.k, offset=a, n_docs=args.docs)

    times, many = timed(sharded, dev, args, lockstep=True)
    prof = None
    if args.profile:
        dist.barrier()
        prof = profile_call(sharded, dev, args.out / f"trace-{world}gpu-rank{rank}.json", dist.barrier)
    profs: list[dict | None] = [None] * world
    dist.all_gather_object(profs, prof)
    host_ms = host_launch_ms(shard, queries, args.k, world, a, args.host_reps) if cuda else None
    if rank == 0:
        row = _row("resident", world, times, args, dev, identical=_same(many, one))
        if args.profile:
            row["profile_per_process"] = profs
        row["speedup_vs_1_gpu"] = rows[0]["median_ms"] / row["median_ms"]
        if host_ms is not None:
            row["host_launch_ms"] = host_ms
        rows.append(row)
        log(
            f"{world} GPUs: median {row['median_ms']:.1f} ms, {row['speedup_vs_1_gpu']:.2f}x one GPU; "
            f"identical: {row['identical_to_1_gpu']}; host launch of one batch {host_ms} ms"
        )
    if args.ab_two_round:  # the same searches with the lower-bound exchange switched (off by default)
        default = engine_config().shard_lower_bounds
        label = "1-round" if default else "2-round"
        with override_config(shard_lower_bounds=not default):
            times, res = timed(sharded, dev, args, lockstep=True)
            if rank == 0:
                rows.append(_row(label, world, times, args, dev, identical=_same(res, one)))
                rows[-1]["speedup_vs_1_gpu"] = rows[0]["median_ms"] / rows[-1]["median_ms"]
                log(f"{world} GPUs, {label}: median {rows[-1]['median_ms']:.2f} ms")
            if args.batches > 0:
                pipelined_row(rows if rank == 0 else [], world, lambda: search_sharded(shard, piped, args.k,
                              offset=a, n_docs=args.docs, batch_size=args.batch), dev, args,
                              one_all if rank == 0 else None, f"pipe-{label}", "pipelined")  # fmt: skip

    def pipelined_sharded() -> SearchResults:
        return search_sharded(shard, piped, args.k, offset=a, n_docs=args.docs, batch_size=args.batch)

    if args.batches > 0:
        pipelined_row(rows if rank == 0 else [], world, pipelined_sharded, dev, args, one_all if rank == 0 else None)
    if args.long_batches > 0:
        pipelined_row(rows if rank == 0 else [], world, lambda: search_sharded(shard, long_q, args.k, offset=a,
                      n_docs=args.docs, batch_size=args.batch), dev, args, one_long if rank == 0 else None,
                      f"pipe-{args.long_batches}", batches=args.long_batches)  # fmt: skip
    for name in args.ab:
        with VARIANTS[name](shard):
            times, res = timed(sharded, dev, args, lockstep=True)
            host_ms = host_launch_ms(shard, queries, args.k, world, a, args.host_reps) if cuda else None
            if rank == 0:
                rows.append(_row(name, world, times, args, dev, identical=_same(res, one)))
                base = [r for r in rows if r["mode"] == name and r["gpus"] == 1]
                rows[-1]["speedup_vs_1_gpu"] = base[0]["median_ms"] / rows[-1]["median_ms"]
                if host_ms is not None:
                    rows[-1]["host_launch_ms"] = host_ms
            if args.batches > 0:
                pipelined_row(rows if rank == 0 else [], world, pipelined_sharded, dev, args,
                              one_all if rank == 0 else None, f"pipe-{name}")  # fmt: skip

    # -- streamed from pinned host memory ------------------------------------------------------
    if args.stream_reps <= 0:
        if rank == 0:
            write(args, env, collection, rows)
        dist.barrier()
        dist.destroy_process_group()
        return
    h2d = _h2d_rate(dev) if cuda and rank == 0 else None
    streamed_one = StreamedIndex(full, args.stream_pieces, dev, kernel=kernel) if rank == 0 else None
    streamed_many = StreamedIndex(shard, args.stream_pieces, dev, kernel=kernel)
    full = shard = None  # type: ignore[assignment]  # only the pinned host copies remain
    if cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    reps = argparse.Namespace(**{**vars(args), "reps": args.stream_reps, "warmup": 1})
    if rank == 0:
        assert streamed_one is not None
        _reset_peak(dev)
        times, res = timed(
            lambda: search_sharded(streamed_one, queries, args.k, distributed=False), dev, reps, lockstep=False
        )
        rows.append(_streamed_row(1, times, reps, dev, streamed_one, _same(res, one), h2d))
        log(f"1 GPU streamed: median {rows[-1]['median_ms']:.1f} ms")
        del streamed_one
    dist.barrier()
    _reset_peak(dev)
    times, res = timed(
        lambda: search_sharded(streamed_many, queries, args.k, offset=a, n_docs=args.docs), dev, reps, lockstep=True
    )
    sizes: list[int | None] = [None] * world
    dist.all_gather_object(sizes, streamed_many.nbytes)
    if rank == 0:
        row = _streamed_row(world, times, reps, dev, streamed_many, _same(res, one), h2d)
        row["host_bytes"] = sum(s or 0 for s in sizes)
        rows.append(row)
        log(f"{world} GPUs streamed: median {row['median_ms']:.1f} ms")
        write(args, env, collection, rows)
    dist.barrier()
    dist.destroy_process_group()


def pipelined_row(
    rows: list[dict],
    gpus: int,
    fn: Callable[[], SearchResults],
    dev: torch.device,
    args: argparse.Namespace,
    ref: SearchResults | None,
    mode: str = "pipelined",
    base_mode: str | None = None,
    batches: int | None = None,
) -> SearchResults:
    """Time ``fn`` (all ``--batches`` batches in one call, so each batch's host work overlaps
    the device's work on the one before) and append its row to ``rows`` (process 0); its
    speedup is against the 1-GPU row of ``base_mode`` (default: ``mode``)."""
    times, res = timed(fn, dev, args, lockstep=gpus > 1)
    prof = None
    if args.profile and mode == "pipelined":  # the timeline of every batch and process
        rank = dist.get_rank() if gpus > 1 else 0
        prof = profile_call(
            fn, dev, args.out / f"trace-pipe-{gpus}gpu-rank{rank}.json", dist.barrier if gpus > 1 else None
        )
        if gpus > 1:
            profs: list[dict | None] = [None] * gpus
            dist.all_gather_object(profs, prof)
    if not rows and gpus > 1:
        return res  # not process 0
    nb = batches or args.batches
    n = args.batch * nb
    row = _row(mode, gpus, times, args, dev, identical=ref is None or _same(res, ref))
    row |= {"batches": nb, "qps": n / (row["median_ms"] / 1e3), "ms_per_batch": row["median_ms"] / nb}
    if prof is not None:
        row["profile_per_process"] = profs if gpus > 1 else [prof]
    base = [r for r in rows if r["mode"] == (base_mode or mode) and r["gpus"] == 1]
    if base:
        row["speedup_vs_1_gpu"] = base[0]["median_ms"] / row["median_ms"]
    rows.append(row)
    print(f"{mode}, {gpus} GPU(s): {nb} batches in {row['median_ms']:.1f} ms "
          f"({row['ms_per_batch']:.2f} ms a batch, {row['qps']:,.0f} QPS); identical: {row['identical_to_1_gpu']}",
          flush=True)  # fmt: skip
    return res


def host_launch_ms(index: Index, queries: SparseCollection, k: int, world: int, offset: int, reps: int) -> float:
    """Median host milliseconds to launch one batch's search and merge (what
    ``search_sharded`` does per batch) while the GPU is kept busy by a sleep kernel queued
    first, so that no launch waits for the device: the host's share of a pipelined batch."""
    import functools

    import gpusparse.distributed as distributed_mod
    from gpusparse.engines.base import SearchPlan

    q = distributed_mod.prepare_queries(queries, index.vocab, index.quantization)
    two_round = world > 1 and engine_config().shard_lower_bounds
    cutoff = functools.partial(distributed_mod.merged_floor, k=k) if two_round else None
    plan = SearchPlan(doc_chunk=1 << 20, cutoff=cutoff)
    engine = engines.get("tiled")
    times = []
    for _ in range(reps + 2):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of device work ahead of the launches
        t0 = time.perf_counter()
        r = engine.search_requests(index, q, k, plan)
        finish = distributed_mod._merge_later(r, offset, k, world > 1, None)
        times.append((time.perf_counter() - t0) * 1e3)
        finish()
    return statistics.median(times[2:])


@contextlib.contextmanager
def without_forward(index: Index) -> Iterator[None]:
    """Within: ``index``'s tiled layouts without their forward copy (rescoring by binary
    searches in the inverted lists, as before it), for an A/B in one run."""
    saved = dict(index.derived.layouts)
    index.derived.layouts.update({key: replace(v, forward=None) for key, v in saved.items()})
    try:
        yield
    finally:
        index.derived.layouts.update(saved)


@contextlib.contextmanager
def graphed(index: Index) -> Iterator[None]:
    """Within: every batch size replays a captured CUDA graph of the device steps (without
    the lower-bound exchange, which graphed batches skip)."""
    with override_config(graph_max_batch=1 << 30):
        yield


# --ab variants: name -> context manager over the index searched within it.
VARIANTS = {"lists": without_forward, "graph": graphed}


def _most_batches(args: argparse.Namespace) -> int:
    return max(1, args.batches, args.long_batches)


def broadcast_collection(args: argparse.Namespace, rank: int, dev: torch.device) -> tuple[tuple, tuple]:
    """The synthetic documents and queries as CSR ``(indptr, terms, weights)`` on every process:
    generated on process 0's device and broadcast, so all processes hold the same bits."""
    if rank == 0:
        docs, queries = generate(args.docs, args.batch * _most_batches(args), seed=args.seed, device=dev)
        sizes = [docs[1].numel(), queries[1].numel()]
    else:
        sizes = [0, 0]
    dist.broadcast_object_list(sizes, src=0)
    if rank != 0:
        docs, queries = (
            (
                torch.empty(n + 1, dtype=torch.int64, device=dev),
                torch.empty(nnz, dtype=torch.int32, device=dev),
                torch.empty(nnz, dtype=torch.float32, device=dev),
            )
            for n, nnz in ((args.docs, sizes[0]), (args.batch * _most_batches(args), sizes[1]))
        )
    for t in (*docs, *queries):
        dist.broadcast(t, src=0)
    return docs, queries


def timed(
    fn: Callable[[], SearchResults], dev: torch.device, args: argparse.Namespace, *, lockstep: bool
) -> tuple[list[float], SearchResults]:
    """Milliseconds of ``args.reps`` calls after ``args.warmup`` (CUDA events on a GPU), and the
    last result. With ``lockstep`` every process makes the same calls, started by a barrier."""
    out = None
    for _ in range(args.warmup):
        out = fn()
    times = []
    for _ in range(args.reps):
        if lockstep:
            dist.barrier()
        _sync(dev)
        ms, out = time_once(fn, dev)
        times.append(ms)
    assert out is not None
    return times, out


# Functions timed as named ranges under --profile: (module, attribute) -> range name.
PROFILED = {
    ("gpusparse.distributed", "prepare_queries"): "prepare_queries",
    ("gpusparse.engines.tiled.engine", "query_batch"): "query_batch",
    ("gpusparse.engines.tiled.engine", "fixed_point"): "fixed_point",
    ("gpusparse.engines.tiled.device", "match_floor"): "match_floor",
    ("gpusparse.engines.tiled.engine", "device_search"): "device_search",
    ("gpusparse.engines.tiled.engine", "tiled_search"): "tiled_search",
    ("gpusparse.distributed", "merge_across_ranks"): "merge_across_ranks",
    ("gpusparse.distributed", "results_to_host"): "results_to_host",
}


def profile_call(
    fn: Callable[[], object], dev: torch.device, trace: Path, start: Callable[[], object] | None = None
) -> dict:
    """One call under torch.profiler: its wall ms, the host ms inside each :data:`PROFILED`
    function, every device operation's ms, and the device's idle time; timeline to ``trace``.
    ``start``: called inside the profiled region just before the timed call (a barrier)."""
    import importlib

    from torch.profiler import ProfilerActivity, profile, record_function

    saved = []
    for (mod_name, attr), label in PROFILED.items():
        mod = importlib.import_module(mod_name)
        orig = getattr(mod, attr)

        def wrapped(*a, _orig=orig, _label=label, **kw):
            with record_function(_label):
                return _orig(*a, **kw)

        saved.append((mod, attr, orig))
        setattr(mod, attr, wrapped)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    try:
        fn()  # the wrappers' first call
        _sync(dev)
        with profile(activities=activities) as prof:
            if start is not None:
                start()
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            wall = (time.perf_counter() - t0) * 1e3
    finally:
        for mod, attr, orig in saved:
            setattr(mod, attr, orig)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    labels = set(PROFILED.values())
    regions, ops = {}, []
    for e in prof.key_averages():
        if e.key in labels:
            regions[e.key] = {"count": e.count, "host_ms": e.cpu_time_total / 1e3}
            continue
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if dev_us and e.count and not e.key.startswith(("aten::", "cuda")):
            ops.append({"op": e.key[:70], "count": e.count, "device_ms": dev_us / 1e3})
    ops.sort(key=lambda o: -o["device_ms"])
    busy = sum(o["device_ms"] for o in ops)
    return {"wall_ms": wall, "device_busy_ms": busy, "regions": regions, "ops": ops[:16]}


def _row(
    mode: str, gpus: int, times: list[float], args: argparse.Namespace, dev: torch.device, identical: bool
) -> dict:
    med = statistics.median(times)
    return {
        "mode": mode,
        "gpus": gpus,
        "batch": args.batch,
        "k": args.k,
        "median_ms": med,
        "min_ms": min(times),
        "times_ms": times,
        "qps": args.batch / (med / 1e3),
        "peak_device_bytes_process0": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "identical_to_1_gpu": identical,
    }


def _streamed_row(
    gpus: int,
    times: list[float],
    args: argparse.Namespace,
    dev: torch.device,
    index: StreamedIndex,
    identical: bool,
    h2d: float | None,
) -> dict:
    row = _row("streamed", gpus, times, args, dev, identical)
    moved = index.nbytes  # process 0's bytes copied per batch (every piece, once)
    row |= {
        "pieces": len(index.pieces),
        "host_bytes": moved,
        "copy_rate_process0_bytes_per_s": moved / (row["median_ms"] / 1e3),
        "pinned_h2d_bytes_per_s": h2d,
    }
    return row


def _same(res: SearchResults, ref: SearchResults | None) -> bool:
    if ref is None:
        return False
    return torch.equal(res.ids, ref.ids) and res.scores.numpy().tobytes() == ref.scores.numpy().tobytes()


def _nbytes(index: Index) -> int:
    return sum(t.numel() * t.element_size() for t in index.arrays().values())


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def _h2d_rate(dev: torch.device, n_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Pinned host-to-device copy rate in bytes/s (median of ``reps`` copies of ``n_bytes``)."""
    src = torch.empty(n_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    rates = []
    for _ in range(reps + 1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        rates.append(n_bytes / (e0.elapsed_time(e1) / 1e3))
    return statistics.median(rates[1:])


def write(args: argparse.Namespace, env: dict, collection: dict, rows: list[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    card = str(env.get("card", "cpu")).replace("NVIDIA ", "").replace(" ", "-")
    path = args.out / f"{dt.date.today().isoformat()}-{card}x{env['world_size']}-{args.name}.json"
    data = {"env": env, "config": vars(args) | {"out": str(args.out)}, "targets": MSMARCO_TARGETS}
    data |= {"collection": collection, "rows": rows}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nwrote {path}\n")
    print(f"{args.docs:,} documents, batch {args.batch}, k = {args.k}, {env['card']} ({env['backend']})")
    head = f"{'mode':<12}{'GPUs':>5}{'ms/batch':>12}{'QPS':>10}{'vs 1 GPU':>10}{'identical':>11}"
    print(f"{head}{'pieces':>8}{'GB/s':>8}")
    base = rows[0]["median_ms"]
    for r in rows:
        per_batch = r.get("ms_per_batch", r["median_ms"])
        speedup = r.get(
            "speedup_vs_1_gpu", 1.0 if r["gpus"] == 1 and r["mode"] != "streamed" else base / r["median_ms"]
        )
        rate = r.get("copy_rate_process0_bytes_per_s")
        print(
            f"{r['mode']:<12}{r['gpus']:>5}{per_batch:>12.2f}{r['qps']:>10,.0f}{speedup:>9.2f}x"
            f"{r['identical_to_1_gpu']!s:>11}{r.get('pieces', ''):>8}{'' if rate is None else f'{rate / 1e9:.1f}':>8}"
        )
    for r in rows:
        for rank, p in enumerate(r.get("profile_per_process") or ([r["profile"]] if "profile" in r else [])):
            if p is None:
                continue
            print(f"profile, {r['gpus']} GPU(s), process {rank}: wall {p['wall_ms']:.2f} ms, device busy "
                  f"{p['device_busy_ms']:.2f} ms; host ms: "
                  + ", ".join(f"{k} {v['host_ms']:.2f}" for k, v in p["regions"].items()))  # fmt: skip
            for o in p["ops"][:8]:
                print(f"    {o['device_ms']:7.3f} ms x{o['count']:<3d} {o['op']}")
    for r in rows:
        if "host_launch_ms" in r:
            print(f"host launch of a batch (search, merge; GPU busy), {r['gpus']} GPU(s): {r['host_launch_ms']:.2f} ms")
    h2d = rows[-1].get("pinned_h2d_bytes_per_s")
    if h2d:
        print(f"pinned host-to-device copy rate: {h2d / 1e9:.1f} GB/s (GB/s above: process 0's streamed bytes / time)")
    print(
        f"1-GPU top-k equal to the reference kernel's on {collection.get('exact_sample')} queries: "
        f"{collection.get('exact_vs_reference')}"
    )


if __name__ == "__main__":
    main()
