"""The tiled kernel's launch shape at small batches (issue 23: batch-1 latency), one call.

Usage (GPU machine):
    python bench/launch_shape.py --out $OUT/launch_shape.json --commit SHA [--n 8841823]
        [--batches 1 8] [--shapes 0x0 512x2] [--defines "" PROFILE_SKIP_DENSE]

At batch 1 the kernel runs one block per tile (1,080 at 8.8M documents) on 132 SMs: with 4
resident blocks an SM that is 2.05 rounds of blocks, i.e. three rounds of block time. This times
the kernel alone (one launch over all tiles with each block's own selection, as a small batch's
single wave runs it) for several ``(threads, min_blocks)`` builds, on the layout the engine
searches (float32 fixed point and 8-bit levels), at the batches given, and checks that every
build's candidates hold the same k best as the first one's. Ten launches are captured in a CUDA
graph (the host's launch is not timed: an earlier version timed events around each launch from
Python, which on a slow host measured the host) and the builds' graphs are replayed in turn
``--reps`` times (CUDA events, median). ``--shapes`` picks the builds (``THREADSxMIN_BLOCKS``;
0x0: the launcher's choice), ``--defines`` adds builds with extra ``-D`` names (comma-separated;
``LISTS``: the dense terms read from the index's lists, on a float32 fixed-point layout),
each with every shape. GPU bytes over every
allocator are recorded (bench/gpu_peaks.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_peaks import gpu_memory  # noqa: E402
from gpusparse import Index, SparseCollection, Vocabulary  # noqa: E402
from gpusparse.engines.tiled.device import dense_lists  # noqa: E402
from gpusparse.engines.tiled.engine import layout_for_search  # noqa: E402
from gpusparse.engines.tiled.fixed_point import fixed_point, integer_weights, kernel_scale  # noqa: E402
from gpusparse.engines.tiled.waves import initial_capacity  # noqa: E402
from gpusparse.kernels import tile_candidates  # noqa: E402
from gpusparse.layout.statistics import max_scores_host  # noqa: E402
from gpusparse.queries import prepare_queries, query_batch  # noqa: E402
from gpusparse.synthetic import generate  # noqa: E402
from kernels import time_events  # noqa: E402

SHAPES = [(0, 0), (256, 5), (512, 3), (512, 2), (1024, 2), (1024, 1)]  # (0, 0): the launcher's default


def candidates(layout, batch, fp, int_w, k, shape=(0, 0), defines=(), lists=None) -> tuple[callable, tuple]:
    """A launch of the kernel over all tiles into fresh buffers, and those buffers; ``shape``:
    ``(threads, min_blocks)`` (0: the launcher's), ``defines``: extra ``-D`` names of the build,
    ``lists``: the dense terms read from the index's lists (the DENSE_LISTS build)."""
    b = batch.padded_terms.shape[0]
    cap = initial_capacity(k, layout.n_tiles)
    dev = layout.seg.device
    theta = torch.zeros(b, dtype=torch.int64, device=dev)
    count = torch.zeros(b, dtype=torch.int32, device=dev)
    cand_doc = torch.full((b, cap), -3, dtype=torch.int32, device=dev)
    cand_val = torch.full((b, cap), -3, dtype=torch.int64, device=dev)
    terms32 = batch.padded_terms.to(torch.int32).contiguous()
    q_scale = kernel_scale(layout, fp)
    threads, min_blocks = shape

    def run() -> None:
        theta.zero_()
        count.zero_()
        tile_candidates.tiled_candidates(
            layout, terms32, batch.padded_weights, q_scale, fp.delta, k=k, acc="u32", int_weights=int_w,
            q_shift=fp.shift, theta=theta, cand_count=count, cand_doc=cand_doc, cand_val=cand_val,
            threads=threads or None, min_blocks=min_blocks or None, defines=defines, lists=lists,
        )  # fmt: skip

    return run, (count, cand_doc, cand_val)


PER_GRAPH = 10  # launches captured in one graph: the host's launch time is not timed


def captured(fn, n: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``n`` calls of ``fn`` (each a launch and its buffers' reset)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def emitted(bufs, k: int) -> list[list[tuple]]:
    """Each row's k best candidates as (-value, doc), ranked: blocks raise a shared threshold as
    they finish, so which candidates besides those are emitted depends on the blocks' order."""
    count, docs, vals = (x.cpu() for x in bufs)
    rows = []
    for r in range(count.shape[0]):
        n = int(count[r])
        rows.append(sorted(zip((-vals[r, :n]).tolist(), docs[r, :n].tolist(), strict=True))[:k])
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8_841_823)
    p.add_argument("--quantize", type=int, nargs="+", default=[0, 8])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--no-check", action="store_true", help="skip the candidates' comparison (slow at large batches)")
    p.add_argument("--shapes", nargs="+", default=None, help="THREADSxMIN_BLOCKS builds (0x0: the default)")
    p.add_argument("--defines", nargs="+", default=[""], help="extra -D names of a build, comma-separated, per build")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n, max(args.batches), seed=0, device="cuda")
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    out = {"card": torch.cuda.get_device_name(0), "commit": args.commit, "n_docs": args.n, "k": args.k,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": []}  # fmt: skip
    for bits in args.quantize:
        index = Index.from_csr(di, dt_, dw, vocab, device="cuda", quantize=bits or None)
        layout = layout_for_search(index)
        label = "8-bit" if bits else "float32"
        for b in args.batches:
            q = prepare_queries(queries[0:b], index.vocab, index.quantization, max_scores_host(index))
            batch = query_batch(q, index.device)
            fp = fixed_point(index, batch, "u32", layout.weight_bits)
            int_w = integer_weights(layout, batch, fp, "u32")
            want, builds = None, []
            for shape, ds in [(s, tuple(d for d in v.split(",") if d)) for v in args.defines for s in shapes]:
                lists = None
                if "LISTS" in ds:  # not a -D name: the DENSE_LISTS build, where the layout allows it
                    ds = tuple(d for d in ds if d != "LISTS")
                    lists = dense_lists(index, layout, 1)
                    if lists is None:
                        continue
                run, bufs = candidates(layout, batch, fp, int_w, args.k, shape, ds, lists)
                try:
                    run()  # compiled, and its candidates checked, outside the graph
                    graph = captured(run, PER_GRAPH)
                except Exception as e:  # a shape the kernel cannot launch (registers, shared memory)
                    out["rows"].append({"weights": label, "batch": b, "shape": shape, "defines": list(ds),
                                        "error": str(e)[:200]})  # fmt: skip
                    print(label, b, shape, ds, "error", str(e)[:200], flush=True)
                    continue
                got = None if args.no_check else emitted(bufs, args.k)
                want = want if want is not None else got
                names = list(ds) + (["LISTS"] if lists else [])
                row = {"weights": label, "batch": b, "shape": list(shape), "defines": names,
                       "same_top_k_as_default": None if args.no_check else got == want,
                       "candidates": int(bufs[0].sum())}  # fmt: skip
                builds.append((row, graph, run))  # run's closure holds the buffers the graph writes
            # the builds' graphs replayed in turn, round after round: drift of the device's clocks
            # or of the host between builds affects all alike
            times: list[list[float]] = [[] for _ in builds]
            for _ in range(args.reps):
                for i, (_, graph, _run) in enumerate(builds):
                    times[i].append(time_events(graph.replay, reps=1, warmup=0)[0] / PER_GRAPH)
            for (row, _, _run), t in zip(builds, times, strict=True):
                row["kernel_ms"] = statistics.median(t)
                row["kernel_ms_quartiles"] = statistics.quantiles(t, n=4)
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
        out[f"gpu_memory_{label}"] = gpu_memory()
        del index, layout
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=2))
    print(f"{'weights':8} {'B':>3} {'threads':>7} {'blocks':>6} {'defines':>12} {'kernel ms':>9} same")
    for r in out["rows"]:
        if "kernel_ms" in r:
            t, m = r["shape"]
            d = ",".join(r["defines"]) or "-"
            print(f"{r['weights']:8} {r['batch']:>3} {t or 'dflt':>7} {m or 'dflt':>6} {d:>12} {r['kernel_ms']:9.4f} "
                  f"{r['same_top_k_as_default']}")  # fmt: skip


if __name__ == "__main__":
    main()
