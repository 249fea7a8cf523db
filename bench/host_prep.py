"""Host time of a small batch's preparation before its CUDA graph is launched (issue 23), old
code against the current code in the same run, on the CPU (no device needed).

Usage:
    python bench/host_prep.py --out F.json [--old a93d098] [--reps 2000] [--n-docs 20000]

The steps of ``Index.search`` → ``graphed_batch_search`` up to the launch, each timed alone
(median of ``--reps`` calls, perf_counter_ns, old and new calls interleaved so both see the same
machine): ``prepare_queries`` (as_queries, 8-bit quantisation, the score bound check),
``padded_host`` (to the graph's width), ``fixed_point_host``, ``integer_weights_host``, the
staging ``_fill``, and the whole chain. Batches of B = 1, 8, 256 calibrated synthetic queries,
float32 and 8-bit indexes of ``--n-docs`` documents built on the CPU. The old functions are
those of ``--old`` (``git show``), loaded as modules beside the current package so that both
read the same collections, indexes and layouts; every output is checked bit-identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpusparse import Index, SparseCollection, Vocabulary  # noqa: E402
from gpusparse import queries as queries_new  # noqa: E402
from gpusparse.engines.tiled import fixed_point as fp_new  # noqa: E402
from gpusparse.engines.tiled import graphs as graphs_new  # noqa: E402
from gpusparse.engines.tiled.engine import layout_for_search  # noqa: E402
from gpusparse.layout.statistics import max_scores_host  # noqa: E402
from gpusparse.synthetic import generate  # noqa: E402

# (module path in the package, the name it is loaded under, source replacements)
OLD_MODULES = (
    ("gpusparse/quantize.py", "gpusparse._old_quantize", ()),
    ("gpusparse/queries.py", "gpusparse._old_queries", (("from .quantize import", "from ._old_quantize import"),)),
    ("gpusparse/engines/tiled/fixed_point.py", "gpusparse.engines.tiled._old_fixed_point", ()),
    ("gpusparse/engines/tiled/graphs.py", "gpusparse.engines.tiled._old_graphs", ()),
)


def load_old(commit: str) -> dict:
    """The modules of :data:`OLD_MODULES` at ``commit``, loaded inside the current package (their
    relative imports reach the current modules, so both versions share its classes)."""
    out = {}
    for path, name, edits in OLD_MODULES:
        src = subprocess.run(["git", "show", f"{commit}:src/{path}"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout  # fmt: skip
        for a, b in edits:
            src = src.replace(a, b)
        spec = importlib.util.spec_from_loader(name, loader=None)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = name.rsplit(".", 1)[0]
        sys.modules[name] = module
        exec(compile(src, f"<{commit}:{path}>", "exec"), module.__dict__)
        out[name.rsplit("._old_", 1)[-1]] = module
    return out


def chain(qmod, fpmod, gmod, index, layout, queries, acc: str, views: dict) -> dict:
    """One batch's host preparation, as ``graphed_batch_search`` runs it; each step's output."""
    q = qmod.prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    terms, weights, lengths = qmod.padded_host(q, graphs_new.query_width)
    params = fpmod.fixed_point_host(index, terms, weights, lengths, acc, layout.weight_bits)
    int_w = fpmod.integer_weights_host(layout, weights, params["scale"], acc)
    gmod._fill(views, terms, weights, params)
    return {"q": q, "padded": (terms, weights, lengths), "params": params, "int_w": int_w}


def staging_views(b: int, width: int, names: tuple) -> dict:
    shapes = {"bw": (b, width), "b": (b,)}
    fields, size = graphs_new._fields([(n, d, shapes[s]) for n, d, s in graphs_new.INPUTS if n in names])
    buf = np.zeros(size, dtype=np.uint8)
    return {n: graphs_new._numpy_view(buf, spec) for n, spec in fields.items()}


def same(a: dict, b: dict) -> None:
    """Old and new outputs bit-identical (raises otherwise)."""
    qa, qb = a["q"], b["q"]
    for x, y in ((qa.indptr, qb.indptr), (qa.indices, qb.indices), (qa.values, qb.values), *zip(a["padded"],
                 b["padded"], strict=True)):  # fmt: skip
        if x.dtype != y.dtype or not np.array_equal(x, y):
            raise AssertionError("old and new outputs differ")
    if qa.ids != qb.ids or a["int_w"] != b["int_w"] or a["params"].keys() != b["params"].keys():
        raise AssertionError("old and new outputs differ")
    for n in a["params"]:
        x, y = a["params"][n], b["params"][n]
        if x.dtype != y.dtype or x.tobytes() != y.tobytes():
            raise AssertionError(f"old and new {n} differ")


def time_pairs(calls: dict, reps: int) -> dict:
    """Median and spread (10th, 90th percentile) microseconds of each call, calls interleaved."""
    times: dict = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter_ns()
            fn()
            times[name].append((time.perf_counter_ns() - t0) / 1e3)
    out = {}
    for name, v in times.items():
        q = statistics.quantiles(v, n=10)
        out[name] = {"median": statistics.median(v), "p10": q[0], "p90": q[-1]}
    return out


def bench_case(mods: dict, index, layout, queries: SparseCollection, b: int, acc: str, reps: int) -> dict:
    q = queries[0:b]
    old = mods
    new = {"queries": queries_new, "fixed_point": fp_new, "graphs": graphs_new}
    ref = chain(old["queries"], old["fixed_point"], old["graphs"], index, layout, q, acc, {})
    terms, weights, lengths = ref["padded"]
    views = {v: staging_views(b, terms.shape[1], (*ref["params"], "terms", "weights")) for v in ("old", "new")}
    ref = chain(old["queries"], old["fixed_point"], old["graphs"], index, layout, q, acc, views["old"])
    got = chain(new["queries"], new["fixed_point"], new["graphs"], index, layout, q, acc, views["new"])
    same(ref, got)
    for n in views["old"]:
        if views["old"][n].tobytes() != views["new"][n].tobytes():
            raise AssertionError(f"old and new staging of {n} differ")
    ms = max_scores_host(index)
    prepared = ref["q"]
    params = ref["params"]
    calls = {}
    for tag, m in (("old", old), ("new", new)):
        qm, fm, gm = m["queries"], m["fixed_point"], m["graphs"]
        calls.update({
            f"prepare_queries {tag}": lambda qm=qm: qm.prepare_queries(q, index.vocab, index.quantization, ms),
            f"padded_host {tag}": lambda qm=qm: qm.padded_host(prepared, graphs_new.query_width),
            f"fixed_point_host {tag}": lambda fm=fm: fm.fixed_point_host(index, terms, weights, lengths, acc,
                                                                         layout.weight_bits),
            f"integer_weights_host {tag}": lambda fm=fm: fm.integer_weights_host(layout, weights, params["scale"], acc),
            f"_fill {tag}": lambda gm=gm, tag=tag: gm._fill(views[tag], terms, weights, params),
            f"total {tag}": lambda qm=qm, fm=fm, gm=gm, tag=tag: chain(qm, fm, gm, index, layout, q, acc, views[tag]),
        })  # fmt: skip
    return time_pairs(calls, reps)


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", default="a93d098", help="the commit whose functions are the baseline")
    p.add_argument("--n-docs", type=int, default=20_000)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 256])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    mods = load_old(args.old)
    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n_docs, max(args.batches), seed=0)
    queries = SparseCollection(qi.numpy(), qt.numpy(), qw.numpy(), vocab=vocab)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())  # fmt: skip
    out = {"machine": f"{platform.node()}: {cpu_model()}, {os.cpu_count()} cores (shared), CPU only",
           "python": platform.python_version(), "numpy": np.__version__, "commit": commit + ("+dirty" if dirty else ""),
           "old": args.old, "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
           "unit": "microseconds a call (median, p10, p90)", "rows": []}  # fmt: skip
    acc = "u32"  # the default accumulator (EngineConfig.accumulator)
    for bits in (0, 8):
        index = Index.from_csr(di, dt_, dw, vocab, device="cpu", quantize=bits or None)
        layout = layout_for_search(index, acc=acc)
        for b in args.batches:
            row = {"weights": "8-bit" if bits else "float32", "batch": b,
                   **bench_case(mods, index, layout, queries, b, acc, args.reps)}  # fmt: skip
            out["rows"].append(row)
            print(json.dumps({"weights": row["weights"], "batch": b}), flush=True)
    args.out.write_text(json.dumps(out, indent=2))
    steps = ("prepare_queries", "padded_host", "fixed_point_host", "integer_weights_host", "_fill", "total")
    print(f"{'weights':8} {'B':>4} " + " ".join(f"{s[:16]:>22}" for s in steps))
    for r in out["rows"]:
        cells = []
        for s in steps:
            o, n = r[f"{s} old"]["median"], r[f"{s} new"]["median"]
            cells.append(f"{o:8.1f} → {n:7.1f} ({n / o:4.2f})")
        print(f"{r['weights']:8} {r['batch']:>4} " + " ".join(f"{c:>22}" for c in cells))
    print("spread of the totals (p10-p90 µs): " + "; ".join(
        f"{r['weights']} B={r['batch']} old {r['total old']['p10']:.1f}-{r['total old']['p90']:.1f}, "
        f"new {r['total new']['p10']:.1f}-{r['total new']['p90']:.1f}" for r in out["rows"]))  # fmt: skip


if __name__ == "__main__":
    main()
