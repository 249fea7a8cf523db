"""Files in, GPU index out (issue 21): write calibrated synthetic JSONL, then time each stage.

Stages, each timed on its own (wall seconds, documents/s, the process's peak RSS so far, and on a GPU
the stage's peak over every allocator: PyTorch reserved plus CuPy's pool):

* ``write``: generate ``--docs`` calibrated documents (:func:`gpusparse.synthetic.generate`,
  ~120 postings each, BERT tokens) and write them as ``--shards`` JsonVectorCollection
  JSONL files (formatted in parallel processes);
* ``read_1core``: read the first shard with one worker (the per-core rate);
* ``read_all``: read all shards with every core (``read_vectors(workers=None)``);
* ``build``: ``Index.build`` on ``--device``; ``save``; ``load`` (memory-mapped, verified).

Usage (on the GPU machine; 8.8M documents write ~21 GB of JSONL under --work):
    python bench/ingest.py --docs 8841823 --shards 64 --device cuda --work /tmp/ingest \\
        --out $OUT --commit $(git rev-parse HEAD)
At small scale on a CPU: ``python bench/ingest.py --docs 20000 --device cpu``.
Writes ``<out>/<date>-<card>-ingest.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_peaks import gpu_memory
from gpusparse import Index, Vocabulary, jsonl_native, read_vectors
from gpusparse.formats import ReadStats, available_cores
from ingest_data import write_shards


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _card(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def _stage(rows: list[dict], name: str, docs: int, fn):
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # else an earlier stage's cached blocks count as this one's
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows.append({"stage": name, "docs": docs, "wall_s": wall, "docs_per_s": docs / wall, "peak_rss_bytes": _peak_rss(),
                 "gpu_memory": gpu_memory()})  # fmt: skip
    print(f"{name:>10}: {docs:,} docs in {wall:.1f} s", file=sys.stderr, flush=True)
    return out


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpusparse-ingest-"))
    data, index_dir = work / "jsonl", work / "index"
    rows: list[dict] = []
    try:
        if args.reuse and data.is_dir() and any(data.glob("part-*.jsonl")):
            files = sorted(data.glob("part-*.jsonl"))
        else:
            shutil.rmtree(data, ignore_errors=True)
            files = _stage(
                rows,
                "write",
                args.docs,
                lambda: write_shards(args.docs, data, shards=args.shards, seed=args.seed, device=args.gen_device),
            )
        vocab = Vocabulary.bert()
        one, every = ReadStats(), ReadStats()  # chunks by the parser that read them
        first = _stage(
            rows, "read_1core", -1, lambda: read_vectors(files[0], vocab, progress=False, workers=1, stats=one)
        )
        rows[-1]["docs"] = len(first)
        rows[-1]["docs_per_s"] = len(first) / rows[-1]["wall_s"]
        rows[-1]["chunks_by_parser"] = one.chunks_by_parser
        del first
        held = {
            "coll": _stage(rows, "read_all", args.docs, lambda: read_vectors(files, vocab, progress=False, stats=every))
        }
        rows[-1]["chunks_by_parser"] = every.chunks_by_parser
        nnz = held["coll"].nnz
        held["index"] = _stage(rows, "build", args.docs, lambda: Index.build(held.pop("coll"), device=args.device))
        shutil.rmtree(index_dir, ignore_errors=True)
        _stage(rows, "save", args.docs, lambda: held.pop("index").save(index_dir))
        _stage(rows, "load", args.docs, lambda: Index.load(index_dir, device=args.device))
        index_bytes = sum(p.stat().st_size for p in index_dir.rglob("*") if p.is_file())
    finally:
        if not args.keep:
            shutil.rmtree(index_dir, ignore_errors=True)
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "ingest",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "card": _card(args.device),
        "cores": available_cores(),
        "command": " ".join(sys.argv),
        "commit": args.commit,
        "docs": args.docs,
        "postings": nnz,
        "shards": args.shards,
        "jsonl_bytes": sum(f.stat().st_size for f in files) if files[0].exists() else None,
        "index_bytes": index_bytes,
        # the JSONL reader's C pass (gpusparse._jsonl_native): built or not; each read stage has its chunks_by_parser
        "jsonl_parser": "native" if jsonl_native.NATIVE else "columnar (gpusparse._jsonl_native not built)",
        "peak_rss_bytes": _peak_rss(),
        "stages": rows,
    }


def table(result: dict) -> str:
    lines = [f"{'stage':>10} {'docs':>12} {'wall s':>8} {'docs/s':>12} {'peak RSS GB':>12} {'GPU peak GB':>12}"]
    for r in result["stages"]:
        gpu = r.get("gpu_memory")
        lines.append(
            f"{r['stage']:>10} {r['docs']:>12,} {r['wall_s']:>8.1f} {r['docs_per_s']:>12,.0f} "
            f"{r['peak_rss_bytes'] / 1e9:>12.2f} {gpu['all_allocators'] / 1e9 if gpu else float('nan'):>12.2f}"
        )
    total = sum(r["wall_s"] for r in result["stages"] if r["stage"] not in ("write", "read_1core"))
    lines.append(
        f"read_all+build+save: {total:.1f} s; {result['postings']:,} postings; peak RSS "
        f"{result['peak_rss_bytes'] / max(1, result['postings']):.1f} bytes a posting; {result['card']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=8_841_823)
    p.add_argument("--shards", type=int, default=None, help="JSONL files (default: ~138K documents each)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="build/load device")
    p.add_argument("--gen-device", default=None, help="where to generate (default: --device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for the JSONL and the index (default: a temporary one)")
    p.add_argument("--reuse", action="store_true", help="reuse JSONL already under --work")
    p.add_argument("--keep", action="store_true", help="keep the index (and a temporary --work)")
    p.add_argument("--out", default=None, help="folder for the result JSON")
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)
    args.shards = args.shards or max(1, round(args.docs / 138_000))
    args.gen_device = args.gen_device or args.device
    result = run(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        card = result["card"].split(" (")[0].replace(" ", "-").lower()
        (out / f"{dt.date.today().isoformat()}-{card}-ingest.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
    os._exit(0)  # skip tearing down a large heap
