"""Where the tiled engine's time goes: kernel vs host-side finishing, per tile size and k.

Usage (GPU machine): python bench/profile_tiled.py --out $OUT --commit SHA [--sizes 1000000]
Writes ``<out>/<date>-<card>-profile-tiled.json`` and prints a table last.

Kernel variants (``--threads``, ``--unroll``, ``--min-blocks``, ``--phases``) are passed to
the launcher as arguments; the whole search (``search_ms``) runs the engine's own launches, at
the launcher's default shape whatever the swept one, and ``--search-phases`` compiles the
phases out of it by :func:`gpusparse.kernels.cupy_launch.variant`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.engines.tiled.engine import tiled_search
from gpusparse.engines.tiled.fixed_point import fixed_point, kernel_scale
from gpusparse.engines.tiled.waves import initial_capacity
from gpusparse.kernels import tile_candidates
from gpusparse.kernels.cupy_launch import variant
from gpusparse.layout.tiled import tiled_layout
from gpusparse.quantize import quantize_queries
from gpusparse.queries import query_batch
from gpusparse.synthetic import generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_peaks import gpu_memory
from host_primitives import host_us
from kernels import time_events  # bench/kernels.py: one timing helper for both scripts


def events(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` by CUDA events."""
    return statistics.median(time_events(fn, reps=reps, warmup=warmup))


def wall(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` including host work (host to host, synchronised)."""
    return host_us(fn, reps, sync=True, warmup=warmup) / 1e3


def run_kernel(tl, batch, terms32, fp, k, bufs, acc, **build) -> None:
    """One launch of the tiled kernel into preallocated candidate buffers; ``build``: the
    launcher's build knobs (threads, unroll, min_blocks, defines)."""
    theta, count, cand_doc, cand_val = bufs
    theta.zero_()
    count.zero_()
    q_scale = kernel_scale(tl, fp)
    tile_candidates.tiled_candidates(
        tl, terms32, batch.padded_weights, q_scale, fp.delta, k=k, acc=acc, q_shift=fp.shift,
        int_weights=tl.quantized,
        theta=theta, cand_count=count, cand_doc=cand_doc, cand_val=cand_val, **build,
    )  # fmt: skip


def trace(fn, label: str) -> None:
    """Top operators of one call by device time, and by host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- trace {label}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40))


def resolved_search(*args, **kwargs):
    """:func:`tiled_search` with its flagged rows searched again (its one host sync)."""
    return tiled_search(*args, **kwargs).resolved()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    p.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--tile-bits", type=int, nargs="+", default=[13, 14])
    p.add_argument("--threads", type=int, nargs="+", default=[0], help="0 = the launcher's choice")
    p.add_argument("--unroll", type=int, nargs="+", default=[4])
    p.add_argument("--min-blocks", type=int, nargs="+", default=[0], help="0 = the launcher's choice")
    p.add_argument("--dense-min", type=float, nargs="+", default=[0.25], help="0 = all sparse")
    p.add_argument("--acc", nargs="+", default=["carry", "u32"], help="accumulator modes (ACC_MODES)")
    p.add_argument("--quantize", type=int, nargs="+", default=[0], help="0 = float32 weights, 8 = 8-bit impacts")
    p.add_argument("--fixed", type=int, nargs="+", default=[0], help="1 = fixed-point float32 weights (u32 only)")
    p.add_argument(
        "--phases", action="store_true", help="also time the kernel without its dense / sparse phase (wrong results)"
    )
    p.add_argument(
        "--search-phases",
        action="store_true",
        help="also time the whole search with the dense / sparse / both phases skipped (wrong results)",
    )
    p.add_argument("--check", action="store_true", help="check each search against the reference kernel")
    p.add_argument("--trace", action="store_true", help="print torch.profiler's top ops for one search")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    rows = []
    vocab = Vocabulary.bert()
    for n, qbits in [(n, qb) for n in args.sizes for qb in args.quantize]:
        (di, dt_, dw), (qi, qt, qw) = generate(n, max(args.batches), seed=0, device="cuda")
        index = Index.from_csr(di, dt_, dw, vocab, device="cuda", quantize=qbits or None)
        del di, dt_, dw
        queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
        if qbits:
            queries = quantize_queries(queries, qbits)
        for tb, dm, fx in [(tb, dm, fx) for tb in args.tile_bits for dm in args.dense_min for fx in args.fixed]:
            if fx and qbits:
                continue
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tl = tiled_layout(index, tb, dm or None, bool(fx))
            torch.cuda.synchronize()
            build_s = time.perf_counter() - t0
            for b in args.batches:
                batch = query_batch(queries[:b], index.device)
                terms32 = batch.padded_terms.to(torch.int32).contiguous()
                for k, acc in [(k, a) for k in args.ks for a in args.acc]:
                    if fx and acc != "u32":
                        continue
                    fp = fixed_point(index, batch, acc, tl.weight_bits)
                    ref = index.search(queries[:b], k, kernel="scatter") if args.check else None
                    cap = initial_capacity(k, tl.n_tiles)  # one launch over all tiles
                    theta = torch.zeros(b, dtype=torch.int64, device="cuda")
                    count = torch.zeros(b, dtype=torch.int32, device="cuda")
                    cand_doc = torch.empty((b, cap), dtype=torch.int32, device="cuda")
                    cand_val = torch.empty((b, cap), dtype=torch.int64, device="cuda")
                    combos = [(t, u, mb) for t in args.threads for u in args.unroll for mb in args.min_blocks]
                    for threads, unroll, min_blocks in combos:
                        shape = {"threads": threads or None, "unroll": unroll, "min_blocks": min_blocks or None}
                        bufs = (theta, count, cand_doc, cand_val)
                        launch = partial(run_kernel, tl, batch, terms32, fp, k, bufs, acc, **shape)
                        k_ms = events(launch)
                        phase_ms = {}
                        if args.phases:
                            for skip in ("PROFILE_SKIP_DENSE", "PROFILE_SKIP_SPARSE"):
                                without = partial(launch, defines=(skip,))
                                phase_ms[skip.removeprefix("PROFILE_").lower()] = events(without)
                        launch()
                        torch.cuda.synchronize()
                        c = count.to(torch.float64)

                        search = partial(
                            resolved_search,
                            index,
                            batch,
                            k,
                            tile_bits=tb,
                            dense_min=dm or None,
                            acc=acc,
                            fixed=bool(fx),
                        )

                        full_ms = wall(search)
                        if args.search_phases:
                            for name, defs in (
                                ("skip_dense", ("PROFILE_SKIP_DENSE",)),
                                ("skip_sparse", ("PROFILE_SKIP_SPARSE",)),
                                ("skip_both", ("PROFILE_SKIP_DENSE", "PROFILE_SKIP_SPARSE")),
                            ):
                                with variant(tile_candidates.SOURCE, defines=defs):
                                    phase_ms[f"search_ms_{name}"] = wall(search)
                        exact = None
                        if ref is not None:
                            s_, i_ = search()
                            exact = bool(torch.equal(i_.cpu(), ref.ids) and torch.equal(s_.cpu(), ref.scores))
                        if args.trace:
                            trace(search, f"B={b} k={k} tile=2^{tb} dense>={dm}")
                        rows.append(
                            {
                                "n_docs": n,
                                "tile_bits": tb,
                                "dense_min": dm,
                                "dense_segments": tl.dense.shape[0],
                                "threads": threads,
                                "unroll": unroll,
                                "min_blocks": min_blocks,
                                "batch_size": b,
                                "k": k,
                                "acc": acc,
                                "quantize_bits": qbits,
                                "fixed_weights": bool(fx),
                                "exact": exact,
                                "kernel_ms": k_ms,
                                **{(n if n.startswith("search") else f"kernel_ms_{n}"): v for n, v in phase_ms.items()},
                                "search_ms": full_ms,
                                "candidates_mean": float(c.mean()),
                                "candidates_max": float(c.max()),
                                "build_s": build_s,
                                "tiled_bytes": tl.nbytes,
                            }
                        )
                        print(
                            f"N={n:,} q{qbits} fixed={fx} tile=2^{tb} dense>={dm} threads={threads} unroll={unroll} "
                            f"min_blocks={min_blocks} B={b} k={k} acc={acc}: "
                            f"kernel {k_ms:.2f} ms "
                            + " ".join(f"{name} {v:.2f}" for name, v in phase_ms.items())
                            + f", exact {exact}, "
                            f"search {full_ms:.2f} ms, candidates mean {c.mean():.0f} max {c.max():.0f}",
                            flush=True,
                        )
            index.derived.reset()
        torch.cuda.empty_cache()
    card = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-")
    path = args.out / f"{dt.date.today().isoformat()}-{card}-profile-tiled.json"
    env = {
        "card": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "git_commit": args.commit,
        "command": "python bench/profile_tiled.py " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu_memory": gpu_memory(),  # over every allocator, at the end (bench/gpu_peaks.py)
    }
    path.write_text(json.dumps({"env": env, "results": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
