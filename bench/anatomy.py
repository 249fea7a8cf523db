"""Anatomy of one tiled search: the work per (query, tile) block, and every device operation's time.

Usage (GPU machine):
    python bench/anatomy.py --out $OUT --commit SHA [--n 8841823] [--batch 256] [--ks 10 1000]
Prints (and writes ``<out>/anatomy.json``):

* per-block work of the batch on the default layout: sparse postings, dense rows and their
  real postings per (query, tile), so a kernel time can be read per unit of work;
* per search: wall time, the device time of each operation (torch.profiler) and the gap
  between them (host work and syncs);
* GPU memory over every allocator (bench/gpu_peaks.py) at the end.

Under ``ncu`` give ``--ncu``: the script then only warms up and runs one search, whose third
wave (``--launch-skip 2 --launch-count 1 -k regex:tiled_candidates``) is the big one.

``--baseline old/rescore.cu ...`` times older kernel sources the same way: each is a ``.cu``
file named as the one of ``src/gpusparse/kernels/cuda/`` it replaces (e.g.
``git show SHA:src/gpusparse/kernels/cuda/rescore.cu > old/rescore.cu``; from a commit before
the sources were files, save the text of the module's ``CUDA_SOURCE`` string, and for
``tile_candidates.cu`` add the two typedefs that now open that file; a ``tile_candidates.cu``
from before ee74535 needs the trailing parameter ``const int* __restrict__ doc_of`` and a
``rescore.cu`` the ``t_pos_of`` one before ``keys``, which the launchers now pass). The searches
then compile it (:func:`gpusparse.kernels.cupy_launch.variant`) in place of the package's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from gpu_peaks import gpu_memory
from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.config import engine_config, override_config
from gpusparse.engines.tiled.engine import layout_for_search, tiled_search
from gpusparse.kernels import tile_candidates
from gpusparse.kernels.cupy_launch import source, variant
from gpusparse.layout.statistics import max_scores_host
from gpusparse.queries import prepare_queries, query_batch
from gpusparse.synthetic import generate


def block_work(tl, batch) -> dict[str, float]:
    """Mean work of a (query, tile) block: sparse postings, dense rows, real postings in those rows."""
    nt, v = tl.n_tiles, tl.n_terms
    terms = batch.padded_terms
    valid = terms >= 0
    tt = torch.where(valid, terms, 0).to(torch.int64)
    sparse = dense_rows = dense_real = 0.0
    real_per_row = (tl.dense != 0).sum(1) if tl.dense.numel() else torch.zeros(1, dtype=torch.int64)
    real_per_row = real_per_row.to(terms.device)
    for t0 in range(0, nt, 64):  # [tiles, B, T] at a time, bounded
        t1 = min(nt, t0 + 64)
        seg = tl.seg.view(nt, v + 1)[t0:t1]  # segment starts inside each tile
        seglen = seg[:, 1:] - seg[:, :-1]
        did = tl.dense_rows(torch.arange(t0 * v, t1 * v, device=tl.seg.device)).view(t1 - t0, v)[:, tt]
        sparse += float((seglen[:, tt] * valid).sum())
        isd = (did >= 0) & valid
        dense_rows += float(isd.sum())
        dense_real += float(torch.where(isd, real_per_row[did.clamp_min(0)], 0).sum())
    blocks = nt * terms.shape[0]
    return {
        "blocks": blocks,
        "sparse_postings_per_block": sparse / blocks,
        "dense_rows_per_block": dense_rows / blocks,
        "dense_real_postings_per_block": dense_real / blocks,
        "dense_slots_per_block": dense_rows * (1 << tl.tile_bits) / blocks,
    }


def device_ops(fn, sync, trace: Path | None = None) -> tuple[float, list[dict]]:
    """Device time of each operation of one call (torch.profiler), and the call's wall ms;
    ``trace``: also write the call's timeline there (Chrome trace format)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    ops = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if dev_us and e.count and not e.key.startswith("aten::") and not e.key.startswith("cuda"):
            ops.append({"op": e.key[:70], "count": e.count, "device_ms": dev_us / 1e3})
    ops.sort(key=lambda o: -o["device_ms"])
    return wall, ops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8_841_823)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--ncu", action="store_true", help="only warm up and search once (for ncu)")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--commit", default="unknown")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantize", type=int, default=0, help="8: an index of 8-bit impacts (queries prepared)")
    p.add_argument("--trace", action="store_true", help="write each profiled search's timeline (Chrome trace)")
    p.add_argument("--check", action="store_true", help="compare each search with the scatter kernel's")
    p.add_argument(
        "--doc-order", default=None, help="EngineConfig.doc_order for the searches (default: the configured)"
    )
    p.add_argument(
        "--baseline",
        nargs="*",
        default=[],
        help="older kernels/cuda/*.cu files (named as the file each replaces) to time the same way",
    )
    p.add_argument(
        "--meta-bytes",
        type=int,
        nargs="*",
        default=[],
        help="also time the current kernel with these META record budgets (bytes; 0: no records)",
    )
    p.add_argument(
        "--dense-min",
        type=float,
        nargs="*",
        default=[],
        help="also time the current kernel on layouts of these dense thresholds (EngineConfig.dense_min)",
    )
    args = p.parse_args()
    with override_config(doc_order=args.doc_order) if args.doc_order else contextlib.nullcontext():
        run(args)


def run(args) -> None:
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n, args.batch, seed=0, device=args.device)
    index = Index.from_csr(di, dt_, dw, vocab, device=args.device, quantize=args.quantize or None)
    del di, dt_, dw
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    if args.quantize:  # 8-bit query levels, as Index.search prepares them
        queries = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    batch = query_batch(queries, index.device)
    t0 = time.perf_counter()
    tl = layout_for_search(index)
    layout_s = time.perf_counter() - t0  # the layout's build (with the document order's clustering)
    if args.ncu:
        sync()
        tiled_search(index, batch, max(args.ks)).resolved()
        sync()
        return
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    out = {"card": card, "commit": args.commit, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
           "n_docs": args.n, "batch": args.batch, "doc_order": engine_config().doc_order,
           "layout_build_s": layout_s}  # fmt: skip
    out["layout"] = {
        "tile_bits": tl.tile_bits,
        "dense_rows": tl.dense.shape[0],
        "sparse_postings": tl.n_sparse,
        "packed": tl.packed,
        "ordered": tl.doc_of is not None,
    }
    out["work"] = block_work(tl, batch)
    print(json.dumps(out["layout"]), json.dumps(out["work"]), flush=True)
    # labelled by folder and name: two baselines of one source come from two folders
    sources = [("current", None)] + [(f"{Path(b).parent.name}/{Path(b).name}", Path(b)) for b in args.baseline]
    for path in [p for _, p in sources if p is not None]:
        source(path.name)  # refuses a name that is not a kernel source of the package
    for label, path in sources:
        # A baseline compiles from its file, same launcher, for this label's searches only. The
        # CUDA graphs captured for the label before are dropped: Index.search would replay their
        # kernels.
        index.derived.graphs.clear()
        scope = variant(path.name, code=path.read_text()) if path is not None else contextlib.nullcontext()
        with scope:
            measure(args, index, queries, batch, sync, out, label)
    for budget in args.meta_bytes:  # the record budget of the launches without selection
        index.derived.graphs.clear()
        saved, tile_candidates.META_MAX_BYTES = tile_candidates.META_MAX_BYTES, budget
        try:
            measure(args, index, queries, batch, sync, out, f"meta-{budget >> 20}MiB")
        finally:
            tile_candidates.META_MAX_BYTES = saved
    for dense_min in args.dense_min:  # another layout each (built on first use, kept by the index)
        index.derived.graphs.clear()
        with override_config(dense_min=dense_min):
            layout = layout_for_search(index)
            out[f"layout-dense-{dense_min}"] = {"dense_rows": layout.dense.shape[0], "sparse_postings": layout.n_sparse}
            measure(args, index, queries, batch, sync, out, f"dense-{dense_min}")
    out["gpu_memory"] = gpu_memory() if args.device == "cuda" else None  # over every allocator, at the end
    (args.out / "anatomy.json").write_text(json.dumps(out, indent=2))


def measure(args, index, queries, batch, sync, out: dict, label: str) -> None:
    """Time the searches at each k for one set of kernel sources; adds ``out[f"{label}-k{k}"]``."""
    for k in args.ks:
        exact = None
        if args.check:
            ref = index.search(queries, k, kernel="scatter" if args.device == "cuda" else "reference")
            s_, i_ = tiled_search(index, batch, k).resolved()
            exact = bool(torch.equal(i_.cpu(), ref.ids) and torch.equal(s_.cpu(), ref.scores))
        for _ in range(3):
            tiled_search(index, batch, k).resolved()
        walls = []
        for _ in range(10):
            sync()
            t0 = time.perf_counter()
            tiled_search(index, batch, k).resolved()
            sync()
            walls.append((time.perf_counter() - t0) * 1e3)
        trace = args.out / f"trace-{label}-k{k}.json" if args.trace else None
        h2h_by = {}  # the same batch host to host: Index.search (queries in, top-k back on the host)
        for pinned in (False, True):
            host = []
            with override_config(pinned_results=pinned):
                for rep in range(12):
                    sync()
                    t0 = time.perf_counter()
                    index.search(queries, k, batch_size=len(queries))
                    sync()
                    if rep >= 2:
                        host.append((time.perf_counter() - t0) * 1e3)
            h2h_by[pinned] = statistics.median(host)
        wall, ops = device_ops(lambda: tiled_search(index, batch, k).resolved(), sync, trace)  # noqa: B023
        busy = sum(o["device_ms"] for o in ops)
        med = statistics.median(walls)
        h2h = h2h_by[True]
        row = {"wall_ms_median": med, "index_search_ms_median": h2h, "profiled_wall_ms": wall, "exact": exact}
        row["index_search_ms_median_pageable_results"] = h2h_by[False]
        out[f"{label}-k{k}"] = {**row, "ops": ops}
        print(f"--- {label} k={k}: wall median {med:.2f} ms (exact {exact}), Index.search {h2h:.2f} ms "
              f"(pageable results {h2h_by[False]:.2f} ms); "
              f"profiled call {wall:.2f} ms, "
              f"device busy {busy:.2f} ms, idle {wall - busy:.2f} ms")  # fmt: skip
        for o in ops[:8]:
            print(f"  {o['device_ms']:8.3f} ms  x{o['count']:<4d} {o['op']}")


if __name__ == "__main__":
    main()
