"""The tiled engine's work per (query, tile) under document orders (issue 23), on the CPU.

The kernel pays per (query, tile) for each query term: a dense row when the term's postings
cover at least ``dense_min`` of the tile (the layout's rule), else one shared-memory atomic a
posting. This counts both, per block, for the collection order, a random order and the
cluster order of :func:`gpusparse.layout.order.cluster_order` (without its sample tiles:
``--sample`` adds the engine's order, sample tiles and all), on encoded vectors of real text
(``--docs``/``--queries``: ``.npz`` CSR files of scipy or of ``bench/block_max.py``'s cache,
e.g. its wordnet vectors) or on the calibrated synthetic generator (``--synthetic N``).

    python bench/doc_order_cost.py --docs D.npz --queries Q.npz [--queries Q2.npz] --out R.json
    python bench/doc_order_cost.py --synthetic 1048576 --out R.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from block_max import _load as load_block_max_cache
from gpusparse.layout.order import cluster_order
from gpusparse.layout.tiled import dense_segments


def block_work(docs: sp.csr_matrix, queries: sp.csr_matrix, perm: np.ndarray, tile_bits: int, dense_min: float) -> dict:
    """Dense rows and sparse postings per (query, tile) block with documents in ``perm``'s
    order (``perm[i]``: the document at position ``i``)."""
    n, v = docs.shape
    pos = np.empty(n, np.int64)
    pos[perm] = np.arange(n)
    tiles = (n + (1 << tile_bits) - 1) >> tile_bits
    tile = np.repeat(pos >> tile_bits, np.diff(docs.indptr))
    counts = np.bincount(tile * v + docs.indices, minlength=tiles * v).reshape(tiles, v)
    dense = dense_segments(torch.from_numpy(counts).view(-1), v, tile_bits, dense_min).numpy().reshape(tiles, v)
    readers = np.bincount(queries.indices[queries.indices < v], minlength=v)  # queries reading each term
    blocks = tiles * queries.shape[0]
    rows = float((dense.sum(0) * readers).sum())
    sparse = float(((counts * ~dense).sum(0) * readers).sum())
    return {"dense_rows_per_block": rows / blocks, "sparse_postings_per_block": sparse / blocks, "tiles": int(tiles)}


def load_csr(path: Path) -> sp.csr_matrix:
    """A CSR matrix from ``scipy.sparse.save_npz`` or from ``bench/block_max.py``'s cache
    (arrays ``indptr``, ``indices``, ``data``, ``shape``)."""
    if "format" in np.load(path).files:  # scipy's own
        return sp.load_npz(path).tocsr()
    return load_block_max_cache(path)


def orders(docs: sp.csr_matrix, clusters: list[int], tile_bits: int, sample: bool, seed: int) -> dict[str, np.ndarray]:
    n = docs.shape[0]
    out = {"collection": np.arange(n), "random": np.random.default_rng(seed).permutation(n)}
    csr = (torch.from_numpy(docs.indptr.astype(np.int64)), torch.from_numpy(docs.indices.astype(np.int32)),
           torch.from_numpy(docs.data.astype(np.float32)))  # fmt: skip
    for c in clusters:
        t0 = time.perf_counter()
        # tile_bits 62: no tile of the order's own (no sample tiles, no interleaving): the groups alone
        out[f"cluster {c}"] = cluster_order(csr, docs.shape[1], clusters=c, tile_bits=62).numpy()
        print(f"cluster {c}: {time.perf_counter() - t0:.1f} s", flush=True)
        if sample:
            out[f"cluster {c}, engine order"] = cluster_order(
                csr, docs.shape[1], clusters=c, tile_bits=tile_bits
            ).numpy()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=Path)
    p.add_argument("--queries", type=Path, nargs="*", default=[])
    p.add_argument("--synthetic", type=int, default=0, help="documents of the calibrated generator (256 queries)")
    p.add_argument("--tile-bits", type=int, nargs="+", default=[11, 13])
    p.add_argument("--dense-min", type=float, default=0.12)
    p.add_argument("--clusters", type=int, nargs="+", default=[16])
    p.add_argument("--sample", action="store_true", help="also the engine's order (sample tiles first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.synthetic:
        from gpusparse.synthetic import generate

        (di, dt, dw), (qi, qt, qw) = generate(args.synthetic, 256, seed=args.seed)
        v = 30522
        docs = sp.csr_matrix((dw.numpy(), dt.numpy(), di.numpy()), shape=(args.synthetic, v))
        qsets = {"synthetic": sp.csr_matrix((qw.numpy(), qt.numpy(), qi.numpy()), shape=(len(qi) - 1, v))}
    else:
        docs = load_csr(args.docs)
        qsets = {q.stem: load_csr(q) for q in args.queries}
    docs.sort_indices()
    report = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "n_docs": docs.shape[0], "postings": int(docs.nnz), "dense_min": args.dense_min, "rows": []}  # fmt: skip
    for bits in args.tile_bits:
        for name, perm in orders(docs, args.clusters, bits, args.sample, args.seed).items():
            for qname, q in qsets.items():
                row = {
                    "tile_bits": bits,
                    "order": name,
                    "queries": qname,
                    **block_work(docs, q, perm, bits, args.dense_min),
                }
                report["rows"].append(row)
    base = {(r["tile_bits"], r["queries"]): r for r in report["rows"] if r["order"] == "collection"}
    for r in report["rows"]:
        b = base[(r["tile_bits"], r["queries"])]
        r["rows_vs_collection"] = r["dense_rows_per_block"] / max(b["dense_rows_per_block"], 1e-12)
        r["postings_vs_collection"] = r["sparse_postings_per_block"] / max(b["sparse_postings_per_block"], 1e-12)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'bits':>4} {'queries':10} {'order':26} {'rows/block':>10} {'x':>6} {'sparse/block':>12} {'x':>6}")
    for r in report["rows"]:
        rows, sparse = r["dense_rows_per_block"], r["sparse_postings_per_block"]
        print(f"{r['tile_bits']:>4} {r['queries']:10} {r['order']:26} {rows:10.2f} {r['rows_vs_collection']:6.2f} "
              f"{sparse:12.0f} {r['postings_vs_collection']:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
