"""Could a (query, tile) block of the tiled engine skip parts of its tile? (issue 23), CPU.

The goal's collection is the calibrated synthetic one, searched in the engine's cluster order
(:func:`gpusparse.layout.order.cluster_order`, tiles of 2**13 documents). For sub-blocks of
``2**b`` consecutive documents of that order and each query, the bound
``UB = Σ_t w_q[t] · max_{d ∈ sub-block} w_d[t]`` is at least every score there; a sub-block
whose bound is below θ holds no result. θ is either the exact k-th score ("final", the best
case) or the k-th score of the first 68 tiles ("first waves": what the engine's big wave starts
from at batch 256 and k = 10, after waves of 4 and 64 tiles).

Counted per (query, sub-block): the share of touched pairs that prune and of the query's
postings in them (a dense term's postings included: its row's slice there would be skipped
too); and the cost side, the bounds such a block would read: one a (sub-block, query term)
present there (stored sparse), against the postings it reads, per (query, tile) block.

    python bench/sub_tile_bounds.py --docs 1048576 --out bench/results/NAME.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from block_max import kth_score, tile_bounds, tile_maxima, tile_work
from gpusparse.layout.order import cluster_order
from gpusparse.synthetic import SyntheticSpec, generate

TILE_BITS = 13
FIRST_TILES = 68  # waves of 4 and 64 tiles at batch 256 and k < 256 (gpusparse.engines.tiled.waves)


def run_header(doc: str, script: str, argv: list[str] | None) -> dict:
    """What a CPU run's result file opens with: what it measures (``doc``'s first line), the
    command, the commit, the machine and the date."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "what": doc.split("\n")[0],
        "command": f"python {script} " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": head,
        "machine": f"CPU dev box ({platform.processor() or platform.machine()}, 2 shared cores)",
        "date": time.strftime("%Y-%m-%d"),
    }


def thresholds(docs: sp.csr_matrix, queries: sp.csr_matrix, first: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(final, first_waves)`` θ per query: the exact ``k``-th score over every document (float64)
    and over the documents ``first`` only."""
    final, early = np.zeros(queries.shape[0]), np.zeros(queries.shape[0])
    dt = docs.T.tocsr().astype(np.float64)
    for a in range(0, queries.shape[0], 32):
        s = (queries[a : a + 32].astype(np.float64) @ dt).toarray()
        for i in range(s.shape[0]):
            final[a + i] = kth_score(s[i][s[i] > 0], k)
            early[a + i] = kth_score(s[i][first][s[i][first] > 0], k)
    return final, early


def block_record(
    queries: sp.csr_matrix, docs: sp.csr_matrix, perm: np.ndarray, bits: int, theta: dict, tile_bits: int = TILE_BITS
) -> dict:
    """The shares for sub-blocks of ``2**bits`` documents (see the module's docstring), for each
    θ of ``theta`` (name: float64 ``[n_queries]``); bounds and postings per (query, tile) block
    counted over the blocks that read any posting."""
    bmax, count = tile_maxima(docs, perm, bits)
    ub = tile_bounds(queries, bmax)
    work = tile_work(queries, count)
    present = bmax.copy()
    present.data = np.ones_like(present.data)
    entries = tile_work(queries, present)  # (sub-block, query term) pairs present: bounds to read
    per_tile = 1 << (tile_bits - bits)
    n_tiles = -(-work.shape[1] // per_tile)
    pad = n_tiles * per_tile - work.shape[1]

    def by_tile(x: np.ndarray) -> np.ndarray:
        return np.pad(x, ((0, 0), (0, pad))).reshape(x.shape[0], n_tiles, per_tile).sum(axis=2)

    blocks_live = by_tile(work) > 0
    rec = {
        "block_bits": bits,
        "blocks": int(work.shape[1]),
        "postings_per_tile_block": float(by_tile(work)[blocks_live].mean()),
        "bounds_per_tile_block": float(by_tile(entries)[blocks_live].mean()),
        "theta": {},
    }
    touched = work > 0
    for name, th in theta.items():
        pruned = (ub < th[:, None]) & touched
        rec["theta"][name] = {
            "pairs": float(pruned.sum() / touched.sum()),
            "postings": float(work[pruned].sum() / work.sum()),
            "bound_over_theta_p50": float(np.median(ub[touched] / np.repeat(th, touched.sum(axis=1)))),
        }
    return rec


def collection_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a run over the calibrated collection: ``--docs --queries --k --seed --out``."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--docs", type=int, default=1 << 20)
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p


def ordered_collection(n_docs: int, n_queries: int, seed: int) -> tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]:
    """``(docs, queries, perm)``: the calibrated collection as CSR and the engine's cluster order
    of its documents (``perm[i]``: the document at position ``i``; tiles of 2**13)."""
    spec = SyntheticSpec()
    (di, dt, dw), (qi, qt, qw) = generate(n_docs, n_queries, spec=spec, seed=seed)
    docs = sp.csr_matrix((dw.numpy(), dt.numpy(), di.numpy()), shape=(n_docs, spec.n_terms))
    queries = sp.csr_matrix((qw.numpy(), qt.numpy(), qi.numpy()), shape=(n_queries, spec.n_terms))
    perm = cluster_order((di, dt, dw), spec.n_terms, tile_bits=TILE_BITS).numpy()
    return docs, queries, perm


def main(argv: list[str] | None = None) -> None:
    p = collection_parser(__doc__)
    p.add_argument("--bits", type=int, nargs="+", default=[6, 8, 10, 13])
    args = p.parse_args(argv)
    t0 = time.time()
    docs, queries, perm = ordered_collection(args.docs, args.queries, args.seed)
    timing = {"generate_and_order_s": time.time() - t0}
    final, early = thresholds(docs, queries, perm[: FIRST_TILES << TILE_BITS], args.k)
    timing["thresholds_s"] = time.time() - t0
    theta = {"final": final, "first_waves": early}
    records = []
    for bits in args.bits:
        records.append(block_record(queries, docs, perm, bits, theta))
        print(json.dumps(records[-1]), flush=True)
    timing["total_s"] = time.time() - t0
    out = {
        **run_header(__doc__, "bench/sub_tile_bounds.py", argv),
        "docs": args.docs,
        "queries": args.queries,
        "k": args.k,
        "postings": int(docs.nnz),
        "theta_median": {"final": float(np.median(final)), "first_waves": float(np.median(early))},
        "timing": timing,
        "records": records,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'block':>6} {'bounds/blk':>10} {'postings/blk':>12}  final: pairs postings   first waves: pairs postings")
    for r in records:
        f, e = r["theta"]["final"], r["theta"]["first_waves"]
        print(
            f"{1 << r['block_bits']:6d} {r['bounds_per_tile_block']:10.0f} {r['postings_per_tile_block']:12.0f}"
            f"  {f['pairs']:11.1%} {f['postings']:8.1%}   {e['pairs']:17.1%} {e['postings']:8.1%}"
        )


if __name__ == "__main__":
    main()
