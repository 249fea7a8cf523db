"""JSONL read rate, one core and all cores, this checkout against an earlier commit, in the same run.

Each run is a fresh process reading ``FILE`` with ``read_vectors(workers=W)`` (BERT
vocabulary) for each ``W`` of ``--workers`` (``1,0``: one core, then all cores); it reports
CPU seconds (the process and its workers), wall seconds and the process's peak RSS (not
the workers'). Runs of the two source trees alternate (``--rounds`` each), so a noisy
machine slows both alike; the table keeps every run and the best of each tree: docs per
CPU second with one worker, docs per wall second with all. ``--stages`` also times the
columnar path's stages on the first chunks of the file (this checkout only). ``--columnar``
adds a third tree: this checkout's sources without the built C module
(``gpusparse._jsonl_native``), so the numpy columnar path reads. Each run records whether
the module was there and how many chunks each parser read (``chunks_by_parser``).

Usage:
    python bench/read_rate.py FILE --before 6cc3948 --columnar --rounds 2 --workers 1,0 --stages --out NAME.json
(without ``--before``, or without git, only this checkout is timed; build the C module
first: ``pip install -e .`` or ``python setup.py build_ext --inplace``)
Make a file with ``python -c "import sys; sys.path[:0] = ['src', 'bench']; from ingest_data import
write_shards; write_shards(200000, '/tmp/d200k')"``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RUN = """
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
from gpusparse import Vocabulary, read_vectors
try:  # (older trees have neither)
    from gpusparse.jsonl_native import NATIVE
    from gpusparse.formats import ReadStats
    stats = ReadStats()
except ImportError:
    NATIVE, stats = None, None
vocab = Vocabulary.bert()
workers = int(sys.argv[3]) or len(os.sched_getaffinity(0))
base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()  # RSS before the read
t0, c0 = time.perf_counter(), time.process_time()
coll = read_vectors(sys.argv[2], vocab, progress=False, workers=workers, **({"stats": stats} if stats else {}))
wall = time.perf_counter() - t0
cpu = time.process_time() - c0 + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
cpu += resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
final = coll.indptr.nbytes + coll.indices.nbytes + coll.values.nbytes
print(json.dumps({"workers": workers, "docs": len(coll), "postings": int(coll.nnz), "cpu_s": cpu, "wall_s": wall,
                  "maxrss_bytes": rss, "rss_before_read_bytes": base, "collection_array_bytes": final,
                  "native_built": NATIVE, "chunks_by_parser": getattr(stats, "chunks_by_parser", None)}))
"""


def _one(src: Path, path: str, workers: int) -> dict:
    cmd = [sys.executable, "-c", _RUN, str(src), path, str(workers)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def stages(path: str, chunks: int = 6) -> dict[str, float]:
    """Microseconds a document of each stage of the columnar path, on the first ``chunks`` chunks,
    and of the native pass where its module is built."""
    sys.path.insert(0, str(ROOT / "src"))
    import numpy as np

    from gpusparse import Vocabulary, jsonl_keys, jsonl_native, jsonl_numbers
    from gpusparse import jsonl_columns as jc

    vocab = Vocabulary.bert()
    table = jsonl_keys.KeyTable(vocab.tokens())
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
        lines = chunk.split(b"\n")
        which = [i for i, ln in enumerate(lines) if ln and not ln.isspace()]
        c = tick("split lines", c)
        jc._raw_ids(lines, which)
        c = tick("msgspec: lines well-formed, ids", c)
        padded = b" " * jc._PAD + chunk + b" " * jc._PAD
        buf = np.frombuffer(padded, np.uint8)
        rows24 = jsonl_numbers.rows_view(padded, 24)
        tok = jc._Tokens(buf)
        c = tick("structural scan (quotes, braces, strings)", c)
        jc._record_keys_ok(tok, buf, rows24, which, len(lines))
        keys = np.flatnonzero((tok.cls == jc._QUOTE) & (tok.depth == 2))
        starts = jc._skip(buf, np.take(tok.closes, np.take(tok.rank, keys)) + 1, 1, jc._COLON)
        ends = jc._skip(buf, np.take(tok.pos, keys + 1), -1, jc._COMMA)
        c = tick("records, keys and weight spans", c)
        jsonl_numbers.parse_numbers(padded, starts, ends, np.take(buf, starts) == 45)
        c = tick("weights (exact decimal parser)", c)
        jc._term_ids(tok, keys, rows24, chunk, table, vocab.lookup)
        c = tick("token ids (hash table)", c)
        jc.columns_of_chunk(chunk, table, vocab.lookup, "error")
        c = tick("all (columns_of_chunk)", c)
        if jsonl_native.NATIVE:
            jsonl_native.native_columns(chunk, table, vocab.lookup, "error")
            c = tick("the native pass (jsonl_native.native_columns)", c)
    return {k: round(v / docs * 1e6, 2) for k, v in t.items()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--before", default=None, help="commit to compare with (its src/ is exported; needs git)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", default="1", help="comma-separated worker counts; 0: all cores")
    p.add_argument("--columnar", action="store_true", help="also time this checkout without its C module")
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
        if args.columnar:
            shutil.copytree(ROOT / "src", Path(tmp) / "columnar", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
            trees["columnar"] = Path(tmp) / "columnar"
        for r in range(args.rounds):
            for w in [int(x) for x in args.workers.split(",")]:
                for code, src in trees.items():
                    row = {"code": code, "round": r, **_one(src, args.file, w), "load_avg_1min": os.getloadavg()[0]}
                    row["docs_per_cpu_s"] = row["docs"] / row["cpu_s"]
                    row["docs_per_wall_s"] = row["docs"] / row["wall_s"]
                    # the read's own peak: peak RSS less the RSS before it (interpreter, torch, vocabulary)
                    peak = row["maxrss_bytes"] - row["rss_before_read_bytes"]
                    row["read_peak_bytes_per_posting"] = peak / row["postings"]
                    beyond = peak - row["collection_array_bytes"]
                    row["beyond_collection_bytes_per_posting"] = beyond / row["postings"]
                    runs.append(row)
                    if code == "after" and not row["native_built"]:
                        print("WARNING: gpusparse._jsonl_native is not built in this checkout", file=sys.stderr)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    one = [r for r in runs if r["workers"] == 1]
    many = [r for r in runs if r["workers"] > 1]
    best = {c: min((r for r in one if r["code"] == c), key=lambda r: r["cpu_s"]) for c in trees if one}
    best_all = {c: min((r for r in many if r["code"] == c), key=lambda r: r["wall_s"]) for c in trees if many}
    result = {
        "benchmark": "read_vectors JSONL rate, one core (workers=1) and all cores, before vs after in the same run",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {_cpu_model()}, {os.cpu_count()} cores",
        "note": args.note,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "before_commit": args.before,
        "file": {"path": args.file, "bytes": os.path.getsize(args.file)},
        "runs": runs,
        "best_docs_per_cpu_s": {c: round(r["docs_per_cpu_s"]) for c, r in best.items()},
        "all_cores_best_docs_per_wall_s": {c: round(r["docs_per_wall_s"]) for c, r in best_all.items()},
        "read_peak_bytes_per_posting": {c: round(r["read_peak_bytes_per_posting"], 1) for c, r in best.items()},
        "beyond_collection_bytes_per_posting": {
            c: round(r["beyond_collection_bytes_per_posting"], 1) for c, r in best.items()
        },
    }
    if args.stages:
        result["stages_us_per_doc_after"] = stages(args.file)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    keys = (
        "best_docs_per_cpu_s",
        "all_cores_best_docs_per_wall_s",
        "read_peak_bytes_per_posting",
        "beyond_collection_bytes_per_posting",
    )
    print(json.dumps({k: result[k] for k in keys}))
    return result


if __name__ == "__main__":
    main()
