"""Issue 18 at scale: a calibrated collection of ``--docs`` documents (100M on one H200)
streamed into the tiled layout, searched, and checked on sampled queries.

Never holds the collection whole: the calibrated generator's chunks
(:class:`gpusparse.synthetic_stream.SyntheticStream`, ``--chunk-docs`` documents each, drawn
on the device) are built into the layout two passes over the chunks
(:func:`gpusparse.layout.chunked.build_tiled_chunks`: count, then build and append), and the
index is the layout and its statistics alone (:class:`gpusparse.layout.layout_only.LayoutOnly`),
searched by :func:`gpusparse.search.search` with the tiled engine. Nothing of the size of the
postings is on the host.

Reports: generate + build time (documents/s), resident bytes over every allocator after the
build (PyTorch allocated / reserved, CuPy's pool, the device's used memory from
``mem_get_info``), the peaks of the build and of the search, the search of one batch of
``--batch`` queries at ``-k`` host to host (median ms of ``--reps`` after a warm-up, QPS), and
the exactness of the first ``--sample`` queries against an exact float64 reference that draws
the chunks again (:func:`gpusparse.engines.chunk_reference.chunk_reference_search`): ids and
scores equal. The card, commit and command go into ``--out``; a short table is printed last.

    python bench/scale.py --docs 100000000 --weights float32 --out bench/results/<date>-H200-scale-100M-float32.json
    python bench/scale.py --docs 100000000 --weights uint8 --out bench/results/<date>-H200-scale-100M-uint8.json
    python bench/scale.py --docs 3000 --vocab 3000 --device cpu --batch 8 -k 100 --sample 4 --reps 1  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9


def _memory(dev) -> dict:
    """Bytes held now and the peaks since the last reset, over every allocator (bench/gpu_peaks.py)."""
    from gpu_peaks import gpu_memory

    out = gpu_memory(dev) or {}
    if out:  # this script's names: all_allocators is what is held, peak_all_allocators the peak
        out["peak_all_allocators"], out["all_allocators"] = out.pop("all_allocators"), out.pop("held_all_allocators")
    return out


def run(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from gpusparse import SparseCollection, Vocabulary
    from gpusparse.engines.chunk_reference import chunk_reference_search
    from gpusparse.layout.chunked import build_tiled_chunks
    from gpusparse.layout.layout_only import LayoutOnly, engine_layout
    from gpusparse.quantize import Quantization, power_of_two_step, quantize_queries
    from gpusparse.queries import query_batch
    from gpusparse.search import search
    from gpusparse.synthetic import SyntheticSpec
    from gpusparse.synthetic_stream import SyntheticStream

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    spec = SyntheticSpec() if args.vocab is None else SyntheticSpec().with_vocabulary(args.vocab)
    stream = SyntheticStream(args.docs, spec=spec, seed=args.seed, chunk_docs=args.chunk_docs, device=dev,
                             rows_per_step=args.rows_per_step)  # fmt: skip
    quant = Quantization(8, power_of_two_step(stream.spec.weight_max, 8)) if args.weights == "uint8" else None
    tile_bits, dense_min, fixed = engine_layout(args.docs, quant is not None)
    if args.chunk_docs % (1 << tile_bits):
        raise SystemExit(f"--chunk-docs must be a multiple of the tile, {1 << tile_bits} documents")
    t_start = time.perf_counter()
    passes: dict[str, float] = {}

    def progress(name: str, i: int, done: int) -> None:
        passes[name] = time.perf_counter() - t_start
        if i % args.print_every == 0 or done == args.docs:
            mem = f"  allocated {torch.cuda.memory_allocated(dev) / GB:6.1f} GB" if cuda else ""
            print(f"{time.perf_counter() - t_start:8.1f} s  {name:5} chunk {i + 1:4}/{stream.n_chunks}  "
                  f"{done / 1e6:8.2f}M docs{mem}", flush=True)  # fmt: skip

    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    layout, stats = build_tiled_chunks(lambda: iter(stream), args.docs, stream.n_terms, tile_bits=tile_bits,
                                       dense_min=dense_min, quantization=quant, fixed=fixed, device=dev,
                                       progress=progress)  # fmt: skip
    index = LayoutOnly(layout, stats, dense_min=dense_min, quantization=quant)
    sync()
    build_s = time.perf_counter() - t_start
    after_build = _memory(dev)
    print(f"{build_s:8.1f} s  built: {stats.n_postings:,} postings, layout {layout.nbytes / GB:.2f} GB "
          f"({layout.offs.numel():,} sparse, {layout.n_dense:,} dense rows)", flush=True)  # fmt: skip

    qi, qt, qw = (x.cpu().numpy() for x in stream.queries(args.batch))
    queries = SparseCollection(qi, qt, qw, vocab=Vocabulary.integer(stream.n_terms))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    first = search(index, queries, args.k, kernel="tiled", batch_size=args.batch)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        res = search(index, queries, args.k, kernel="tiled", batch_size=args.batch)
        times.append((time.perf_counter() - t0) * 1e3)
        if not (torch.equal(res.ids, first.ids) and torch.equal(res.scores, first.scores)):
            raise RuntimeError("a repeated search returned other results")
    after_search = _memory(dev)
    median_ms = statistics.median(times) if times else first_s * 1e3
    print(f"{time.perf_counter() - t_start:8.1f} s  searched: {median_ms:.1f} ms a batch of {args.batch} "
          f"({args.batch / median_ms * 1e3:,.0f} QPS), first {first_s:.2f} s", flush=True)  # fmt: skip
    shape = {
        "tile_bits": tile_bits,
        "dense_min": dense_min,
        "fixed_point": fixed,
        "chunk_docs": args.chunk_docs,
        "tiles": layout.n_tiles,
        "sparse_postings": layout.offs.numel(),
        "dense_rows": layout.n_dense,
        "packed": layout.packed,  # 5-byte sparse postings (float32 weights whose exponents allow it)
    }
    resident = {"layout": layout.nbytes, "index": index.derived.device_bytes() + sum(
        t.numel() * t.element_size() for t in index.arrays().values())}  # fmt: skip
    del index, layout
    if cuda:
        torch.cuda.empty_cache()

    # the exact reference: the chunks drawn again, the sampled queries scored in float64
    n = min(args.sample, args.batch)
    t0 = time.perf_counter()
    sample = queries[0:n]
    sample = quantize_queries(sample, quant.bits) if quant is not None else sample
    ref_s, ref_i = chunk_reference_search(iter(stream), query_batch(sample, dev), args.k, stream.n_terms,
                                          quantization=quant)  # fmt: skip
    ref_s, ref_i = ref_s.cpu(), ref_i.cpu()
    reference_s = time.perf_counter() - t0
    width = min(args.k, first.ids.shape[1], ref_i.shape[1])
    ids_ok = (first.ids[:n, :width] == ref_i[:, :width]).all(1)
    scores_ok = (first.scores[:n, :width] == ref_s[:, :width]).all(1)
    exact = {"sampled": n, "rows_equal": int((ids_ok & scores_ok).sum()), "ids_equal": int(ids_ok.sum()),
             "scores_equal": int(scores_ok.sum()), "reference_s": reference_s,
             "mismatched_rows": np.nonzero(~(ids_ok & scores_ok).numpy())[0].tolist()}  # fmt: skip
    print(f"{time.perf_counter() - t_start:8.1f} s  reference: {exact['rows_equal']}/{n} sampled queries equal "
          f"({reference_s:.1f} s)", flush=True)  # fmt: skip
    return {
        "docs": args.docs, "postings": stats.n_postings, "weights": args.weights, "batch": args.batch, "k": args.k,
        "layout": shape,
        "build": {"count_pass_s": passes.get("count"), "total_s": build_s, "docs_per_s": args.docs / build_s},
        "resident": resident, "memory_after_build": after_build, "memory_after_search": after_search,
        "search": {"first_s": first_s, "ms": times, "median_ms": median_ms, "qps": args.batch / median_ms * 1e3},
        "exact": exact,
    }  # fmt: skip


def _git_head() -> str | None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return head.stdout.strip() or None


def table(out: dict) -> str:
    """The run in a few lines."""
    r, m = out["result"], out["result"]["memory_after_build"]
    lines = [
        f"{'docs':>12} {'weights':>8} {'build s':>8} {'docs/s':>10} {'layout GB':>10} {'resident GB':>12} "
        f"{'peak GB':>8} {'ms/batch':>9} {'QPS':>8} {'exact':>7}",
        f"{r['docs']:>12,} {r['weights']:>8} {r['build']['total_s']:>8.1f} {r['build']['docs_per_s']:>10,.0f} "
        f"{r['resident']['layout'] / GB:>10.2f} {m.get('all_allocators', 0) / GB:>12.2f} "
        f"{max(m.get('peak_all_allocators', 0), r['memory_after_search'].get('peak_all_allocators', 0)) / GB:>8.2f} "
        f"{r['search']['median_ms']:>9.1f} {r['search']['qps']:>8,.0f} "
        f"{r['exact']['rows_equal']:>3}/{r['exact']['sampled']:<3}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=100_000_000)
    p.add_argument("--weights", choices=["float32", "uint8"], default="float32")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("-k", type=int, default=1000)
    p.add_argument("--sample", type=int, default=32, help="queries checked against the exact reference")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-docs", type=int, default=1 << 20, help="documents a chunk (a multiple of the tile)")
    p.add_argument("--rows-per-step", type=int, default=1 << 18, help="documents the generator samples at a time")
    p.add_argument("--print-every", type=int, default=8, help="a progress line every this many chunks")
    p.add_argument("--vocab", type=int, help="terms of the model (default: BERT's 30,522; smaller for a quick run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    dev = torch.device(args.device)
    result = run(args)
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "commit": os.environ.get("GIT_COMMIT") or _git_head(),
        "command": " ".join(["python", "bench/scale.py", *(argv if argv is not None else sys.argv[1:])]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "result": result,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return out


if __name__ == "__main__":
    main()
