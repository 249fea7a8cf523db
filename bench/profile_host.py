"""Where the host time of a small tiled search goes (Python functions, device syncs).

Usage (GPU machine): python bench/profile_host.py [--n-docs 1000000] [--batch 1] [--k 10]
Prints the search's median wall time, then cProfile's top functions by own time and by
cumulative time over 50 searches.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.synthetic import generate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n-docs", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--quantize", type=int, default=0)
    p.add_argument("--fixed", type=int, default=None, help="override EngineConfig.fixed_point (0 or 1)")
    p.add_argument("--no-profile", action="store_true", help="timings only")
    args = p.parse_args()
    if args.fixed is not None:
        from gpusparse.config import override_config

        override_config(fixed_point=bool(args.fixed)).__enter__()  # for the whole script
    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n_docs, args.batch, seed=0, device="cuda")
    index = Index.from_csr(di, dt_, dw, vocab, device="cuda", quantize=args.quantize or None)
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    for _ in range(5):
        index.search(queries, args.k)
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        index.search(queries, args.k)
        times.append((time.perf_counter() - t0) * 1e3)
    print(
        f"N={args.n_docs:,} B={args.batch} k={args.k} q{args.quantize} fixed={args.fixed}: "
        f"median {statistics.median(times):.3f} ms"
    )
    if args.no_profile:
        return
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        index.search(queries, args.k)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
