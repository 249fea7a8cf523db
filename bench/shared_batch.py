"""One block per document chunk for the whole batch (issue 23, fifth session): a prototype, measured
beside the engine's 8-bit search in the same run.

Usage (GPU machine, ~3 minutes at 8.8M):
    python bench/shared_batch.py --out $OUT --commit SHA [--n 8841823] [--batch 256] [--chunk 128]
CPU statistics only (small n): python bench/shared_batch.py --device cpu --n 100000 --out DIR

It generates the calibrated synthetic collection (gpusparse.synthetic.generate, seed 0), its 8-bit
levels (gpusparse.quantize, as ``Index.from_csr(..., quantize=8)``), the chunk layout
(bench/shared_batch_ops.py; bytes and build time), and prints the statistics that predict the
kernels' cost (pairs, runs, mean m). On a GPU it then times, median of ``--reps`` after warm-up by
CUDA events, the kernels of bench/shared_batch.cu ("flat": pairs split evenly over a block's threads;
"warp": a warp per run): accumulate only (per-query maxima, no emission), and with emission at the
**oracle** threshold for each k (the exact k-th score, read off the engine's own exact search: so the
timing is accumulation + emission at the final threshold, with no waves or running threshold); and the
engine's 8-bit search at the same batch (``Index.search`` host to host, ``tiled_search`` on a laid-out
batch, and its ``tiled_candidates`` kernels' device time by torch.profiler). Exactness: every query's
maximum against the engine's top-1, and for 8 sampled queries the candidate sets and values at each
threshold, and every non-zero sum (a launch for those 8 queries with theta = 1), against an int64
scatter-add over the whole collection. GPU bytes over every allocator go in the JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import shared_batch_ops as ops  # noqa: E402
from gpusparse import Index, SparseCollection, Vocabulary  # noqa: E402
from gpusparse.synthetic import generate  # noqa: E402

STAT_CHUNKS = 4000  # statistics over the first chunks (per-chunk figures do not depend on N)
SAMPLED = 8


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _events_ms(fn, reps: int, warmup: int = 2) -> list[float]:
    from kernels import time_events  # bench/kernels.py

    return time_events(fn, reps=reps, warmup=warmup)


def engine_rows(index: Index, queries: SparseCollection, ks: list[int], reps: int) -> tuple[list[dict], dict]:
    """The engine's 8-bit search of the batch: host to host, the device search, its kernels' time;
    and the results of each k (the oracle)."""
    from gpusparse.engines.tiled.engine import tiled_search
    from gpusparse.layout.statistics import max_scores_host
    from gpusparse.queries import prepare_queries, query_batch
    from search_timing import timed_search

    idx = index.resident_on(index.device)
    batch = query_batch(prepare_queries(queries, idx.vocab, idx.quantization, max_scores_host(idx)), idx.device)
    rows, results = [], {}
    for k in ks:
        timing = timed_search(index, queries, k, len(queries), reps)
        results[k] = index.search(queries, k)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tiled_search(idx, batch, k).resolved()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        search = functools.partial(tiled_search, idx, batch, k)
        rows.append({"what": "engine 8-bit", "k": k, "h2h_ms": timing["median_ms"],
                     "engine_ms": statistics.median(times), "engine": timing["engine"],
                     "engine_kernel_ms": _tiled_kernel_ms(lambda search=search: search().resolved())})  # fmt: skip
    return rows, results


def _tiled_kernel_ms(fn) -> float | None:
    """Device ms of the ``tiled_candidates`` kernels in one call of ``fn`` (torch.profiler)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        total = sum(e.device_time_total for e in prof.key_averages() if "tiled_candidates" in e.key)
        return total / 1e3 if total else None
    except Exception as e:  # the profiler is an aid here, not the measurement
        print(f"profiler: {e}", flush=True)
        return None


def oracle_thetas(results, steps: np.ndarray, step: float, k: int) -> np.ndarray:
    """int32 ``[B]``: the k-th score of the engine's exact 8-bit result as the integer sum
    (score / (query step · index step), exact: both powers of two); 1 where fewer than k match."""
    kth = results.scores[:, k - 1].to(torch.float64).numpy()
    ints = kth / (steps * step)
    ok = np.isfinite(ints) & (ints > 0)
    theta = np.where(ok, ints, 1.0)
    if not np.array_equal(theta, np.round(theta)):
        raise RuntimeError("the engine's k-th scores are not integer multiples of the two steps")
    return theta.astype(np.int32)


def check_exact(
    layout,
    bt,
    csr,
    v,
    thetas: dict,
    qmax_engine: np.ndarray,
    sampled: list[int],
    dev,
    variants=("flat", "warp"),
    **launch,
) -> dict:
    """Exactness of the kernels (``variants``) against an int64 scatter-add over the whole collection."""
    import shared_batch_cuda as cuda

    ref = ops.reference_scores(*csr, bt, v, queries=sampled)
    report = {"sampled_queries": sampled}
    for variant in variants:
        out = cuda.Outputs.allocate(bt.n_queries, 1, dev)
        cuda.run(variant, layout, bt, torch.zeros(bt.n_queries, dtype=torch.int32, device=dev), out, emit=False,
                 **launch)  # fmt: skip
        qmax = out.qmax.cpu().numpy()
        ref_max = ref.max(1).values.cpu().numpy()
        ok = {"qmax_all_equal_engine_top1": bool(np.array_equal(qmax, qmax_engine)),
              "qmax_sampled_equal_reference": bool(np.array_equal(qmax[sampled], ref_max))}  # fmt: skip
        for k, theta in thetas.items():
            # room for the sampled queries' candidates (8-bit sums tie often, and the oracle theta is
            # the float32 k-th score's integer: a query may have many more than k candidates); other
            # queries may overflow, which is counted, not judged (only the sampled ones are checked)
            cap = int(max(k, (ref >= torch.from_numpy(theta[sampled]).to(dev)[:, None]).sum(1).max())) + 16
            out = cuda.Outputs.allocate(bt.n_queries, cap, dev)
            cuda.run(variant, layout, bt, torch.from_numpy(theta).to(dev), out, **launch)
            report.setdefault("overflowing_queries", {}).setdefault(variant, {})[f"k{k}"] = int(
                (out.overflow() > 0).sum()
            )
            good = True
            for i, q in enumerate(sampled):
                r = ref[i].cpu().numpy()
                want = np.flatnonzero(r >= theta[q])
                doc, val = out.candidates(q)
                good &= bool(np.array_equal(doc, want) and np.array_equal(val, r[want]))
            ok[f"candidates_k{k}_sampled_exact"] = good
        # every non-zero sum of the sampled queries: a batch of those queries alone, theta 1
        sub = _sub_batch(bt, sampled, dev)
        out = cuda.Outputs.allocate(len(sampled), layout.n_docs, dev, poison=True)
        cuda.run(variant, layout, sub, torch.ones(len(sampled), dtype=torch.int32, device=dev), out, **launch)
        good = int(out.overflow().sum()) == 0
        for i in range(len(sampled)):
            r = ref[i].cpu().numpy()
            want = np.flatnonzero(r > 0)
            doc, val = out.candidates(i)
            good &= bool(np.array_equal(doc, want) and np.array_equal(val, r[want]))
        ok["all_sums_sampled_exact"] = good
        del out
        report[variant] = ok
    return report


def _sub_batch(bt, rows: list[int], dev):
    """The batch of queries ``rows`` alone (as :func:`ops.batch_terms` builds it)."""
    ql = bt.qlist.to(torch.int64).cpu().numpy() & 0xFFFF
    tm = bt.tmap.to(torch.int64).cpu().numpy()
    terms = np.flatnonzero(tm >= 0)
    term_of_pair = np.repeat(terms, np.diff(bt.qptr.cpu().numpy())[tm[terms]])
    qs, levs = ql >> 8, ql & 0xFF
    ind, lev, indptr = [], [], [0]
    for q in rows:
        sel = qs == q
        order = np.argsort(term_of_pair[sel])
        ind.append(term_of_pair[sel][order])
        lev.append(levs[sel][order])
        indptr.append(indptr[-1] + int(sel.sum()))
    return ops.batch_terms(np.array(indptr), np.concatenate(ind), np.concatenate(lev), len(tm), dev)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8_841_823)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--chunk", type=int, nargs="+", default=[128], help="documents a chunk (several: one layout each)")
    p.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1024)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--no-engine", action="store_true", help="skip the engine's search (oracle from the reference)")
    p.add_argument(
        "--sparse-only",
        type=float,
        default=None,
        metavar="DENSE_MIN",
        help="drop the postings the tiled layout (8K tiles) keeps in dense rows at this dense_min: "
        "the chunks hold what a kernel with a tensor-core dense part adds one at a time (the "
        "engine still runs on the whole collection, for its timing; the oracle is the reference)",
    )
    p.add_argument("--variants", nargs="+", default=["flat", "warp"], choices=["flat", "warp"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    dev = torch.device(args.device)
    vocab = Vocabulary.bert()
    v = len(vocab)
    res: dict = {"n_docs": args.n, "batch": args.batch, "chunks": args.chunk, "threads": args.threads,
                 "commit": args.commit, "command": "python bench/shared_batch.py " + " ".join(sys.argv[1:]),
                 "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                 "card": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "theta": "oracle: the exact k-th score of each query (from the engine's exact 8-bit search); "
                          "kernel timings are accumulation + emission at the final threshold, no waves",
                 "rows": [], "layouts": []}  # fmt: skip
    t0 = time.perf_counter()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n, args.batch, seed=0, device=dev)
    _sync(dev)
    res["generate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    csr, step = ops.doc_levels(di, dt_, dw)
    del di, dt_, dw
    _sync(dev)
    res["levels_s"] = time.perf_counter() - t0
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    bt = ops.batch_terms(*ops.query_levels(queries), v, dev)
    res["batch_pairs"], res["batch_terms"] = bt.n_pairs, int(bt.qptr.numel() - 1)
    print(f"batch: {bt.n_pairs} (query, term) pairs over {res['batch_terms']} terms", flush=True)
    if dev.type == "cpu":
        if args.sparse_only is not None:
            csr, res["sparse_only"] = ops.sparse_only(*csr, v, dense_min=args.sparse_only)
        for chunk in args.chunk:
            layout = _layout(res, csr, v, chunk, dev)
            _statistics(res["layouts"][-1], layout, bt, args.threads * 4)
        _write(args, res)
        return

    import cupy

    import shared_batch_cuda as cuda
    from gpu_peaks import gpu_memory

    props = torch.cuda.get_device_properties(dev)
    res["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "cupy": cupy.__version__,
                  "multiprocessors": props.multi_processor_count, "smem_optin": cuda.smem_limit(dev)}  # fmt: skip
    steps = ops.power_of_two_steps(_row_max(queries), 8)
    rng = np.random.default_rng(0)
    sampled = sorted(rng.choice(args.batch, size=min(SAMPLED, args.batch), replace=False).tolist())
    li, lt, ll = csr
    if not args.no_engine:
        index = Index.from_csr(li, lt, ll.to(torch.float32) * step, vocab, device=dev, quantize=8)
        if index.quantization.step != step:
            raise RuntimeError("the index's step is not the levels' step")
        res["rows"], results = engine_rows(index, queries, args.ks, args.reps)
        thetas = {k: oracle_thetas(results[k], steps, step, k) for k in args.ks}
        qmax_engine = oracle_thetas(index.search(queries, 1), steps, step, 1)
        res["gpu_memory_with_engine"] = gpu_memory(dev)
        del index, results
        torch.cuda.empty_cache()
    if args.sparse_only is not None:
        csr, res["sparse_only"] = ops.sparse_only(li, lt, ll, v, dense_min=args.sparse_only)
        li, lt, ll = csr
        print("sparse only:", json.dumps(res["sparse_only"]), flush=True)
    if args.no_engine or args.sparse_only is not None:
        res["theta"] = (
            "oracle: the exact k-th score of each query from the reference (int64 scatter-add over "
            "the chunks' postings); kernel timings: accumulation + emission at the final threshold"
        )
        ref = ops.reference_scores(li, lt, ll, bt, v)
        thetas = {k: ops.oracle_theta(ref, k).to(torch.int32).cpu().numpy() for k in args.ks}
        qmax_engine = ref.max(1).values.to(torch.int32).cpu().numpy()
        del ref
    for chunk in args.chunk:
        try:
            items = cuda.choose_items(args.batch, chunk, args.threads, bt.n_pairs, cuda.smem_limit(dev))
        except ValueError as e:
            print(f"chunk {chunk}: skipped ({e})", flush=True)
            res["layouts"].append({"chunk": chunk, "skipped": str(e)})
            continue
        layout = _layout(res, csr, v, chunk, dev)
        info = res["layouts"][-1]
        info["items"] = items
        info["smem_bytes"] = cuda.smem_bytes(args.batch, chunk, args.threads, items, bt.n_pairs)
        _statistics(info, layout, bt, args.threads * items)
        info["exact"] = check_exact(
            layout, bt, csr, v, thetas, qmax_engine, sampled, dev, threads=args.threads, variants=args.variants
        )
        print(f"chunk {chunk}: exact", json.dumps(info["exact"]), flush=True)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        info["gpu_memory_before_kernels"] = gpu_memory(dev)  # its peak: since this point
        res["rows"] += time_kernels(layout, bt, thetas, args.reps, args.threads, max(args.ks) * 4 + 1024, args.variants)
        info["gpu_memory_kernels"] = gpu_memory(dev)
        del layout
        torch.cuda.empty_cache()
    res["gpu_memory"] = gpu_memory(dev)
    _write(args, res)


def time_kernels(layout, bt, thetas: dict, reps: int, threads: int, cap: int, variants=("flat", "warp")) -> list[dict]:
    """CUDA-event milliseconds (median of ``reps`` after warm-up) of each kernel: accumulate only
    (per-query maxima, no emission), and with emission at each oracle theta."""
    import shared_batch_cuda as cuda

    dev = layout.post.device
    out = cuda.Outputs.allocate(bt.n_queries, cap, dev)
    zeros = torch.zeros(bt.n_queries, dtype=torch.int32, device=dev)
    rows = []
    for variant in variants:
        ms = _events_ms(lambda variant=variant: cuda.run(variant, layout, bt, zeros, out, emit=False, threads=threads),
                        reps)  # fmt: skip
        rows.append({"what": f"kernel {variant}", "chunk": layout.chunk, "k": None, "emit": False,
                     "kernel_ms": statistics.median(ms), "kernel_ms_all": ms})  # fmt: skip
        for k, theta in thetas.items():
            th = torch.from_numpy(theta).to(dev)
            ms = _events_ms(lambda variant=variant, th=th: cuda.run(variant, layout, bt, th, out, threads=threads),
                            reps)  # fmt: skip
            rows.append({"what": f"kernel {variant}", "chunk": layout.chunk, "k": k, "emit": True,
                         "kernel_ms": statistics.median(ms), "kernel_ms_all": ms,
                         "candidates_mean": float(out.count.double().mean()),
                         "overflow": int(out.overflow().sum())})  # fmt: skip
        print(json.dumps(rows[-1 - len(thetas) :]), flush=True)
    return rows


def _layout(res: dict, csr, v: int, chunk: int, dev: torch.device):
    """The chunk layout of ``csr`` (its bytes and build time appended to ``res["layouts"]``)."""
    _sync(dev)
    t0 = time.perf_counter()
    layout = ops.chunk_layout(*csr, v, chunk)
    _sync(dev)
    res["layouts"].append({"chunk": chunk, "build_s": time.perf_counter() - t0, "bytes": layout.nbytes})
    print(f"chunk {chunk}: layout {layout.nbytes / 2**30:.2f} GiB, built in {res['layouts'][-1]['build_s']:.2f} s",
          flush=True)  # fmt: skip
    return layout


def _statistics(info: dict, layout, bt, window: int) -> None:
    """:func:`ops.chunk_statistics` over the first chunks into ``info``, printed."""
    stats = ops.chunk_statistics(layout.head(STAT_CHUNKS), bt, window=window)
    stats["over_first_chunks"] = min(STAT_CHUNKS, layout.n_chunks)
    info["statistics"] = stats
    names = ("postings_per_chunk", "batch_postings_per_chunk", "pairs_per_chunk", "runs_per_chunk")
    means = ", ".join(f"{n} {stats[n]['mean']:.0f}" for n in names)
    print(f"chunk {layout.chunk}, per chunk (first chunks): {means}" +
        f"; mean m {stats['mean_m_posting_weighted']:.2f}, pairs with m>=32 {stats['share_pairs_m_ge_32']:.3f}, "
        f"warp lane efficiency {stats['warp_lane_efficiency']:.3f}", flush=True)  # fmt: skip


def _row_max(queries: SparseCollection) -> np.ndarray:
    vals = queries.values.astype(np.float64)
    lens = np.diff(queries.indptr)
    out = np.zeros(len(queries))
    out[lens > 0] = np.maximum.reduceat(vals, queries.indptr[:-1][lens > 0])
    return out


def _write(args, res: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    card = res["card"].replace("NVIDIA ", "").replace(" ", "-")
    path = args.out / f"{dt.date.today().isoformat()}-{card}-shared-batch.json"
    path.write_text(json.dumps(res, indent=2))
    print(f"wrote {path}")
    print(f"{'what':16} {'chunk':>5} {'k':>5} {'kernel ms':>10} {'engine ms':>10} {'h2h ms':>10} {'tiled kern':>10}")
    for r in res.get("rows", []):
        cols = [r.get(c) for c in ("kernel_ms", "engine_ms", "h2h_ms", "engine_kernel_ms")]
        print(f"{r['what']:16} {r.get('chunk', '-')!s:>5} {r['k'] if r.get('emit', True) else 'acc'!s:>5} " + " ".join(
            f"{c:10.3f}" if isinstance(c, float) else f"{'-':>10}" for c in cols))  # fmt: skip


if __name__ == "__main__":
    main()
