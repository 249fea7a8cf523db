"""One GPU against several in the same run, and the streamed mode (issue #8).

Launched by torchrun, one process per GPU. Every process generates the same seeded
synthetic MS MARCO-scale collection on its GPU (``gpusparse.synthetic``; nothing is read
from disk) and the same query batch, then:

1. **1 GPU, resident**: process 0 indexes all documents and times
   ``search_sharded(..., distributed=False)`` (queries in from the host, top-k back to it);
   its top-k on the first ``--exact-sample`` queries is checked against the exact
   reference kernel.
2. **N GPUs, resident**: each process indexes its contiguous shard and all time
   ``search_sharded`` together (per-shard top-k, NCCL all_gather, device-side merge); the
   merged results must equal step 1's (ids and score bits, every query).
3. **Streamed** (forced): the same index, then each shard, kept in pinned host memory in
   ``--stream-pieces`` document ranges, piece ``i + 1`` copied on a side stream while piece
   ``i`` is searched; timed on 1 GPU and on N, results checked against step 1. The pinned
   host-to-device copy rate is measured in the same run.

Timing: ``--warmup`` calls, then ``--reps`` calls started together (a barrier before each),
timed with CUDA events on process 0; medians are reported. Writes
``<out>/<date>-<card>-<name>.json`` and prints a short table last.

Usage, from the repository root on a 2-GPU machine:
    python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multigpu.py --out $OUT
CPU dry run (gloo, tiny sizes):
    torchrun --standalone --nproc-per-node=2 bench/multigpu.py --cpu --docs 20000 --batch 32 --k 100 --out /tmp/mg
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.bench.runner import RunConfig, environment
from gpusparse.distributed import StreamedIndex, init_from_env, search_sharded
from gpusparse.search import SearchResults, choose_kernel
from gpusparse.shards import document_ranges
from gpusparse.synthetic import MSMARCO_TARGETS, format_stats, generate, synthetic_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8_841_823)
    ap.add_argument("--batch", type=int, default=256, help="queries per batch (one batch is timed)")
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stream-pieces", type=int, default=4, help="pieces of each streamed index")
    ap.add_argument("--stream-reps", type=int, default=5)
    ap.add_argument("--exact-sample", type=int, default=32, help="queries checked against the reference kernel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with gloo")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default="multigpu")
    ap.add_argument("--commit", help="git commit to record [default: git rev-parse HEAD]")
    args = ap.parse_args()

    rank, world, dev = init_from_env("cpu" if args.cpu else None)
    cuda = dev.type == "cuda"
    start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    cfg = RunConfig(device=str(dev), commit=args.commit, command=" ".join(["bench/multigpu.py", *sys.argv[1:]]))
    env = environment(cfg)
    cards: list[str | None] = [None] * world
    dist.all_gather_object(cards, torch.cuda.get_device_name(dev) if cuda else "cpu")
    env |= {"world_size": world, "backend": dist.get_backend(), "cards_per_process": cards}
    kernel = choose_kernel("auto", dev)
    log(f"{world} processes on {', '.join(str(c) for c in cards)}; kernel {kernel}")

    # -- the collection, the same on every process --------------------------------------------
    t0 = time.perf_counter()
    docs, qcsr = generate(args.docs, args.batch, seed=args.seed, device=dev)
    _sync(dev)
    t_gen = time.perf_counter() - t0
    vocab = Vocabulary.bert()
    queries = SparseCollection(qcsr[0].cpu().numpy(), qcsr[1].cpu().numpy(), qcsr[2].cpu().numpy(), vocab=vocab)
    collection: dict[str, object] = {"n_docs": args.docs, "n_postings": int(docs[1].numel()), "generate_s": t_gen}
    if rank == 0:
        stats = synthetic_stats(docs, qcsr)
        collection["stats"] = stats
        log(f"generated {args.docs:,} documents in {t_gen:.1f} s\n{format_stats(stats)}")
    del qcsr
    rows: list[dict] = []

    # -- 1 GPU, resident ----------------------------------------------------------------------
    one: SearchResults | None = None
    full: Index | None = None
    if rank == 0:
        t0 = time.perf_counter()
        full = Index.from_csr(*docs, vocab, device=dev)
        _sync(dev)
        collection |= {"index_s": time.perf_counter() - t0, "index_bytes": _nbytes(full)}
        _reset_peak(dev)
        times, one = timed(lambda: search_sharded(full, queries, args.k, distributed=False), dev, args, lockstep=False)
        rows.append(_row("resident", 1, times, args, dev, identical=True))
        n = min(args.exact_sample, len(queries))
        ref = full.search(queries[:n], args.k, kernel="reference")
        exact = torch.equal(ref.ids, one.ids[:n]) and ref.scores.numpy().tobytes() == one.scores[:n].numpy().tobytes()
        collection |= {"exact_vs_reference": exact, "exact_sample": n}
        log(f"1 GPU: median {rows[-1]['median_ms']:.1f} ms; {n} queries equal to the reference kernel's: {exact}")
    dist.barrier()

    # -- N GPUs, resident ---------------------------------------------------------------------
    a, b = document_ranges(args.docs, world)[rank]
    indptr, terms, weights = docs
    lo, hi = int(indptr[a]), int(indptr[b])
    shard = Index.from_csr(indptr[a : b + 1] - lo, terms[lo:hi], weights[lo:hi], vocab, device=dev)
    del docs, indptr, terms, weights
    _reset_peak(dev)

    def sharded() -> SearchResults:
        return search_sharded(shard, queries, args.k, offset=a, n_docs=args.docs)

    times, many = timed(sharded, dev, args, lockstep=True)
    if rank == 0:
        row = _row("resident", world, times, args, dev, identical=_same(many, one))
        row["speedup_vs_1_gpu"] = rows[0]["median_ms"] / row["median_ms"]
        rows.append(row)
        log(
            f"{world} GPUs: median {row['median_ms']:.1f} ms, {row['speedup_vs_1_gpu']:.2f}x one GPU; "
            f"identical: {row['identical_to_1_gpu']}"
        )

    # -- streamed from pinned host memory ------------------------------------------------------
    h2d = _h2d_rate(dev) if cuda and rank == 0 else None
    streamed_one = StreamedIndex(full, args.stream_pieces, dev, kernel=kernel) if rank == 0 else None
    streamed_many = StreamedIndex(shard, args.stream_pieces, dev, kernel=kernel)
    full = shard = None  # type: ignore[assignment]  # only the pinned host copies remain
    if cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    reps = argparse.Namespace(**{**vars(args), "reps": args.stream_reps, "warmup": 1})
    if rank == 0:
        assert streamed_one is not None
        _reset_peak(dev)
        times, res = timed(
            lambda: search_sharded(streamed_one, queries, args.k, distributed=False), dev, reps, lockstep=False
        )
        rows.append(_streamed_row(1, times, reps, dev, streamed_one, _same(res, one), h2d))
        log(f"1 GPU streamed: median {rows[-1]['median_ms']:.1f} ms")
        del streamed_one
    dist.barrier()
    _reset_peak(dev)
    times, res = timed(
        lambda: search_sharded(streamed_many, queries, args.k, offset=a, n_docs=args.docs), dev, reps, lockstep=True
    )
    sizes: list[int | None] = [None] * world
    dist.all_gather_object(sizes, streamed_many.nbytes)
    if rank == 0:
        row = _streamed_row(world, times, reps, dev, streamed_many, _same(res, one), h2d)
        row["host_bytes"] = sum(s or 0 for s in sizes)
        rows.append(row)
        log(f"{world} GPUs streamed: median {row['median_ms']:.1f} ms")
        write(args, env, collection, rows)
    dist.barrier()
    dist.destroy_process_group()


def timed(
    fn: Callable[[], SearchResults], dev: torch.device, args: argparse.Namespace, *, lockstep: bool
) -> tuple[list[float], SearchResults]:
    """Milliseconds of ``args.reps`` calls after ``args.warmup`` (CUDA events on a GPU), and the
    last result. With ``lockstep`` every process makes the same calls, started by a barrier."""
    out = None
    for _ in range(args.warmup):
        out = fn()
    times = []
    for _ in range(args.reps):
        if lockstep:
            dist.barrier()
        _sync(dev)
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    assert out is not None
    return times, out


def _row(
    mode: str, gpus: int, times: list[float], args: argparse.Namespace, dev: torch.device, identical: bool
) -> dict:
    med = statistics.median(times)
    return {
        "mode": mode,
        "gpus": gpus,
        "batch": args.batch,
        "k": args.k,
        "median_ms": med,
        "min_ms": min(times),
        "times_ms": times,
        "qps": args.batch / (med / 1e3),
        "peak_device_bytes_process0": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "identical_to_1_gpu": identical,
    }


def _streamed_row(
    gpus: int,
    times: list[float],
    args: argparse.Namespace,
    dev: torch.device,
    index: StreamedIndex,
    identical: bool,
    h2d: float | None,
) -> dict:
    row = _row("streamed", gpus, times, args, dev, identical)
    moved = index.nbytes  # process 0's bytes copied per batch (every piece, once)
    row |= {
        "pieces": len(index.pieces),
        "host_bytes": moved,
        "copy_rate_process0_bytes_per_s": moved / (row["median_ms"] / 1e3),
        "pinned_h2d_bytes_per_s": h2d,
    }
    return row


def _same(res: SearchResults, ref: SearchResults | None) -> bool:
    if ref is None:
        return False
    return torch.equal(res.ids, ref.ids) and res.scores.numpy().tobytes() == ref.scores.numpy().tobytes()


def _nbytes(index: Index) -> int:
    return sum(t.numel() * t.element_size() for t in index.arrays().values())


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def _h2d_rate(dev: torch.device, n_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Pinned host-to-device copy rate in bytes/s (median of ``reps`` copies of ``n_bytes``)."""
    src = torch.empty(n_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    rates = []
    for _ in range(reps + 1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        rates.append(n_bytes / (e0.elapsed_time(e1) / 1e3))
    return statistics.median(rates[1:])


def write(args: argparse.Namespace, env: dict, collection: dict, rows: list[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    card = str(env.get("card", "cpu")).replace("NVIDIA ", "").replace(" ", "-")
    path = args.out / f"{dt.date.today().isoformat()}-{card}x{env['world_size']}-{args.name}.json"
    data = {"env": env, "config": vars(args) | {"out": str(args.out)}, "targets": MSMARCO_TARGETS}
    data |= {"collection": collection, "rows": rows}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nwrote {path}\n")
    print(f"{args.docs:,} documents, batch {args.batch}, k = {args.k}, {env['card']} ({env['backend']})")
    head = f"{'mode':<10}{'GPUs':>5}{'median ms':>12}{'QPS':>10}{'vs 1 GPU':>10}{'identical':>11}"
    print(f"{head}{'pieces':>8}{'GB/s':>8}")
    base = rows[0]["median_ms"]
    for r in rows:
        rate = r.get("copy_rate_process0_bytes_per_s")
        print(
            f"{r['mode']:<10}{r['gpus']:>5}{r['median_ms']:>12.1f}{r['qps']:>10,.0f}{base / r['median_ms']:>9.2f}x"
            f"{r['identical_to_1_gpu']!s:>11}{r.get('pieces', ''):>8}{'' if rate is None else f'{rate / 1e9:.1f}':>8}"
        )
    h2d = rows[-1].get("pinned_h2d_bytes_per_s")
    if h2d:
        print(f"pinned host-to-device copy rate: {h2d / 1e9:.1f} GB/s (GB/s above: process 0's streamed bytes / time)")
    print(
        f"1-GPU top-k equal to the reference kernel's on {collection.get('exact_sample')} queries: "
        f"{collection.get('exact_vs_reference')}"
    )


if __name__ == "__main__":
    main()
