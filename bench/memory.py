"""Issue 18: what the fast engine holds on the GPU, by residency mode, and its speed.

For float32 and 8-bit weights (``quantize=8``) and each residency mode
(``EngineConfig.resident``: ``lists`` = padded lists + forward copy + tiled layout, as
before; ``tiled`` = the tiled layout alone, fixed-point products; ``tiled-float`` = the
tiled layout alone, float64 products), and each ``--dense-min`` of the tiled modes, one worker
process each: generate the calibrated synthetic collection on the device, build, search one
batch at k = 1000 and 10 host to host (median ms), and report the peak over every allocator
(PyTorch allocated and reserved, CuPy's pool, device-wide use from ``mem_get_info``), the
index's own :meth:`~gpusparse.Index.memory` report, the tiled layouts built (``layouts``: their
form, 5 or 6 bytes a sparse posting) and a checksum of the results (identical
across modes of one weight type). Each row also records the prediction made from the lists before
the first search builds anything (:func:`gpusparse.footprint.predict` of the run's mode):
``predicted`` (components, temporaries, peak) beside the measured ``peak``. ``--cap-gib 16``
also runs the tiled modes with the process capped (``torch.cuda.set_per_process_memory_fraction``)
from the search on (the collection is generated and indexed before the cap). ``--limit-gib 16``
also runs the default mode (``lists``), float32 and 8-bit, under
``EngineConfig.device_memory_limit`` (:mod:`gpusparse.device_memory`): the search plans
within the limit (falling back to a mode that fits), enforces it on PyTorch and CuPy, and the
row records the plan (``plan``: mode chosen, its predicted peak, the warning) beside the peak.

    python bench/memory.py --out bench/results/<date>-<card>-memory.json
    python bench/memory.py --docs 20000 --device cpu --reps 2   # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {"lists": {"resident": "lists"}, "tiled": {"resident": "tiled"},
         "tiled-float": {"resident": "tiled", "fixed_point": False}}  # fmt: skip


def worker(args: argparse.Namespace) -> dict:
    import torch

    import gpusparse
    from gpusparse import Index, SparseCollection, Vocabulary
    from gpusparse.config import override_config
    from gpusparse.synthetic import generate
    from search_timing import timed_search

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    docs, qcsr = generate(args.docs, args.batch, seed=args.seed, device=dev)
    sync()
    gen_s = time.perf_counter() - t0
    vocab = Vocabulary.bert()
    queries = SparseCollection(qcsr[0].cpu().numpy(), qcsr[1].cpu().numpy(), qcsr[2].cpu().numpy(), vocab=vocab)
    dense_min = getattr(args, "dense_min", None)
    dense = {} if dense_min is None else {"dense_min": None if dense_min == 0 else dense_min}
    limit_gib = getattr(args, "limit_gib", None)
    limit = int(limit_gib * 2**30) if limit_gib else None
    limited = {} if limit is None else {"device_memory_limit": limit}  # (an older checkout lacks the setting)
    with override_config(**MODES[args.mode], **dense, **limited):
        t0 = time.perf_counter()
        index = Index.from_csr(*docs, vocab, device=dev, quantize=args.quantize)
        sync()
        build_s = time.perf_counter() - t0
        del docs, qcsr
        predicted = _prediction(index, args, dev)  # before anything is built from the lists
        if cuda and args.mode != "lists":
            index.release_to_host()  # what the first search does; timed apart from it
        if cuda:
            torch.cuda.empty_cache()
            if args.cap_gib:
                total = torch.cuda.mem_get_info(dev)[1]
                # the fraction's device needs an index ("cuda" alone is refused)
                capped = torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev
                torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), capped)
            torch.cuda.reset_peak_memory_stats(dev)
        out: dict = {"gpusparse_file": gpusparse.__file__, "generate_s": gen_s, "index_build_s": build_s, "rows": {}}
        for k in args.ks:
            out["rows"][str(k)] = timed_search(index, queries, k, args.batch, args.reps)
        report = index.memory(batch_size=args.batch, k=max(args.ks), n_sm=_n_sm(dev))
        out["index_memory"] = report
        out["layouts"] = _layouts(index)
        out["peak"] = _peaks(dev) if cuda else {}
        out["predicted"] = predicted
        plans = index.__dict__.get("_memory_plans", {}).values()
        out["plan"] = [{"mode": d.chosen.mode, "kernel": d.kernel, "peak": d.chosen.peak, "usable": d.usable,
                        "warning": d.message() if d.fallback else None} for d in plans]  # fmt: skip
    out["config"] = {"mode": args.mode, **MODES[args.mode], "quantize": args.quantize, "cap_gib": args.cap_gib,
                     "limit_gib": limit_gib, "dense_min": dense_min}  # fmt: skip
    return out


def _layouts(index) -> list[dict]:
    """The tiled layouts built for the search: tiles, dense rows, sparse postings and their
    form (``exp_base`` set: 5 bytes a posting; an older checkout has no such field)."""
    owners = [index, *index.derived.views.values()]
    return [{"key": repr(key), "tile_bits": tl.tile_bits, "dense_rows": tl.dense.shape[0],
             "sparse_postings": tl.offs.numel(), "exp_base": getattr(tl, "exp_base", None), "bytes": tl.nbytes}
            for owner in owners for key, tl in owner.derived.layouts.items()]  # fmt: skip


def _prediction(index, args: argparse.Namespace, dev) -> dict:
    """The footprint predicted for this run's mode from the index's lists alone, before the first
    search builds anything (:func:`gpusparse.footprint.predict`, the settings in force)."""
    try:
        from gpusparse.footprint import IndexShape, predict
    except ImportError:  # an older checkout (an A/B run) predicts nothing
        return {}

    mode = "lists" if args.mode == "lists" else "tiled"
    return predict(IndexShape(index), mode, batch_size=args.batch, k=max(args.ks), n_sm=_n_sm(dev)).as_dict()


def _n_sm(dev) -> int:
    import torch

    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1


def _peaks(dev) -> dict:
    from gpu_peaks import gpu_memory

    return gpu_memory(dev)


def _git_head() -> str | None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return head.stdout.strip() or None


def runs(args: argparse.Namespace) -> list[dict]:
    plan = []
    for quantize in () if args.cap_only else (None, 8):
        for mode in args.modes:
            if quantize is not None and mode == "tiled-float":
                continue  # 8-bit levels are exact: one tiled mode
            for dense_min in args.dense_mins if mode != "lists" else [None]:
                plan.append({"mode": mode, "quantize": quantize, "cap_gib": None, "limit_gib": None,
                             "dense_min": dense_min})  # fmt: skip
    if args.cap_gib:
        capped = ((None, "tiled"), (8, "tiled"))
        plan += [{"mode": m, "quantize": q, "cap_gib": args.cap_gib, "limit_gib": None, "dense_min": None}
                 for q, m in capped]  # fmt: skip
    limit = getattr(args, "limit_gib", None)
    if limit:
        plan += [{"mode": "lists", "quantize": q, "cap_gib": None, "limit_gib": limit, "dense_min": None}
                 for q in (None, 8)]  # fmt: skip
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8_841_823)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ks", type=int, nargs="+", default=[1000, 10])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cap-gib", type=float, default=None, help="also run the tiled modes capped at this many GiB")
    ap.add_argument("--cap-only", action="store_true", help="with --cap-gib: only the capped (and limited) runs")
    ap.add_argument("--limit-gib", type=float, default=None, help="also run the default mode under this device limit")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument(
        "--dense-mins", type=float, nargs="+", default=[None], help="tiled modes: dense_min values (0: none)"
    )
    ap.add_argument("--dense-min", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mode", choices=list(MODES), default="tiled", help=argparse.SUPPRESS)
    ap.add_argument("--quantize", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    results = []
    for run in runs(args):
        cmd = [sys.executable, __file__, "--worker", "--docs", str(args.docs), "--batch", str(args.batch),
               "--reps", str(args.reps), "--seed", str(args.seed), "--device", args.device, "--mode", run["mode"],
               "--ks", *map(str, args.ks)]  # fmt: skip
        if run["quantize"]:
            cmd += ["--quantize", str(run["quantize"])]
        if run["cap_gib"]:
            cmd += ["--cap-gib", str(run["cap_gib"])]
        if run["dense_min"] is not None:
            cmd += ["--dense-min", str(run["dense_min"])]
        if run["limit_gib"]:
            cmd += ["--limit-gib", str(run["limit_gib"])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = proc.stderr.strip().splitlines()[-3:]
            results.append({"config": run, "error": " | ".join(tail) or f"exit {proc.returncode}"})
        else:
            results.append(json.loads(lines[-1][7:]))
        print(_row(results[-1]), flush=True)
    report = {"commit": os.environ.get("GIT_COMMIT") or _git_head(), "command": " ".join(["python3", *sys.argv]),
              "device": _device_name(args.device), "docs": args.docs, "batch": args.batch, "ks": args.ks,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results,
              "same_results": _same(results)}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({"same_results": report["same_results"]}))


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def _same(results: list[dict]) -> dict[str, bool]:
    """Per weight type: whether every mode (capped runs included) returned the same results."""
    by: dict[str, set] = {}
    for r in results:
        if "rows" in r:
            key = "8-bit" if r["config"]["quantize"] else "float32"
            by.setdefault(key, set()).add(tuple(sorted((k, v["checksum"]) for k, v in r["rows"].items())))
    return {key: len(sums) == 1 for key, sums in by.items()}


def _row(r: dict) -> str:
    c = r["config"]
    dm = c.get("dense_min")
    name = f"{'8-bit' if c['quantize'] else 'float32':8} {c['mode']:12} dense={'auto' if dm is None else dm:>5} "
    name += f"cap={c['cap_gib'] or '-':>4} limit={c.get('limit_gib') or '-':>4}"
    if "error" in r:
        return f"{name} ERROR {r['error']}"
    speed = "  ".join(f"k={k} {v['median_ms']:.2f} ms" for k, v in r["rows"].items())
    peak = r["peak"].get("all_allocators")
    gpu = sum(n for d, n in r["index_memory"]["by_device"].items() if d != "cpu")
    mem = f"resident {gpu / 1e9:.2f} GB" + (f", peak (all allocators) {peak / 1e9:.2f} GB" if peak else "")
    pred = r.get("predicted")
    if pred:
        mem += f", predicted resident {pred['resident'] / 1e9:.2f} / peak {pred['peak'] / 1e9:.2f} GB"
    for p in r.get("plan", []):
        mem += f", planned {p['mode']} ({p['kernel']}) peak {p['peak'] / 1e9:.2f} GB"
    return f"{name} {speed}  {mem}  sums {'/'.join(v['checksum'][:8] for v in r['rows'].values())}"


if __name__ == "__main__":
    main()
