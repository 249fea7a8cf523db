"""Same-run A/B of two source trees of GPUSparse: one process per (tree, round), alternating.

Each worker imports ``gpusparse`` from its tree (``PYTHONPATH``), generates the calibrated
synthetic collection on the GPU (same seed in every worker: the same bits), builds the
index, and times ``Index.search`` host to host (queries in, CPU results out; CUDA events)
with ``kernel="auto"`` at each k, one batch per call. It reports the median, the first
search (the layouts built), a checksum of the results (every tree must return the same
bits), and GPU memory over every allocator: PyTorch's peak allocated and reserved bytes,
CuPy's pool, and the device-wide bytes in use (``cudaMemGetInfo``: CUDA contexts, graphs and
every pool).

    python3 bench/house_ab.py --tree old=.ab/old/src --tree new=src --docs 8841823 \\
        --out $OUT/house-ab.json

Used for the engine-house refactor (issue 17): the tiled engine's 8.8M row, before and after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> dict:
    import torch

    import gpusparse
    from gpusparse import Index, SparseCollection, Vocabulary
    from gpusparse.synthetic import generate

    dev = torch.device("cuda")
    t0 = time.perf_counter()
    docs, qcsr = generate(args.docs, args.batch, seed=args.seed, device=dev)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    vocab = Vocabulary.bert()
    queries = SparseCollection(qcsr[0].cpu().numpy(), qcsr[1].cpu().numpy(), qcsr[2].cpu().numpy(), vocab=vocab)
    del qcsr
    t0 = time.perf_counter()
    index = Index.from_csr(*docs, vocab, device=dev)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    del docs
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    out: dict = {"gpusparse_file": gpusparse.__file__, "generate_s": gen_s, "index_build_s": build_s, "rows": {}}
    for k in args.ks:
        t0 = time.perf_counter()
        first = index.search(queries, k, batch_size=args.batch)
        first_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            index.search(queries, k, batch_size=args.batch)
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            res = index.search(queries, k, batch_size=args.batch)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        digest = hashlib.sha256(res.scores.numpy().tobytes() + res.ids.numpy().tobytes()).hexdigest()
        same_as_first = bool(torch.equal(res.ids, first.ids) and torch.equal(res.scores, first.scores))
        med = statistics.median(times)
        out["rows"][str(k)] = {
            "median_ms": med,
            "min_ms": min(times),
            "max_ms": max(times),
            "qps": args.batch / med * 1e3,
            "first_search_s": first_s,
            "sha256": digest,
            "repeatable": same_as_first,
        }
    out["memory"] = memory()
    return out


def memory() -> dict:
    import torch

    mem = {
        "torch_peak_allocated": torch.cuda.max_memory_allocated(),
        "torch_reserved": torch.cuda.memory_reserved(),
    }
    try:
        import cupy

        mem["cupy_pool_total"] = cupy.get_default_memory_pool().total_bytes()
    except ImportError:
        mem["cupy_pool_total"] = None
    free, total = torch.cuda.mem_get_info()
    mem["device_used"] = total - free
    return mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="LABEL=SRC_DIR (repeat; in order)")
    ap.add_argument("--docs", type=int, default=8_841_823)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ks", type=int, nargs="+", default=[1000, 10])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    trees = [t.split("=", 1) for t in args.tree]
    runs = []
    for rnd in range(args.rounds):
        for label, src in trees:
            env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
            cmd = [sys.executable, __file__, "--worker", "--docs", str(args.docs), "--batch", str(args.batch),
                   "--reps", str(args.reps), "--warmup", str(args.warmup), "--seed", str(args.seed),
                   "--ks", *map(str, args.ks)]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"worker {label} round {rnd} failed ({proc.returncode})")
            result = json.loads(lines[-1][len("RESULT ") :]) | {"tree": label, "src": src, "round": rnd}
            runs.append(result)
            row = " ".join(f"k={k}: {r['median_ms']:.2f} ms" for k, r in result["rows"].items())
            print(f"round {rnd} {label:>4}: {row}; device used {result['memory']['device_used'] / 2**30:.2f} GiB",
                  flush=True)  # fmt: skip
    import torch

    report = {
        "command": " ".join(["python3", "bench/house_ab.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "git_commit": os.environ.get("GIT_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "runs": runs,
    }
    summary = {}
    for label, _ in trees:
        for k in map(str, args.ks):
            meds = [r["rows"][k]["median_ms"] for r in runs if r["tree"] == label]
            summary[f"{label}-k{k}"] = {"median_of_medians_ms": statistics.median(meds), "medians_ms": meds}
    digests = {(r["tree"], k): r["rows"][k]["sha256"] for r in runs for k in r["rows"]}
    summary["identical_results"] = all(
        len({d for (t, kk), d in digests.items() if kk == k}) == 1 for k in map(str, args.ks)
    )
    report["summary"] = summary
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
