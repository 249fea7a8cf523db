"""Search cost over several segments against one compacted segment (issue #9), on the CPU.

Builds one seeded synthetic SPLADE-like collection (``gpusparse.synthetic``), writes it as a
:class:`~gpusparse.segments.SegmentedIndex` of 1, 4 and 16 equal segments, then deletes a
share of the documents and compacts, and times ``search`` for each (median of ``--repeats``
calls after one warm-up) against a plain :class:`~gpusparse.Index` of the same documents.
Every configuration's results are checked to equal the plain index's (ids and scores).

Usage:
    python bench/segments.py [--docs 4096] [--queries 64] [--k 10,100] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.segments import SegmentedIndex
from gpusparse.synthetic import generate


def _collection(csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor], prefix: str) -> SparseCollection:
    indptr, terms, weights = (t.numpy() for t in csr)
    ids = [f"{prefix}{i}" for i in range(indptr.size - 1)]
    return SparseCollection(indptr, terms, weights, ids, Vocabulary.integer(30522))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--k", default="10,100")
    ap.add_argument("--delete", type=float, default=0.1, help="share of documents deleted before compacting")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    docs_csr, q_csr = generate(args.docs, args.queries, seed=args.seed)
    docs, qs = _collection(docs_csr, "d"), _collection(q_csr, "q")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        configs: list[tuple[str, SegmentedIndex | Index, list[str]]] = []
        plain = Index.build(docs)
        configs.append(("plain Index", plain, docs.ids))
        for n_seg in (1, 4, 16):
            seg = SegmentedIndex.create(Path(tmp) / f"s{n_seg}", docs.vocab)
            step = -(-len(docs) // n_seg)
            for a in range(0, len(docs), step):
                seg.add(docs[a : a + step])
            configs.append((f"{n_seg} segments", seg, docs.ids))
        gone = docs.ids[:: max(1, round(1 / args.delete))] if args.delete > 0 else []
        deleted = SegmentedIndex.load(Path(tmp) / "s16")
        deleted.delete(gone)
        survivors = [i for i in docs.ids if i not in set(gone)]
        configs.append((f"16 segments, {len(gone)} deleted", deleted, survivors))
        compacted = SegmentedIndex.load(Path(tmp) / "s16")
        compacted.compact()
        configs.append(("compacted (1 segment)", compacted, survivors))
        keep = [j for j, i in enumerate(docs.ids) if i not in set(gone)]
        mat = docs.to_scipy()[keep]
        fresh = Index.build(SparseCollection(mat.indptr, mat.indices, mat.data, survivors, docs.vocab))
        for k in ks:
            want_all, want_live = plain.search(qs, k), fresh.search(qs, k)
            times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
            for _ in range(args.repeats + 1):  # interleaved rounds: load from other jobs hits all alike
                for name, index, _ in configs:
                    t0 = time.perf_counter()
                    index.search(qs, k)
                    times[name].append(time.perf_counter() - t0)
            base = None
            for name, index, live in configs:
                res = index.search(qs, k)
                want, ref = (want_all, plain) if len(live) == len(docs) else (want_live, fresh)
                names = [[ref.ids[d] if d >= 0 else None for d in r] for r in want.ids.tolist()]
                got = (
                    res.ids
                    if isinstance(index, SegmentedIndex)
                    else [[ref.ids[d] if d >= 0 else None for d in r] for r in res.ids.tolist()]
                )
                same = got == names and bool((res.scores == want.scores).all())
                med, best = statistics.median(times[name][1:]), min(times[name][1:])
                base = base or med
                rows.append({"k": k, "config": name, "median_ms": med * 1e3, "min_ms": best * 1e3, "same": same})
                print(
                    f"k={k:<4} {name:<28} median {med * 1e3:7.1f} ms  min {best * 1e3:7.1f} ms  "
                    f"{med / base:5.2f}x plain  same results: {same}"
                )
    meta = {
        "docs": args.docs,
        "queries": args.queries,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    print(json.dumps(meta))
    if args.out:
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
