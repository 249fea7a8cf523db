"""JSONL read rate of one core, this checkout against an earlier commit, in the same run.

Each run is a fresh process reading ``FILE`` with ``read_vectors(workers=1)`` (BERT
vocabulary); it reports CPU seconds, wall seconds and the process's peak RSS. Runs of the
two source trees alternate (``--rounds`` each), so a noisy machine slows both alike; the
table keeps every run and the best CPU time of each tree. ``--stages`` also times the
fast path's stages on the first chunks of the file (this checkout only).

Usage:
    python bench/read_rate.py FILE --before 6cc3948 --rounds 2 --stages --out bench/results/NAME.json
(without ``--before``, or without git, only this checkout is timed)
Make a file with ``python -c "import sys; sys.path[:0] = ['src', 'bench']; from ingest_data import
write_shards; write_shards(200000, '/tmp/d200k')"``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RUN = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from gpusparse import Vocabulary, read_vectors
vocab = Vocabulary.bert()
base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()  # RSS before the read
t0, c0 = time.perf_counter(), time.process_time()
coll = read_vectors(sys.argv[2], vocab, progress=False, workers=1)
cpu, wall = time.process_time() - c0, time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
final = coll.indptr.nbytes + coll.indices.nbytes + coll.values.nbytes
print(json.dumps({"docs": len(coll), "postings": int(coll.nnz), "cpu_s": cpu, "wall_s": wall, "maxrss_bytes": rss,
                  "rss_before_read_bytes": base, "collection_array_bytes": final}))
"""


def _one(src: Path, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _RUN, str(src), path], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def stages(path: str, chunks: int = 6) -> dict[str, float]:
    """Microseconds a document of each stage of the fast path, on the first ``chunks`` chunks."""
    sys.path.insert(0, str(ROOT / "src"))
    from array import array
    from itertools import chain
    from operator import itemgetter

    import numpy as np
    import orjson

    from gpusparse import Vocabulary
    from gpusparse import jsonl_chunks as jc

    ids_of = jc.TokenIds(Vocabulary.bert())
    size = 4 << 20
    with open(path, "rb") as f:
        data = f.read(chunks * size)
    parts, pos = [], 0
    while (end := data.find(b"\n", pos + size)) >= 0 or pos < len(data):
        end = len(data) if end < 0 else end + 1
        parts.append(data[pos:end])
        pos = end
    parts = [p for p in parts if p.endswith(b"\n")]
    docs = sum(p.count(b"\n") for p in parts)
    t: dict[str, float] = {}

    def tick(name: str, t0: float) -> float:
        now = time.process_time()
        t[name] = t.get(name, 0.0) + now - t0
        return now

    for chunk in parts:
        c = time.process_time()
        lines = [ln for ln in chunk.split(b"\n") if ln]
        c = tick("split", c)
        objs = list(map(orjson.loads, lines))
        c = tick("orjson.loads a line", c)
        vecs = [o["vector"] for o in objs]
        ids = [o.get("id", o.get("_id")) for o in objs]
        c = tick("records (ids, vectors)", c)
        for ln, o, v in zip(lines, objs, vecs, strict=True):
            _ = ln.count(b":") == len(o) + len(v)
        c = tick("':' count a line", c)
        lengths = np.fromiter(map(len, vecs), np.int64, len(vecs))
        values = np.frombuffer(array("d", chain.from_iterable(map(dict.values, vecs))), np.float64)
        c = tick("weights (array d)", c)
        packed = itemgetter(*chain.from_iterable(vecs))(ids_of.packed)
        c = tick("token ids (itemgetter)", c)
        terms = np.frombuffer(b"".join(packed), np.int32)
        c = tick("token ids (join)", c)
        jc._result(ids, np.arange(len(ids)), lengths, terms, values, len(ids))
        c = tick("checks + float32", c)
        del objs, vecs
    return {k: round(v / docs * 1e6, 2) for k, v in t.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--before", default=None, help="commit to compare with (its src/ is exported; needs git)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stages", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"after": ROOT / "src"}
        if args.before:
            archive = subprocess.run(["git", "archive", args.before, "src"], cwd=ROOT, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            trees = {"before": Path(tmp) / "src", **trees}
        for r in range(args.rounds):
            for code, src in trees.items():
                row = {"code": code, "round": r, **_one(src, args.file), "load_avg_1min": os.getloadavg()[0]}
                row["docs_per_cpu_s"] = row["docs"] / row["cpu_s"]
                # the read's own peak: peak RSS less the RSS before it (interpreter, torch, vocabulary)
                row["read_peak_bytes_per_posting"] = (row["maxrss_bytes"] - row["rss_before_read_bytes"]) / row[
                    "postings"
                ]
                row["beyond_collection_bytes_per_posting"] = (
                    row["maxrss_bytes"] - row["rss_before_read_bytes"] - row["collection_array_bytes"]
                ) / row["postings"]
                runs.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    best = {c: min((r for r in runs if r["code"] == c), key=lambda r: r["cpu_s"]) for c in trees}
    result = {
        "benchmark": "read_vectors JSONL rate, one core (workers=1), before vs after in the same run",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "note": args.note,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "before_commit": args.before,
        "file": {"path": args.file, "bytes": os.path.getsize(args.file)},
        "runs": runs,
        "best_docs_per_cpu_s": {c: round(r["docs_per_cpu_s"]) for c, r in best.items()},
        "read_peak_bytes_per_posting": {c: round(r["read_peak_bytes_per_posting"], 1) for c, r in best.items()},
        "beyond_collection_bytes_per_posting": {
            c: round(r["beyond_collection_bytes_per_posting"], 1) for c, r in best.items()
        },
    }
    if args.stages:
        result["stages_us_per_doc_after"] = stages(args.file)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    keys = ("best_docs_per_cpu_s", "read_peak_bytes_per_posting", "beyond_collection_bytes_per_posting")
    print(json.dumps({k: result[k] for k in keys}))
    return result


if __name__ == "__main__":
    main()
