"""Issue 23: does the dense phase pay as one tensor-core GEMM per group of tiles? (a prototype)

For 8-bit impacts and fixed-point float32 weights, and each ``--dense-mins`` threshold (the
layout stores a (tile, term) segment densely when it holds that share of the tile):

* the current engine's whole search (``Index.search`` of the batch, host to host, median of
  ``--reps``, k in ``--ks``) with that threshold (``EngineConfig.dense_min``), and a checksum
  of its results (equal across thresholds: every row exact);
* the layout: dense rows and their bytes, the share of postings they hold, and for the
  batch the (query, posting) pairs the GEMM would cover and those the sparse phase still reads
  (the kernel's sparse-phase work);
* every query's dense contribution for every document as GEMMs over groups of ``--group``
  consecutive tiles (``bench/dense_gemm_ops.py``: ``D_g [K, G·tile]`` over the union of the
  group's dense terms, zero rows where a tile holds the term sparsely, ``K`` padded to 16;
  ``Q_g [B, K]``), each exact in integers: ``fp16`` (limbs of ≤ 11 bits, float32
  accumulation, the bound Σ ≤ 2**24 checked per group; 8-bit levels need one GEMM) and
  ``int8`` (``torch._int_mm``, query limbs of 7 bits, document limbs of 8 offset by −128).
  ``gemm_ms``: the GEMM launches alone (CUDA events, median of ``--reps``, summed over the
  groups; the operands are built before, untimed); the output (``[n_q·B, G·tile]`` float32 or
  int32 per document limb) goes to device memory, as an unfused prototype's must.
  ``l2_ms``: the same over groups of ``--l2-group`` tiles, whose output may stay in L2 (what a
  kernel keeping the sums on chip would pay for the tensor-core work; a sample of
  ``--l2-sample`` groups captured in a CUDA graph, scaled to all tiles). The first and last
  groups' partial products are checked against float64 GEMMs (``exact``).

Usage (GPU machine; ~2-3 minutes, ~50 GB of device memory at 8.8M documents):

    python bench/dense_gemm.py --out $OUT/dense_gemm.json
    python bench/dense_gemm.py --docs 20000 --device cpu --reps 2 --group 2 --l2-group 1   # a smoke run anywhere

The JSON holds the environment, the command and one record per (weights, threshold); a
table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import dense_gemm_ops as ops
from gpu_peaks import gpu_memory
from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.config import override_config
from gpusparse.engines.tiled.engine import layout_for_search
from gpusparse.engines.tiled.fixed_point import fixed_point
from gpusparse.layout.statistics import max_scores_host
from gpusparse.queries import prepare_queries, query_batch
from gpusparse.streams import capture_stream
from gpusparse.synthetic import generate
from kernels import time_events
from search_timing import timed_search

KINDS = ("fp16", "int8")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_calls(fn, dev: torch.device, reps: int, graph: bool = False) -> tuple[float, str]:
    """Median ms of ``fn()`` (device time: CUDA events around the launches; host time on a CPU).
    ``graph``: the calls replayed from a captured CUDA graph (no launch gaps between small GEMMs)."""
    fn()  # warm-up (cuBLAS handles, workspaces)
    _sync(dev)
    if dev.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), "host"
    how = "events"
    run = fn
    if graph:
        try:
            side = capture_stream(dev)  # one per device: each new stream keeps a cuBLAS workspace
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(dev).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                fn()
            run, how = g.replay, "graph"
        except Exception:  # capture refused: eager launches (their gaps count)
            run = fn
    return statistics.median(time_events(run, reps=reps, warmup=0)), how


def query_ints(index, layout, batch, weights_kind: str) -> torch.Tensor:
    """``[B, V + 1]`` int64: the batch's integers for the GEMM (levels, or the kernel's fixed point)."""
    if weights_kind == "8-bit":
        levels, _ = ops.query_levels(batch.padded_weights)
        return ops.query_matrix(batch.padded_terms, levels, layout.n_terms)
    fp = fixed_point(index, batch, "u32", layout.weight_bits)
    return ops.query_matrix(batch.padded_terms, ops.fixed_query_ints(batch.padded_weights, fp.mult), layout.n_terms)


def doc_ints(layout, rows: torch.Tensor) -> torch.Tensor:
    return rows.to(torch.int64) if layout.weight_bits is None else ops.fixed_doc_ints(rows, layout.weight_bits)


def gemm_over_tiles(layout, q: torch.Tensor, kind: str, group: int, args, *, sample: int | None = None,
                    graph: bool = False, check: bool = False) -> dict:  # fmt: skip
    """Time ``kind``'s GEMMs over every group of ``group`` tiles (or the first ``sample`` groups,
    scaled to all tiles) and count their work."""
    dev = q.device
    row_start, row_term = ops.tile_dense_rows(layout)
    spans = ops.groups(layout.n_tiles, group)
    chosen = spans if sample is None else spans[:sample]
    ms = flops = out_bytes = in_bytes = slots = 0.0
    ks, kps, gemms, hows, bounds = [], [], [], set(), []
    exact = None
    for n, (t0, t1) in enumerate(chosen):
        g = ops.group_operand(layout.dense, row_start, row_term, t0, t1, pad=16)
        qg, dg = ops.group_queries(q, g), doc_ints(layout, g.rows)
        plan = ops.plan_fp16(qg, dg) if kind == "fp16" else ops.plan_int8(qg, dg)
        if kind == "fp16" and plan.gemms == 1:
            bounds.append(float((qg.to(torch.float64) @ dg.max(1).values.to(torch.float64)).max()))
        prep = ops.prepare(plan, qg, dg)
        if check and n in (0, len(chosen) - 1):
            exact = _check(prep, plan, qg, dg) and exact is not False
        del dg
        t, how = time_calls(prep.run, dev, args.reps, graph)
        ms += t
        hows.add(how)
        b, kp, width = q.shape[0], g.k_padded, g.rows.shape[1]
        flops += 2.0 * plan.n_q * b * kp * width * plan.n_d
        out_bytes += 4.0 * plan.n_q * b * width * plan.n_d
        in_bytes += float(sum(x.numel() * x.element_size() for x in prep.d_limbs))
        slots += float(kp * width)
        ks.append(g.k)
        kps.append(kp)
        gemms.append(plan.gemms)
        del prep, g, qg
    scale = layout.n_tiles / sum(t1 - t0 for t0, t1 in chosen)
    peak = (args.peak_tflops if kind == "fp16" else args.peak_tops_int8) * 1e12
    bw = args.bandwidth_tbs * 1e12
    return {
        # lower bounds on the card named by --peak-* and --bandwidth-tbs: output written (unfused), or kept on chip
        "roofline_ms": 1e3 * scale * max(flops / peak, (in_bytes + out_bytes) / bw),
        "roofline_fused_ms": 1e3 * scale * max(flops / peak, in_bytes / bw),
        "group_tiles": group, "groups_timed": len(chosen), "groups_all": len(spans), "timing": sorted(hows),
        "ms": ms * scale, "tflops": flops * scale / (ms * scale * 1e-3) / 1e12 if ms else None,
        "flop": flops * scale, "output_bytes": out_bytes * scale, "operand_bytes": in_bytes * scale,
        "operand_slots": slots * scale, "k_union_mean": statistics.mean(ks), "k_union_max": max(ks),
        "k_padded_mean": statistics.mean(kps), "gemms_per_group": sorted(set(gemms)),
        "bound_max_over_2_24": max(bounds) / ops.FP32_EXACT if bounds else None, "exact": exact,
    }  # fmt: skip


def _check(prep: ops.Prepared, plan: ops.Plan, q: torch.Tensor, d: torch.Tensor) -> bool:
    """Every partial product equals a float64 GEMM of the same limbs (exact: < 2**53)."""
    parts = prep.partials(prep.run())
    q_l, d_l = ops.limbs(q, plan.a, plan.n_q), ops.limbs(d, plan.b, plan.n_d)
    for i, row in enumerate(parts):
        for j, p in enumerate(row):
            want = (q_l[i].to(torch.float64) @ d_l[j].to(torch.float64)).to(torch.int64)
            if not torch.equal(p, want):
                return False
    return True


def coverage(index, layout, batch) -> dict:
    """Postings in dense rows, and the batch's (query, posting) pairs: dense (the GEMM's) and sparse."""
    nt, v = layout.n_tiles, layout.n_terms
    sparse_per_term = torch.zeros(v, dtype=torch.int64, device=layout.seg.device)
    dense_tiles = torch.zeros(v, dtype=torch.int64, device=layout.seg.device)
    for t0 in range(0, nt, 64):
        t1 = min(nt, t0 + 64)
        seg = layout.seg[t0 * (v + 1) : t1 * (v + 1)].view(t1 - t0, v + 1).to(torch.int64)  # per tile
        sparse_per_term += (seg[:, 1:] - seg[:, :-1]).sum(0)
        dense_tiles += (layout.dense_id[t0 * v : t1 * v].view(t1 - t0, v) >= 0).sum(0)
    lengths = index.lengths.to(torch.int64).to(sparse_per_term.device)
    dense_per_term = lengths - sparse_per_term
    terms = batch.padded_terms.to(sparse_per_term.device)
    valid = terms >= 0
    tt = torch.where(valid, terms, 0).to(torch.int64)
    pairs = int((lengths[tt] * valid).sum())
    dense_pairs = int((dense_per_term[tt] * valid).sum())
    total = int(lengths.sum())
    slots = layout.dense.numel()
    return {
        "postings": total, "dense_postings": int(dense_per_term.sum()),
        "dense_share_of_postings": int(dense_per_term.sum()) / total if total else 0.0,
        "n_dense_rows": layout.n_dense, "dense_rows_per_tile": layout.n_dense / nt,
        "dense_row_bytes": slots * layout.dense.element_size(),
        "sparse_bytes": sum(t.numel() * t.element_size() for t in (layout.offs, layout.wts)),
        "packed": layout.packed,
        "dense_slot_occupancy":
        int(dense_per_term.sum()) / slots if slots else 0.0, "layout_bytes": layout.nbytes,
        "batch_pairs": pairs, "batch_dense_pairs": dense_pairs, "batch_sparse_pairs": pairs - dense_pairs,
        "batch_dense_share": dense_pairs / pairs if pairs else 0.0,
        "dense_rows_per_block": float((dense_tiles[tt] * valid).sum()) / (terms.shape[0] * nt),
        "sparse_postings_per_block": (pairs - dense_pairs) / (terms.shape[0] * nt),
    }  # fmt: skip


def search_times(index, queries, args) -> dict:
    return {str(k): timed_search(index, queries, k, args.batch, args.reps) for k in args.ks}


def phase_times(index, queries, args) -> dict:
    """The whole search at the first k with the kernel's dense or sparse phase compiled out
    (``PROFILE_SKIP_*``: results wrong, times indicative): what each phase costs today."""
    from gpusparse.kernels import tile_candidates
    from gpusparse.kernels.cupy_launch import variant

    k, out = args.ks[0], {}
    for name, define in (("skip_dense", "PROFILE_SKIP_DENSE"), ("skip_sparse", "PROFILE_SKIP_SPARSE")):
        with variant(tile_candidates.SOURCE, defines=(define,)):
            index.search(queries, k, batch_size=args.batch)  # compiles the variant
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                index.search(queries, k, batch_size=args.batch)
                times.append((time.perf_counter() - t0) * 1e3)
        out[f"search_ms_{name}"] = statistics.median(times)
    return {"k": k, **out}


def run_weights(weights_kind: str, args) -> list[dict]:
    dev = torch.device(args.device)
    docs, qcsr = generate(args.docs, args.batch, seed=args.seed, device=dev)
    vocab = Vocabulary.bert()
    queries = SparseCollection(qcsr[0].cpu().numpy(), qcsr[1].cpu().numpy(), qcsr[2].cpu().numpy(), vocab=vocab)
    index = Index.from_csr(*docs, vocab, device=dev, quantize=8 if weights_kind == "8-bit" else None)
    del docs, qcsr
    prepared = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    batch = query_batch(prepared, dev)
    rows = []
    for dm in args.dense_mins:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        row: dict = {"weights": weights_kind, "dense_min": dm}
        with override_config(dense_min=dm):
            row["search"] = search_times(index, queries, args)
            if dev.type == "cuda" and not args.no_phases:
                row["phases"] = phase_times(index, queries, args)
            layout = layout_for_search(index)  # the search's own (built by it on a GPU), or built now
        row["layout"] = coverage(index, layout, batch)
        q = query_ints(index, layout, batch, weights_kind)
        row["gemm"] = {}
        for kind in KINDS:
            row["gemm"][kind] = gemm_over_tiles(layout, q, kind, args.group, args, check=True)
            # (query, posting) pairs of the batch in dense rows, per (query, slot) the GEMM multiplies
            macs = q.shape[0] * row["gemm"][kind]["operand_slots"]
            row["gemm"][kind]["useful_share"] = row["layout"]["batch_dense_pairs"] / macs if macs else None
            row["gemm"][kind]["l2"] = gemm_over_tiles(layout, q, kind, args.l2_group, args, sample=args.l2_sample,
                                                      graph=True)  # fmt: skip
        if dev.type == "cuda":
            row["peak_allocated"] = torch.cuda.max_memory_allocated(dev)
            row["gpu_memory"] = gpu_memory(dev)  # every allocator: PyTorch's pool and CuPy's (the engine's kernels)
        rows.append(row)
        print(_line(row), flush=True)
        del layout, q
        index.derived.layouts.clear()
        index.derived.graphs.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    del index, batch
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _line(r: dict) -> str:
    lay = r["layout"]
    s = "  ".join(f"k={k} {v['median_ms']:.2f} ms" for k, v in r["search"].items())
    if "phases" in r:
        p, full = r["phases"], r["search"][str(r["phases"]["k"])]["median_ms"]
        s += f" (dense phase ~{full - p['search_ms_skip_dense']:.2f}, sparse ~{full - p['search_ms_skip_sparse']:.2f})"
    g = "  ".join(f"{kind} {v['ms']:.2f} ms (L2 {v['l2']['ms']:.2f}, {v['gemms_per_group']} GEMMs, exact {v['exact']})"
                  for kind, v in r["gemm"].items())  # fmt: skip
    rows_gb = lay["dense_row_bytes"] / 1e9
    return (f"{r['weights']:8} dense>={r['dense_min']:<5} search {s} | dense rows {rows_gb:.2f} GB, "
            f"{lay['dense_share_of_postings']:.0%} of postings, {lay['batch_dense_share']:.0%} of the batch's pairs, "
            f"sparse pairs {lay['batch_sparse_pairs'] / 1e9:.2f}e9 | GEMM {g}")  # fmt: skip


def table(rows: list[dict]) -> str:
    """The short table printed last (ms: device medians; "bound": the roofline with the output kept on chip)."""
    head = [
        "weights", "dense_min", "search ms (k)", "dense / sparse phase ms", "dense rows GB", "postings dense",
        "batch pairs dense", "sparse postings / block", "K", "fp16 GEMM ms (L2, bound)", "int8 GEMM ms (L2, bound)",
        "GEMMs fp16 / int8", "exact",
    ]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lay, g = r["layout"], r["gemm"]
        search = ", ".join(f"{v['median_ms']:.2f} ({k})" for k, v in r["search"].items())
        phases = "-"
        if "phases" in r:
            p, full = r["phases"], r["search"][str(r["phases"]["k"])]["median_ms"]
            phases = f"{full - p['search_ms_skip_dense']:.2f} / {full - p['search_ms_skip_sparse']:.2f}"
        cells = [
            r["weights"], str(r["dense_min"]), search, phases, f"{lay['dense_row_bytes'] / 1e9:.2f}",
            f"{lay['dense_share_of_postings']:.1%}", f"{lay['batch_dense_share']:.1%}",
            f"{lay['sparse_postings_per_block']:.0f}", f"{g['fp16']['k_padded_mean']:.0f}",
            *(f"{g[k]['ms']:.2f} ({g[k]['l2']['ms']:.2f}, {g[k]['roofline_fused_ms']:.2f})" for k in KINDS),
            " / ".join(str(g[k]["gemms_per_group"]) for k in KINDS), " / ".join(str(g[k]["exact"]) for k in KINDS),
        ]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _same(rows: list[dict]) -> dict[str, bool]:
    """Per weight type: whether every threshold's search returned the same results (checksums)."""
    sums: dict[str, set] = {}
    for r in rows:
        sums.setdefault(r["weights"], set()).add(tuple(sorted((k, v["checksum"]) for k, v in r["search"].items())))
    return {w: len(s) == 1 for w, s in sums.items()}


def _env(args) -> dict:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dev = torch.device(args.device)
    return {
        "commit": head or None, "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})",
        "python": platform.python_version(),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8_841_823)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ks", type=int, nargs="+", default=[1000, 10])
    ap.add_argument("--dense-mins", type=float, nargs="+", default=[0.12, 0.05, 0.02])
    ap.add_argument("--weights", nargs="+", choices=["8-bit", "float32"], default=["8-bit", "float32"])
    ap.add_argument("--group", type=int, default=16, help="tiles per GEMM (output to device memory)")
    ap.add_argument("--l2-group", type=int, default=2, help="tiles per GEMM whose output may stay in L2")
    ap.add_argument("--l2-sample", type=int, default=24, help="groups of --l2-group timed (scaled to all tiles)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=990.0, help="fp16 dense tensor-core peak (H100 SXM)")
    ap.add_argument("--peak-tops-int8", type=float, default=1979.0, help="int8 dense tensor-core peak (H100 SXM)")
    ap.add_argument("--bandwidth-tbs", type=float, default=3.35, help="device memory bandwidth (H100 SXM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-phases", action="store_true", help="skip the searches with a kernel phase compiled out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for w in args.weights:
        rows += run_weights(w, args)
    report = {"env": {**_env(args), "fp16_gemm": ops.FP16_PATH["path"]}, "docs": args.docs, "batch": args.batch,
              "ks": args.ks, "group": args.group, "l2_group": args.l2_group, "seconds": time.perf_counter() - t0,
              "results": rows, "same_results": _same(rows)}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({"same_results": report["same_results"], "seconds": round(report["seconds"], 1)}))
    print(table(rows))


if __name__ == "__main__":
    main()
