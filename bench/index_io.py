"""Saving and loading an index folder: seconds and GB/s, for one or several source trees in one run.

For each ``--src`` (a ``src`` folder: this checkout's and, for a same-run comparison, an
older one), one worker process generates the calibrated synthetic collection on the device,
builds the index there, saves it (``Index.save``, ``--save-reps`` times: median), then loads it back
``--reps`` times: to the GPU (``Index.load(device="cuda")``, the default residency: the
arrays go to the GPU, verified) and to the host (``mmap``, verified). The folder was just
written, so reads come from the page cache (what a second load of an index sees; a cold
read is bounded by the disk). The loaded arrays are compared with the built index's.
Reported: seconds and GB/s per stage (median of reps), the index's bytes on disk, and the
GPU peak over every allocator (PyTorch reserved plus CuPy's pool) while loading.

    python bench/index_io.py --docs 8841823 --src src .ab/old/src --out $OUT/index-io.json
    python bench/index_io.py --docs 20000 --device cpu          # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> dict:
    import torch

    import gpusparse
    from gpu_peaks import gpu_memory
    from gpusparse import Index, Vocabulary
    from gpusparse.synthetic import generate

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    docs, _ = generate(args.docs, 0, seed=args.seed, device=dev)
    built = Index.from_csr(*docs, Vocabulary.bert(), device=dev)
    del docs
    work = Path(tempfile.mkdtemp(prefix="gpusparse-io-", dir=args.work))
    path = work / "idx"
    out: dict = {"gpusparse_file": gpusparse.__file__, "docs": args.docs}
    try:
        saves = []
        for _ in range(args.save_reps):
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            built.save(path)
            saves.append(time.perf_counter() - t0)
        out["save_s"], out["save_all_s"] = statistics.median(saves), saves
        size = sum(f.stat().st_size for f in path.iterdir())
        out["index_bytes"] = size
        ref = {name: t.cpu() for name, t in built.arrays().items()}
        del built
        if cuda:
            torch.cuda.empty_cache()
        for label, kwargs in (("load_gpu", {"device": args.device}), ("load_host_mmap", {"device": "cpu"})):
            if label == "load_gpu" and not cuda:
                continue
            times = []
            for _ in range(args.reps):
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                loaded = Index.load(path, **kwargs)
                if cuda:
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
                same = all(torch.equal(loaded.arrays()[n].cpu(), t) for n, t in ref.items())
                del loaded
            med = statistics.median(times)
            out[label] = {"median_s": med, "s": times, "gb_per_s": size / 1e9 / med, "same_arrays": same,
                          "gpu_peak": gpu_memory(dev)}  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["save_gb_per_s"] = size / 1e9 / out["save_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=8_841_823)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--save-reps", type=int, default=1)
    p.add_argument("--src", nargs="+", default=["src"], help="source trees to compare (one process each)")
    p.add_argument("--work", default=None, help="folder for the index (default: the system's temporary folder)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results = []
    for src in args.src:
        cmd = [sys.executable, __file__, "--worker", "--docs", str(args.docs), "--device", args.device,
               "--seed", str(args.seed), "--reps", str(args.reps), "--save-reps", str(args.save_reps)]  # fmt: skip
        cmd += ["--work", args.work] if args.work else []
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(src).resolve()), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"worker for {src} failed")
        results.append({"src": src, **json.loads(proc.stdout.strip().splitlines()[-1])})
    card = "cpu"
    if args.device.startswith("cuda"):
        import torch

        card = torch.cuda.get_device_name(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"benchmark": "index_io", "card": card, "command": " ".join(sys.argv),
           "commit": os.environ.get("GIT_COMMIT", commit), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "results": results}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{'src':>16} {'GB':>6} {'save s':>7} {'GB/s':>6} {'gpu s':>7} {'GB/s':>6} {'mmap s':>7} {'same':>5}")
    for r in results:
        g = r.get("load_gpu") or {}
        same = g.get("same_arrays", r["load_host_mmap"]["same_arrays"])
        print(f"{r['src'][-16:]:>16} {r['index_bytes'] / 1e9:>6.2f} {r['save_s']:>7.2f} {r['save_gb_per_s']:>6.2f} "
              f"{g.get('median_s', float('nan')):>7.2f} {g.get('gb_per_s', float('nan')):>6.2f} "
              f"{r['load_host_mmap']['median_s']:>7.2f} {same!s:>5}")  # fmt: skip


if __name__ == "__main__":
    main()
