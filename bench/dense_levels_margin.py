"""Issue 23, a CPU sketch: what would a float32 index lose by 8-bit dense rows searched with a margin?

The tiled layout stores a float32 index's dense (tile, term) rows as 4-byte slots. Stored as 8-bit levels
(a power-of-two step per layout), the kernel's dense sums would err by at most ``w_q · step / 2`` a
product; a margin ``delta = Σ_t w_q[t] · step_t / 2`` over the query's terms that are dense in some tile
keeps every document of the exact top-k among the candidates ``s' ≥ θ'_k − 2 delta`` (then rescored
exactly, as today). This counts those candidates on the calibrated synthetic collection, at the k that
matches k = 10 and 1,000 at 8.8M (the same quantile of the scores), with float64 scores by scipy.

    python bench/dense_levels_margin.py --n 400000 --queries 64 --out bench/results/FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpusparse.layout.tiled import dense_segments  # noqa: E402
from gpusparse.synthetic import generate  # noqa: E402

V = 30522
TILE_BITS, DENSE_MIN, FULL_N = 13, 0.12, 8_841_823


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=400_000)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    t0 = time.perf_counter()
    (di, dt, dw), (qi, qt, qw) = generate(args.n, args.queries, seed=0, device="cpu")
    di, dt, dw = di.numpy().astype(np.int64), dt.numpy().astype(np.int64), dw.numpy().astype(np.float64)
    docs = sp.csr_matrix((dw, dt, di), shape=(args.n, V))
    q = sp.csr_matrix((qw.numpy().astype(np.float64), qt.numpy(), qi.numpy()), shape=(args.queries, V))
    exact = (q @ docs.T).toarray()
    tile = np.repeat(np.arange(args.n), np.diff(di)) >> TILE_BITS
    key = tile * V + dt
    counts = torch.from_numpy(np.bincount(key, minlength=(int(tile.max()) + 1) * V))
    dense = dense_segments(counts, V, TILE_BITS, DENSE_MIN).numpy()[key]  # the layout's own rule
    b = np.floor(np.log2(255.0 / dw.max()))  # one power-of-two step for the layout: max level <= 255
    step = 2.0**-b
    w = dw.copy()
    w[dense] = np.round(dw[dense] / step) * step
    approx = (q @ sp.csr_matrix((w, dt, di), shape=(args.n, V)).T).toarray()
    term_step = np.zeros(V)
    term_step[np.unique(dt[dense])] = step
    delta = np.asarray(q @ (term_step / 2)).ravel()
    assert (np.abs(approx - exact).max(1) <= delta + 1e-9).all(), "the margin bounds the error"
    rows = []
    for k_full in (10, 1000):
        k = max(1, round(k_full * args.n / FULL_N))
        th = -np.sort(-approx, 1)[:, k - 1]
        cand = (approx >= (th - 2 * delta)[:, None]).sum(1) / k
        rows.append({"k_at_8.8M": k_full, "k": k, "delta_median": float(np.median(delta)),
                     "theta_median": float(np.median(th)), "candidates_over_k_median": float(np.median(cand)),
                     "candidates_over_k_p90": float(np.percentile(cand, 90)),
                     "candidates_over_k_max": float(cand.max())})  # fmt: skip
    out = {"command": "python bench/dense_levels_margin.py " + " ".join(sys.argv[1:]), "commit": args.commit,
           "date": time.strftime("%Y-%m-%d"), "card": "cpu", "n_docs": args.n, "queries": args.queries,
           "dense_share_of_postings": float(dense.mean()), "step": step, "seconds": time.perf_counter() - t0,
           "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(out, indent=2))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
