"""Compare GPUSparse's metrics with independent engines run on the same vectors.

Reads the vectors that ``gpusparse pipeline --save-vectors`` wrote (or any
JsonVectorCollection corpus/queries pair), searches them with

* **gpusparse**: exact float32 scores (the pipeline's run);
* **PISA** (``pyterrier-pisa``, ``ranked_or``: exhaustive, exact on its integer index).
  PISA stores integer impacts: ``pyterrier-pisa`` indexes ``int(100 · w)`` for each
  document weight and repeats each query term ``floor(100 · w)`` times, so its scores are
  ``Σ floor(100 w_q) · int(100 w_d)``. We also search those quantized vectors with
  GPUSparse and report how far PISA's run is from that exact answer;
* **Seismic** (``pyseismic-lsr``): ``SeismicDataset.search``, its exact brute force
  (no index, no approximation) over its in-memory dataset;

and scores every run with ``gpusparse.evaluate`` (ir_measures). Engines that are not
installed are reported as such. This is a comparison script, not part of the package:

    pip install pyterrier-pisa pyseismic-lsr     # needs Java 17 for python-terrier
    python scripts/compare_engines.py pipeline-cranfield/vectors ../shared/data/cranfield/qrels/test.tsv \\
        --name cranfield --output cranfield-engines.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from gpusparse import Index, SparseCollection, read_vectors
from gpusparse.evaluate import evaluate
from gpusparse.verify import verify_run

Run = dict[str, list[tuple[str, float]]]


def gpusparse_run(docs: SparseCollection, queries: SparseCollection, k: int) -> Run:
    index = Index.build(docs)
    return index.retrieve(queries, k)


def quantize(coll: SparseCollection, how: Callable[[np.ndarray], np.ndarray]) -> SparseCollection:
    """``how(100 · w)`` for every weight (zeros dropped by the collection)."""
    values = how(coll.values.astype(np.float64) * 100.0).astype(np.float32)
    # Copies: the constructor canonicalises (drops zeros) in place on the arrays it is given.
    return SparseCollection(coll.indptr.copy(), coll.indices.copy(), values, ids=coll.ids, vocab=coll.vocab)


def toks(coll: SparseCollection, i: int) -> dict[str, float]:
    return coll.row(i)


def pisa_run(docs: SparseCollection, queries: SparseCollection, k: int, workdir: Path) -> Run:
    import pandas as pd
    from pyterrier_pisa import PisaIndex

    index = PisaIndex(str(workdir / "pisa"), stemmer="none", stops="none", overwrite=True)
    index.toks_indexer().index({"docno": docs.ids[i], "toks": toks(docs, i)} for i in range(len(docs)))
    retriever = index.quantized(num_results=k, query_algorithm="ranked_or")
    frame = pd.DataFrame(
        [{"qid": queries.ids[i], "query_toks": toks(queries, i)} for i in range(len(queries)) if queries.row(i)]
    )
    res = retriever(frame)
    run: Run = {q: [] for q in queries.ids}
    for qid, docno, score in zip(res["qid"], res["docno"], res["score"], strict=True):
        run[str(qid)].append((str(docno), float(score)))
    return run


def seismic_run(docs: SparseCollection, queries: SparseCollection, k: int) -> Run:
    from seismic import SeismicDataset, get_seismic_string

    st = get_seismic_string()
    data = SeismicDataset()
    for i in range(len(docs)):
        v = docs.row(i)
        if v:  # Seismic refuses empty vectors; an empty document matches nothing anyway
            data.add_document(docs.ids[i], np.array(list(v), dtype=st), np.array(list(v.values()), dtype=np.float32))
    run: Run = {}
    for i, qid in enumerate(queries.ids):
        v = queries.row(i)
        if not v:
            run[qid] = []
            continue
        hits = data.search(qid, np.array(list(v), dtype=st), np.array(list(v.values()), dtype=np.float32), k)
        run[qid] = [(str(doc), float(score)) for _, score, doc in hits]
    return run


def as_dict(run: Run) -> dict[str, dict[str, float]]:
    return {q: dict(rows) for q, rows in run.items()}


def max_score_diff(run: Run, exact: Run) -> float:
    """Largest |score - exact score| over documents both runs return for a query."""
    worst = 0.0
    for q, rows in run.items():
        ref = dict(exact.get(q, []))
        for d, s in rows:
            if d in ref:
                worst = max(worst, abs(s - ref[d]))
    return worst


def pkg(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vectors", type=Path, help="folder with corpus.jsonl.gz and queries.jsonl.gz")
    parser.add_argument("qrels", type=Path)
    parser.add_argument("--name", help="collection name for the report")
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--measures", default="nDCG@10 RR@10 R@1000")
    parser.add_argument("--engines", default="gpusparse,pisa,seismic")
    parser.add_argument("--output", type=Path, help="JSON report to write")
    args = parser.parse_args()

    docs = read_vectors(args.vectors / "corpus.jsonl.gz", progress=False)
    queries = read_vectors(args.vectors / "queries.jsonl.gz", docs.vocab, progress=False)
    engines = args.engines.split(",")
    report: dict[str, Any] = {
        "collection": args.name or args.vectors.name,
        "documents": len(docs),
        "queries": len(queries),
        "k": args.k,
        "measures": args.measures.split(),
        "versions": {
            "python": platform.python_version(),
            **{p: pkg(p) for p in ("gpusparse", "ir_measures", "pyterrier-pisa", "python-terrier", "pyseismic-lsr")},
        },
        "engines": {},
    }
    runs: dict[str, Run] = {}
    t0 = time.perf_counter()
    runs["gpusparse"] = gpusparse_run(docs, queries, args.k)
    timings = {"gpusparse": time.perf_counter() - t0}

    qdocs = quantize(docs, np.trunc)  # PISA: int(100 w) for documents
    qqueries = quantize(queries, np.floor)  # and floor(100 w) repetitions for queries
    if "pisa" in engines:
        workdir = Path(tempfile.mkdtemp(prefix="compare-engines-"))
        try:
            t0 = time.perf_counter()
            runs["pisa"] = pisa_run(docs, queries, args.k, workdir)
            timings["pisa"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            runs["gpusparse (PISA-quantized vectors)"] = gpusparse_run(qdocs, qqueries, args.k)
            timings["gpusparse (PISA-quantized vectors)"] = time.perf_counter() - t0
        except ImportError as exc:
            report["engines"]["pisa"] = {"unavailable": str(exc)}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if "seismic" in engines:
        try:
            t0 = time.perf_counter()
            runs["seismic"] = seismic_run(docs, queries, args.k)
            timings["seismic"] = time.perf_counter() - t0
        except ImportError as exc:
            report["engines"]["seismic"] = {"unavailable": str(exc)}

    for name, run in runs.items():
        ev = evaluate(as_dict(run), args.qrels, args.measures)
        report["engines"][name] = {"metrics": ev.values, "seconds": round(timings.get(name, 0.0), 2)}
    if "pisa" in runs:
        exact_q = runs["gpusparse (PISA-quantized vectors)"]
        check = verify_run(runs["pisa"], qqueries, qdocs, qdocs.ids, ks=(10, 100, args.k))
        report["engines"]["pisa"]["versus_exact_on_quantized_vectors"] = {
            "recall": {f"R@{k}": r for k, r in check.recall.items()},
            "max_abs_score_diff": max_score_diff(runs["pisa"], exact_q),
        }
        report["engines"]["pisa"]["quantization"] = "documents int(100*w), queries floor(100*w) (pyterrier-pisa)"
    if "seismic" in runs:
        report["engines"]["seismic"]["max_abs_score_diff_vs_gpusparse"] = max_score_diff(
            runs["seismic"], runs["gpusparse"]
        )
        check = verify_run(runs["seismic"], queries, docs, docs.ids, ks=(10, 100, args.k))
        report["engines"]["seismic"]["versus_exact"] = {
            "recall": {f"R@{k}": r for k, r in check.recall.items()},
            "max_abs_score_diff": check.max_abs_diff,
        }

    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    print(text)
    names = list(report["engines"])
    print(f"\n{'engine':<36}" + "".join(f"{m:>10}" for m in report["measures"]), file=sys.stderr)
    for name in names:
        m = report["engines"][name].get("metrics")
        if m:
            print(f"{name:<36}" + "".join(f"{m[x]:>10.4f}" for x in report["measures"]), file=sys.stderr)


if __name__ == "__main__":
    main()
