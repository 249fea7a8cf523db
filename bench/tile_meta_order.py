"""``tile_meta`` from term-major copies of the layout's segment starts and row ids (probe, GPU).

Usage (GPU machine):
    python bench/tile_meta_order.py --out $OUT --commit SHA [--n 8841823] [--batch 256] [--k 10] [--reps 30]

A META search's ``tile_meta`` (``kernels/cuda/tile_candidates.cu``) gives each (query, tile) block
its record: one warp a query walks eight consecutive tiles and, for each, gathers the query's
terms' segment bounds from ``seg`` ([tile][term]) and some row ids from ``dense_id``. Nsight
Compute found its loads using 4.7 of the 32 bytes of each sector they move (16th session). The
variant (:func:`term_major_variant`: the package's ``tile_meta`` with its loads' indexing changed)
reads copies stored term-major ([term][tile]): a lane's eight tiles of one term then share one or
two sectors.

The script runs one 8-bit search (the anatomy's collection and queries) and, at each of its
``tile_meta`` launches, first launches both kernels on the same arguments into two poisoned
buffers of its own (their records must be equal, byte for byte), then times them alternating
(CUDA events, ``--reps`` each). Writes ``<out>/tile_meta_order.json``: per launch and in all, the
medians, whether the records are equal, the term-major copies' bytes, and GPU memory over every
allocator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_peaks import gpu_memory
from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.engines.tiled.engine import layout_for_search, tiled_search
from gpusparse.kernels import tile_candidates as tc
from gpusparse.kernels.cupy_launch import get_kernel, pointer, source
from gpusparse.layout.statistics import max_scores_host
from gpusparse.queries import prepare_queries, query_batch
from gpusparse.synthetic import generate

POISON = 0x5A5A5A5A
# tile_meta's text -> the variant's: the kernel's name, a last parameter (the layout's tiles, the
# copies' row length), and the segment bounds and row ids indexed [term][tile]
TERM_MAJOR = (
    ("void __launch_bounds__(128) tile_meta(", "void __launch_bounds__(128) tile_meta_tm("),
    ("uint2* __restrict__ rec)", "uint2* __restrict__ rec, const int NTT)"),
    ("        const int* seg_tile = seg + (i64)tile * (V + 1);\n", ""),
    ("start[c] = seg_tile[tc[c]];", "start[c] = seg[(i64)tc[c] * NTT + tile];"),
    ("end[c] = seg_tile[tc[c] + 1];", "end[c] = seg[(i64)(tc[c] + 1) * NTT + tile];"),
    ("const short* did_tile = dense_id + (i64)(tile0 + r) * V;", "const int tile = tile0 + r;"),
    ("did[c] = did_tile[tc[c]];", "did[c] = dense_id[(i64)tc[c] * NTT + tile];"),
)


def term_major_variant(text: str) -> str:
    """``tile_candidates.cu``'s text with ``tile_meta_tm`` appended: ``tile_meta`` reading ``seg``
    as ``[V + 1, NTT]`` and ``dense_id`` as ``[V, NTT]`` (the same records)."""
    kernel = text[text.index('extern "C" __global__ void __launch_bounds__(128) tile_meta(') :]
    kernel = kernel[: kernel.index("\n}\n") + 3]
    for old, new in TERM_MAJOR:
        if kernel.count(old) != 1:
            raise SystemExit(f"tile_meta changed: {old!r} is not in it once")
        kernel = kernel.replace(old, new)
    return text + "\n" + kernel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8_841_823)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()

    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n, args.batch, seed=0, device="cuda")
    index = Index.from_csr(di, dt_, dw, vocab, device="cuda", quantize=8)
    del di, dt_, dw
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    queries = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    batch = query_batch(queries, index.device)
    tl = layout_for_search(index)
    nt, v = tl.n_tiles, tl.n_terms
    seg_t = tl.seg.view(nt, v + 1).T.contiguous()  # [V + 1, n_tiles]
    did_t = tl.dense_id.view(nt, v).T.contiguous()  # [V, n_tiles]
    copy_bytes = seg_t.numel() * seg_t.element_size() + did_t.numel() * did_t.element_size()
    tail = term_major_variant(source(tc.SOURCE))

    builds: list[tuple] = []
    real_kernel, real_launch = tc._kernel, tc.launch

    def spy_kernel(build, device, variant, name="tiled_candidates"):
        if name == "tile_meta":
            builds.append(build)
        return real_kernel(build, device, variant, name)

    rows: list[dict] = []
    dev = torch.device("cuda", torch.cuda.current_device())

    def probe(kernel, grid, block, a) -> None:
        # a = (seg, tile_start, dense_id, q_terms, q_weights, q_scale, T, V, B, tile0, n, rec)
        t, b, n = int(a[6]), int(a[8]), int(a[10])
        k_tm = get_kernel(tail, "tile_meta_tm", options=tc.compile_options(*builds[-1]), device=dev.index)
        words = n * b * (t + 1) * 2
        rec_a = torch.full((words,), POISON, dtype=torch.int32, device=dev)
        rec_b = torch.full((words,), POISON, dtype=torch.int32, device=dev)
        args_a = (*a[:11], pointer(rec_a))
        args_b = (pointer(seg_t), a[1], pointer(did_t), *a[3:11], pointer(rec_b), np.int32(nt))
        real_launch(kernel, grid, block, args_a, device=dev)
        real_launch(k_tm, grid, block, args_b, device=dev)
        torch.cuda.synchronize()
        equal = torch.equal(rec_a, rec_b)
        times: dict[str, list[float]] = {"tile_major": [], "term_major": []}
        for _ in range(args.reps):
            for label, kern, kargs in (("tile_major", kernel, args_a), ("term_major", k_tm, args_b)):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                real_launch(kern, grid, block, kargs, device=dev)
                e1.record()
                e1.synchronize()
                times[label].append(e0.elapsed_time(e1))
        row = {"tile0": int(a[9]), "tiles": n, "queries": b, "width": t, "records_equal": equal}
        row.update({f"{k}_ms_median": statistics.median(x) for k, x in times.items()})
        row.update({f"{k}_ms_min": min(x) for k, x in times.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del rec_a, rec_b

    def spy_launch(kernel, grid, block, a, *, device, shared_mem=0):
        # tile_meta's launches: 12 arguments (tiled_candidates takes 30), not inside a capture
        if builds and len(a) == 12 and not torch.cuda.is_current_stream_capturing():
            probe(kernel, grid, block, a)
        return real_launch(kernel, grid, block, a, device=device, shared_mem=shared_mem)

    tc._kernel, tc.launch = spy_kernel, spy_launch
    try:
        tiled_search(index, batch, args.k).resolved()
    finally:
        tc._kernel, tc.launch = real_kernel, real_launch
    torch.cuda.synchronize()
    out = {
        "card": torch.cuda.get_device_name(0),
        "commit": args.commit,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "n_docs": args.n,
        "batch": args.batch,
        "k": args.k,
        "n_tiles": nt,
        "term_major_copy_bytes": copy_bytes,
        "launches": rows,
        "all_equal": all(r["records_equal"] for r in rows) and bool(rows),
        "tile_major_ms": sum(r["tile_major_ms_median"] for r in rows),
        "term_major_ms": sum(r["term_major_ms_median"] for r in rows),
        "gpu_memory": gpu_memory(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tile_meta_order.json").write_text(json.dumps(out, indent=1))
    print(
        f"tile_meta over {len(rows)} launches: tile-major {out['tile_major_ms']:.3f} ms, "
        f"term-major {out['term_major_ms']:.3f} ms; records equal: {out['all_equal']}; "
        f"copies {copy_bytes / 1e6:.0f} MB"
    )


if __name__ == "__main__":
    main()
