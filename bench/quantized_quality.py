"""How 8-bit impacts change the ranking: float32 vs quantized index on real vectors.

Usage: python bench/quantized_quality.py --collection NAME CORPUS QUERIES QRELS [...] --output FILE.json
(CORPUS / QUERIES: JsonVectorCollection files, e.g. from ``gpusparse pipeline --save-vectors``.)

For each collection: the metrics of both runs (ir_measures through gpusparse.evaluate), the
overlap of the quantized top-k with the float32 top-k, how many weights quantization
dropped, and a check that the quantized run is exact for the quantized vectors.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse import Index, Vocabulary, read_vectors
from gpusparse.evaluate import evaluate
from gpusparse.quantize import quantize_collection, quantize_queries

MEASURES = "RR@10,nDCG@10,R@100,R@1000"


def run_dict(index: Index, queries, res) -> dict[str, dict[str, float]]:
    out = {}
    for i, qid in enumerate(queries.ids):
        pairs = zip(res.ids[i].tolist(), res.scores[i].tolist(), strict=True)
        out[qid] = {index.ids[d]: float(s) for d, s in pairs if d >= 0}
    return out


def overlap(a, b, k: int) -> float:
    """Mean |top-k(a) ∩ top-k(b)| / |top-k(b)| over queries with results."""
    shares = []
    for x, y in zip(a.ids[:, :k].tolist(), b.ids[:, :k].tolist(), strict=True):
        ys = {d for d in y if d >= 0}
        if ys:
            shares.append(len(ys & {d for d in x if d >= 0}) / len(ys))
    return float(np.mean(shares)) if shares else 1.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--collection", nargs=4, action="append", metavar=("NAME", "CORPUS", "QUERIES", "QRELS"))
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args()
    vocab = Vocabulary.bert()
    out = {}
    for name, corpus, queries_path, qrels in args.collection:
        docs = read_vectors(corpus, vocab)
        queries = read_vectors(queries_path, vocab)
        flt = Index.build(docs)
        qnt = Index.build(docs, quantize=args.bits)
        _, report = quantize_collection(docs, args.bits)
        r_f = flt.search(queries, args.k)
        r_q = qnt.search(queries, args.k)
        # exact for the quantized vectors: the float64 reference path on the same quantized inputs
        ref = qnt.search(quantize_queries(queries, args.bits), args.k, kernel="reference")
        m_f = evaluate(run_dict(flt, queries, r_f), qrels, MEASURES).values
        m_q = evaluate(run_dict(qnt, queries, r_q), qrels, MEASURES).values
        out[name] = {
            "docs": len(docs),
            "queries": len(queries),
            "step": report.quantization.step,
            "weights": report.n_weights,
            "weights_dropped": report.n_dropped,
            "float32": m_f,
            f"q{args.bits}": m_q,
            "overlap_at_10": overlap(r_q, r_f, 10),
            "overlap_at_100": overlap(r_q, r_f, 100),
            f"overlap_at_{args.k}": overlap(r_q, r_f, args.k),
            "quantized_run_exact": bool((r_q.ids == ref.ids).all() and (r_q.scores == ref.scores).all()),
        }
        print(name, json.dumps(out[name]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {
        "date": dt.date.today().isoformat(),
        "git_commit": commit,
        "command": "python bench/quantized_quality.py " + " ".join(sys.argv[1:]),
        "measures": MEASURES,
        "bits": args.bits,
    }
    args.output.write_text(json.dumps({"env": env, "results": out}, indent=2))
    print("| collection | weights dropped | float32 RR@10 / nDCG@10 / R@1000 | q8 | overlap@10 / @1000 |")
    for name, r in out.items():
        f, q = r["float32"], r[f"q{args.bits}"]
        print(
            f"| {name} | {r['weights_dropped'] / r['weights']:.2%} | {f['RR@10']:.4f} / {f['nDCG@10']:.4f} / "
            f"{f['R@1000']:.4f} | {q['RR@10']:.4f} / {q['nDCG@10']:.4f} / {q['R@1000']:.4f} | "
            f"{r['overlap_at_10']:.3f} / {r[f'overlap_at_{args.k}']:.3f} |"
        )


if __name__ == "__main__":
    main()
