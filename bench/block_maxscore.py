"""Could a (query, tile) block stop before its low-bound terms? (issue 23), CPU.

MaxScore at the granularity of the tiled engine's block. A block of a later wave knows its
threshold θ before it sums. Split the query's terms in the tile into E (kept) and N (the
terms with the smallest bounds ``b_t = w_q[t] · max_{d ∈ tile} w_d[t]``, while their sum
``B_N`` stays within ``α · θ``). The block adds E's postings first; if then every document's
sum ``s_E[d]`` satisfies ``s_E[d] + B_N < θ``, no document of the tile can reach θ and the
block stops: N's postings are never read. Exact: the full sum is at most ``s_E[d] + B_N``.

Counted over the big wave's blocks (tiles after the first 68, θ the k-th score of those 68:
what the engine's big wave starts from at batch 256 and k = 10), for each α and two forms:
``sparse`` (only sparse segments may go to N; dense rows stay in E, summed first as today) and
``mixed`` (a dense row may go to N too; then the dense phase runs after the check):

* the share of blocks that stop early;
* the share of the sparse postings they leave unread (of all the big wave's sparse postings);
* the share of dense rows they leave unread, and of blocks with dense rows that read none.

The collection is the calibrated synthetic one in the engine's cluster order (tiles of 2**13
documents), the dense rule the 8-bit layout's (a (tile, term) with at least 12 % of the tile's
documents is a dense row). Weights are float32 (the 8-bit layout's levels would move bounds
and sums by their rounding only).

    python bench/block_maxscore.py --docs 1048576 --out bench/results/NAME.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TILE_BITS = 13
FIRST_TILES = 68  # waves of 4 and 64 tiles at batch 256 and k < 256 (gpusparse.engines.tiled.waves)
DENSE_MIN = 0.12  # the 8-bit layout's default (gpusparse.layout.tiled.DEFAULT_LAYOUT)


def split_n(bounds: np.ndarray, eligible: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """N per tile: ``bounds`` ``[n_tiles, n_terms]`` (0 where the term is absent), ``eligible``
    the (tile, term) pairs that may go to N, ``budget`` ``[n_tiles]``. The eligible present terms
    in ascending bound order, as long as their running sum stays at or below the budget."""
    present = (bounds > 0) & eligible
    key = np.where(present, bounds, np.inf)
    order = np.argsort(key, axis=1, kind="stable")
    ranked = np.take_along_axis(key, order, axis=1)
    csum = np.cumsum(np.where(np.isfinite(ranked), ranked, 0.0), axis=1)
    take = np.isfinite(ranked) & (csum <= budget[:, None])
    # a prefix: once a term does not fit, no later (larger) one is taken
    take &= np.cumprod(take, axis=1).astype(bool)
    out = np.zeros_like(present)
    np.put_along_axis(out, order, take, axis=1)
    return out


def query_blocks(
    cols: list[tuple[np.ndarray, np.ndarray]],
    n_docs: int,
    k: int,
    alphas: list[float],
    tile_bits: int = TILE_BITS,
    first_tiles: int = FIRST_TILES,
    dense_min: float = DENSE_MIN,
) -> dict:
    """The counts for one query. ``cols``: per query term, (positions in the layout's order,
    ascending; contributions ``w_q · w_d``). Returns per (form, α) the sums over the big wave's
    blocks (tiles from ``first_tiles`` on; θ the ``k``-th score of the tiles before), and the
    block totals; ``{}`` when the first tiles hold fewer than ``k`` matches."""
    n_tiles = -(-n_docs // (1 << tile_bits))
    nt = len(cols)
    bounds = np.zeros((n_tiles, nt))
    counts = np.zeros((n_tiles, nt), dtype=np.int64)
    for j, (pos, val) in enumerate(cols):
        if len(pos) == 0:
            continue
        tile = pos >> tile_bits
        starts = np.flatnonzero(np.concatenate([[True], tile[1:] != tile[:-1]]))
        bounds[tile[starts], j] = np.maximum.reduceat(val, starts)
        counts[tile[starts], j] = np.diff(np.concatenate([starts, [len(tile)]]))
    dense = counts >= max(1, int(dense_min * (1 << tile_bits)))
    full = np.zeros(n_docs)
    for pos, val in cols:
        if len(pos):
            full += np.bincount(pos, weights=val, minlength=n_docs)
    first = full[: min(n_docs, first_tiles << tile_bits)]
    first = first[first > 0]
    if len(first) < k:
        return {}
    theta = float(np.partition(first, len(first) - k)[len(first) - k])
    big = np.arange(n_tiles) >= first_tiles
    live = big & (counts.sum(axis=1) > 0)
    sparse_post = np.where(dense, 0, counts)
    out = {
        "blocks": int(live.sum()),
        "sparse_postings": int(sparse_post[live].sum()),
        "dense_rows": int(dense[live].sum()),
        "blocks_with_dense": int((dense[live].sum(axis=1) > 0).sum()),
        "forms": {},
    }
    pad = n_tiles * (1 << tile_bits) - n_docs
    for form in ("sparse", "mixed"):
        eligible = ~dense if form == "sparse" else np.ones_like(dense)
        for alpha in alphas:
            n_mask = split_n(bounds, eligible, np.full(n_tiles, alpha * theta))
            b_n = np.where(n_mask, bounds, 0.0).sum(axis=1)
            s_e = np.zeros(n_docs)
            for j, (pos, val) in enumerate(cols):
                keep = ~n_mask[pos >> tile_bits, j]
                if keep.any():
                    s_e += np.bincount(pos[keep], weights=val[keep], minlength=n_docs)
            max_e = np.pad(s_e, (0, pad)).reshape(n_tiles, -1).max(axis=1)
            stop = live & (max_e + b_n < theta)
            dn = n_mask & dense
            has_rows = dense.sum(axis=1) > 0
            out["forms"][f"{form}@{alpha}"] = {
                "stop_blocks": int(stop.sum()),
                "sparse_postings_unread": int(np.where(n_mask & ~dense, counts, 0)[stop].sum()),
                "n_sparse_postings": int(np.where(n_mask & ~dense, counts, 0)[live].sum()),
                "dense_rows_unread": int(dn[stop].sum()),
                "dense_blocks_reading_none": int((stop & has_rows & (dn.sum(axis=1) == dense.sum(axis=1))).sum()),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    from sub_tile_bounds import collection_parser, ordered_collection, run_header

    p = collection_parser(__doc__)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9, 1.0])
    args = p.parse_args(argv)
    t0 = time.time()
    docs, queries, perm = ordered_collection(args.docs, args.queries, args.seed)
    # rows in the layout's order (perm[i]: the document at position i), then by term
    docs = docs[perm].tocsc()
    docs.sort_indices()
    timing = {"generate_and_order_s": time.time() - t0}
    totals: dict = {}
    for q in range(args.queries):
        row = queries[q]
        cols = []
        for t, w in zip(row.indices, row.data, strict=True):
            a, b = docs.indptr[t], docs.indptr[t + 1]
            cols.append((docs.indices[a:b].astype(np.int64), float(w) * docs.data[a:b].astype(np.float64)))
        rec = query_blocks(cols, args.docs, args.k, args.alphas)
        for key, v in rec.items():
            if key == "forms":
                for f, d in v.items():
                    tf = totals.setdefault("forms", {}).setdefault(f, {})
                    for kk, vv in d.items():
                        tf[kk] = tf.get(kk, 0) + vv
            else:
                totals[key] = totals.get(key, 0) + v
    timing["total_s"] = time.time() - t0
    shares = {}
    for f, d in totals["forms"].items():
        shares[f] = {
            "blocks_stopping": d["stop_blocks"] / totals["blocks"],
            "sparse_postings_unread": d["sparse_postings_unread"] / totals["sparse_postings"],
            "sparse_postings_in_n": d["n_sparse_postings"] / totals["sparse_postings"],
            "dense_rows_unread": d["dense_rows_unread"] / max(1, totals["dense_rows"]),
            "dense_blocks_reading_no_row": d["dense_blocks_reading_none"] / max(1, totals["blocks_with_dense"]),
        }
    out = {
        **run_header(__doc__, "bench/block_maxscore.py", argv),
        "docs": args.docs,
        "queries": args.queries,
        "k": args.k,
        "timing": timing,
        "totals": totals,
        "shares": shares,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"blocks {totals['blocks']}, sparse postings {totals['sparse_postings']}, dense rows {totals['dense_rows']}")
    print(f"{'form@alpha':>12} {'stop':>6} {'sparse unread':>13} {'in N':>6} {'dense unread':>12} {'no row':>7}")
    for f, s in shares.items():
        print(
            f"{f:>12} {s['blocks_stopping']:6.1%} {s['sparse_postings_unread']:13.1%} {s['sparse_postings_in_n']:6.1%}"
            f" {s['dense_rows_unread']:12.1%} {s['dense_blocks_reading_no_row']:7.1%}"
        )


if __name__ == "__main__":
    main()
