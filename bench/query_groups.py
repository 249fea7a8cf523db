"""How much of a batch's posting reads a block of G queries could share (issue 23), on the CPU.

Usage: python bench/query_groups.py [--n-docs 100000] [--out FILE]

For a calibrated synthetic collection (gpusparse.synthetic) and a batch of 256 queries, the
postings a group of G queries reads together (the union of their terms, each term's sparse
postings counted by its document frequency; dense rows counted by term) against the sum over
its queries: what one load per posting per group would save against one per (query,
posting). Groups: consecutive queries (random order) and greedy groups by shared postings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse.synthetic import generate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n-docs", type=int, default=100_000)
    p.add_argument("--dense-min", type=float, default=0.12)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    (_, t, _), (qip, qt, _) = generate(args.n_docs, 256, seed=1)
    df = torch.bincount(t.long(), minlength=30522).double() / args.n_docs
    dense = df >= args.dense_min
    sets = [qt[qip[i] : qip[i + 1]].long() for i in range(256)]

    def cost(groups):
        tot = union = dense_sum = dense_union = 0.0
        for g in groups:
            for s in (sets[i] for i in g):
                tot += float(df[s][~dense[s]].sum())
                dense_sum += float(dense[s].sum())
            u = torch.unique(torch.cat([sets[i] for i in g]))
            union += float(df[u][~dense[u]].sum())
            dense_union += float(dense[u].sum())
        return union / tot, dense_union / dense_sum

    vec = torch.zeros(256, 30522, dtype=torch.float64)
    for i, s in enumerate(sets):
        vec[i, s] = df[s] * (~dense[s])
    shared = vec @ (vec > 0).double().T  # sparse postings two queries both read (per document)
    rng = np.random.default_rng(0)
    rows = []
    for g in (2, 4, 8, 16):
        perm = rng.permutation(256)
        random_groups = [perm[i : i + g] for i in range(0, 256, g)]
        left, greedy = set(range(256)), []
        while left:
            grp = [left.pop()]
            while len(grp) < g and left:
                best = max(left, key=lambda j: float(shared[grp, j].sum()))
                grp.append(best)
                left.remove(best)
            greedy.append(grp)
        r, gr = cost(random_groups), cost(greedy)
        rows.append({"group": g, "random_sparse": r[0], "random_dense": r[1], "greedy_sparse": gr[0],
                     "greedy_dense": gr[1]})  # fmt: skip
        print(f"G={g:2d}: union/sum of sparse postings random {r[0]:.3f} greedy {gr[0]:.3f}; "
              f"dense rows random {r[1]:.3f} greedy {gr[1]:.3f}", flush=True)  # fmt: skip
    whole = cost([list(range(256))])
    print(f"whole batch: sparse {whole[0]:.3f}, dense {whole[1]:.3f}")
    out = {"n_docs": args.n_docs, "dense_min": args.dense_min, "rows": rows, "whole_batch_sparse": whole[0],
           "whole_batch_dense": whole[1], "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
