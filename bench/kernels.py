"""First GPU timing of the search kernels (issue #3): reference vs scatter vs docpar.

For each collection size (synthetic, generated on the GPU), batch size and k it times:

* the paper's pipelines as published: a ``[B, N]`` float32 buffer filled by the fused
  scatter-add kernel (or the document-parallel kernel), then ``torch.topk`` — device time
  only, with CUDA events; their top-k is compared with the exact one (``recall_vs_exact``);
* our exact search end to end through ``Index.search(kernel=...)`` (queries in from the
  host, results back to it) for every kernel, and checks that each returns the reference
  kernel's ids and scores exactly.

It also measures the card's copy bandwidth and reports each batch's floor: the bytes of the
postings its queries read (8 per posting) over that bandwidth.

Usage (on the GPU machine):
    python bench/kernels.py --out $OUT --commit $(git rev-parse HEAD)
Writes ``<out>/<date>-<card>-kernels.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse import Index, SparseCollection, Vocabulary, engines
from gpusparse.kernels import docpar_scores, scatter_add_scores
from gpusparse.layout.forward import forward_index
from gpusparse.queries import query_batch
from gpusparse.synthetic import generate


def environment(commit: str, command: str) -> dict:
    import triton

    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        driver = "unknown"
    props = torch.cuda.get_device_properties(0)
    return {
        "card": torch.cuda.get_device_name(0),
        "multiprocessors": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_commit": commit,
        "command": command,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    n = 1 << 28  # 1 GiB of float32
    x = torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    times = time_events(lambda: y.copy_(x), reps=20, warmup=3)
    return 2 * x.numel() * 4 / (statistics.median(times) / 1e3)


def time_events(fn, *, reps: int, warmup: int) -> list[float]:
    """Milliseconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def time_wall(fn, *, reps: int, warmup: int, budget_s: float = 20.0) -> list[float]:
    """Milliseconds per call including host work, synchronised; fewer reps for slow calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out: list[float] = []
    start = time.perf_counter()
    while len(out) < reps and (len(out) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def recall(approx_ids: torch.Tensor, exact_ids: torch.Tensor) -> float:
    hits, total = 0, 0
    for a, e in zip(approx_ids.tolist(), exact_ids.tolist(), strict=True):
        e = {d for d in e if d >= 0}
        hits += len(e & set(a))
        total += len(e)
    return hits / total if total else 1.0


def paper_pipeline(fill: Callable[[], torch.Tensor], k: int) -> torch.Tensor:
    """The paper's pipeline: fill the [B, N] buffer, then torch.topk."""
    return torch.topk(fill(), k, dim=1).indices


def bench_size(n_docs: int, args: argparse.Namespace, bw: float) -> list[dict]:
    """Every batch size, k and system at one collection size."""
    vocab = Vocabulary.bert()
    t0 = time.perf_counter()
    (di, dt_, dw), (qi, qt, qw) = generate(n_docs, max(args.batches), seed=args.seed, device="cuda")
    torch.cuda.synchronize()
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index.from_csr(di, dt_, dw, vocab, device="cuda")
    torch.cuda.synchronize()
    t_build = time.perf_counter() - t0
    del di, dt_, dw
    st = index.stats()
    t0 = time.perf_counter()
    fwd = forward_index(index)
    index.derived.forward = fwd
    torch.cuda.synchronize()
    t_fwd = time.perf_counter() - t0
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    print(
        f"N={n_docs:,}: {st.n_postings:,} postings, index {st.bytes / 2**20:,.0f} MiB; "
        f"generated in {t_gen:.1f} s, indexed in {t_build:.1f} s, forward index in {t_fwd:.1f} s",
        flush=True,
    )
    lengths = index.lengths.to(torch.int64)
    results: list[dict] = []
    for b in args.batches:
        q = queries[:b]
        batch = query_batch(q, index.device)
        postings = int(lengths[batch.terms].sum())
        distinct = int(lengths[torch.unique(batch.terms)].sum())
        buf = torch.empty((b, n_docs), dtype=torch.float32, device="cuda")
        fills = {
            "paper-scatter+topk": partial(scatter_add_scores, index, batch, 0, n_docs, buf),
            "paper-docpar+topk": partial(docpar_scores, index, batch, 0, n_docs, fwd, buf),
        }
        for k in args.ks:
            base = {
                "n_docs": n_docs,
                "n_postings": st.n_postings,
                "index_bytes": st.bytes,
                "batch_size": b,
                "k": k,
                "postings_read": postings,
                "postings_of_distinct_terms": distinct,
                "floor_ms": postings * 8 / bw * 1e3,
                "floor_distinct_terms_ms": distinct * 8 / bw * 1e3,
                "generate_s": t_gen,
                "build_s": t_build,
            }
            exact = index.search(q, k, kernel="reference", memory_budget=args.memory_budget)
            for name, fill in fills.items():
                torch.cuda.reset_peak_memory_stats()
                kernel_ms = time_events(fill, reps=args.reps, warmup=args.warmup)
                total_ms = time_events(partial(paper_pipeline, fill, k), reps=args.reps, warmup=1)
                med = statistics.median(total_ms)
                results.append(
                    base
                    | {
                        "system": name,
                        "ms_per_batch": med,
                        "kernel_ms": statistics.median(kernel_ms),
                        "qps": b / med * 1e3,
                        "peak_mem_bytes": torch.cuda.max_memory_allocated(),
                        "exact": False,  # torch.topk breaks ties arbitrarily: not our contract
                        "recall_vs_exact": recall(paper_pipeline(fill, k).cpu(), exact.ids),
                        "timing": "cuda events, device only",
                    }
                )
            for kern in engines.names():
                torch.cuda.reset_peak_memory_stats()
                search = partial(index.search, q, k, kernel=kern, memory_budget=args.memory_budget)
                times = time_wall(search, reps=args.reps, warmup=1)
                r = search()
                same = bool(torch.equal(r.ids, exact.ids) and torch.equal(r.scores, exact.scores))
                med = statistics.median(times)
                results.append(
                    base
                    | {
                        "system": f"exact-{kern}",
                        "ms_per_batch": med,
                        "qps": b / med * 1e3,
                        "peak_mem_bytes": torch.cuda.max_memory_allocated(),
                        "exact": same,
                        "recall_vs_exact": recall(r.ids, exact.ids),
                        "reps": len(times),
                        "timing": "wall clock, host to host (queries in, results out)",
                    }
                )
            print(
                "  "
                + "  ".join(f"{r['system']} {r['ms_per_batch']:.2f}ms" for r in results[-2 - len(engines.names()) :])
                + f"  [N={n_docs:,} B={b} k={k}]",
                flush=True,
            )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-budget", type=int, default=4 << 30)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="kernels")
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device")
    command = "python bench/kernels.py " + " ".join(sys.argv[1:])
    env = environment(args.commit, command)
    bw = copy_bandwidth()
    env["copy_bandwidth_bytes_per_s"] = bw
    print(f"{env['card']}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    results: list[dict] = []
    for n_docs in args.sizes:
        results += bench_size(n_docs, args, bw)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    card = env["card"].replace("NVIDIA ", "").replace(" ", "-")
    path = args.out / f"{dt.date.today().isoformat()}-{card}-{args.name}.json"
    path.write_text(json.dumps({"env": env, "results": results}, indent=2))
    print(f"\nwrote {path}\n")
    print(
        f"{'system':<22}{'N':>10}{'B':>5}{'k':>6}{'ms/batch':>11}{'QPS':>11}{'floor ms':>10}{'exact':>7}{'recall':>8}"
    )
    for r in results:
        print(
            f"{r['system']:<22}{r['n_docs']:>10,}{r['batch_size']:>5}{r['k']:>6}{r['ms_per_batch']:>11.3f}"
            f"{r['qps']:>11,.0f}{r['floor_ms']:>10.3f}{r['exact']!s:>7}{r['recall_vs_exact']:>8.4f}"
        )


if __name__ == "__main__":
    main()
