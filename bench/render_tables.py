"""Render every performance, memory and quality table of the docs, and the plots, from results.

Each table in ``README.md`` and ``docs/**/*.md`` sits between ``<!-- table:NAME -->`` and
``<!-- /table -->``; its content is rendered here from the newest committed result file under
``bench/results/`` that measured it (newest by the date the file records). The plots go to
``docs/img/``. Run from the repository root::

    python bench/render_tables.py            # rewrite the tables and the plots
    python bench/render_tables.py --check    # exit 1 naming each table that differs

``tests/test_docs.py`` runs the check: a committed table that differs from what this
command renders fails the test suite.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
IMG = ROOT / "docs" / "img"
BLOCK = re.compile(r"(<!-- table:([a-z0-9-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
HEADLINE_N = 8_841_823


# -- choosing result files ---------------------------------------------------------------------


def _load(path: Path) -> dict:
    data = json.loads(path.read_text())
    data["_path"] = path.relative_to(ROOT).as_posix()
    return data


def _date(data: dict) -> str:
    env = data.get("env") or {}
    return str(env.get("date") or data.get("date") or "")


def newest(pattern: str, accept: Callable[[dict], bool] = lambda d: True) -> dict:
    """The newest result file matching ``pattern`` that ``accept`` takes (by recorded date, then name)."""
    datas = [_load(p) for p in sorted(RESULTS.glob(pattern))]
    datas = [d for d in datas if accept(d)]
    if not datas:
        raise SystemExit(f"render_tables: no result file {RESULTS}/{pattern} has what a table needs")
    return max(datas, key=lambda d: (_date(d), d["_path"]))


def _bench_rows(data: dict) -> list[dict]:
    return [r for r in data.get("results", []) if r.get("status") == "ok" and "batch_size" in r and "system" in r]


def _row(data: dict, system: str, n: int, b: int, k: int) -> dict | None:
    return next(
        (
            r
            for r in _bench_rows(data)
            if r["system"] == system and r["n_docs"] == n and r["batch_size"] == b and r["k"] == k
        ),
        None,
    )


def comparison_run() -> dict:
    """The newest ``gpusparse bench run`` with our engine and the paper's kernel at 8.8M, at batch
    256 and at batch 1 (every column of the headline; a partial run, such as an exactness check
    of batch 256 alone, does not replace a full one)."""
    return newest(
        "*-bench*.json",
        lambda d: (
            "collections" in d
            and _row(d, "ours-tiled", HEADLINE_N, 256, 1000) is not None
            and _row(d, "paper-scatter", HEADLINE_N, 256, 1000) is not None
            and _row(d, "ours-tiled", HEADLINE_N, 1, 10) is not None
        ),
    )


def _card(data: dict) -> str:
    env = data.get("env") or data.get("machine") or {}
    return str(env.get("card") or env.get("gpu") or "CPU")


def _source(data: dict) -> str:
    return f"{_card(data)}, {_date(data)[:10]}; raw numbers: `{data['_path']}`"


# -- formatting --------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def _qps(x: float) -> str:
    return f"{x:,.0f}"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f}M".replace(".0M", "M") if n >= 1_000_000 else f"{n // 1000}K"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _m(x: float) -> str:
    return f"{x:.4f}"


SYSTEM_NAMES = {
    "ours-tiled": "GPUSparse (tiled engine)",
    "ours-tiled-q8": "GPUSparse, 8-bit impacts",
    "ours-reference": "GPUSparse, reference engine",
    "ours-scatter": "GPUSparse, scatter engine",
    "ours-docpar": "GPUSparse, docpar engine",
    "paper-scatter": "the paper's kernel",
    "paper-scatter-chunked": "the paper's kernel, chunked",
    "paper-docpar": "the paper's document-parallel kernel",
    "spare-iterative": "SPARe iterative",
    "cusparse-spmm": "cuSPARSE SpMM",
    "cusparse-spgemm": "cuSPARSE SpGEMM",
    "seismic": "Seismic (CPU)",
    "bmp": "BMP (CPU)",
    "pisa": "PISA (CPU)",
}


def _systems(data: dict) -> list[str]:
    seen: list[str] = []
    for r in _bench_rows(data):
        if r["system"] not in seen:
            seen.append(r["system"])
    return seen


# -- tables ------------------------------------------------------------------------------------


def table_headline() -> str:
    data = comparison_run()
    n = HEADLINE_N
    lines = [
        f"| {_size(n)} documents, {_card(data)} | batch 256, top-1000 | batch 256, top-10 | batch 1, top-10 | exact |",
        "|---|---:|---:|---:|:---:|",
    ]
    for system in ("ours-tiled", "ours-tiled-q8", "paper-scatter", "paper-scatter-chunked"):
        cells = []
        for b, k in ((256, 1000), (256, 10), (1, 10)):
            r = _row(data, system, n, b, k)
            cells.append("—" if r is None else f"{_ms(r['ms_per_batch'])} ms ({_qps(r['qps'])} QPS)")
        r = _row(data, system, n, 256, 1000)
        if r is None:
            continue
        exact = "yes" if r.get("exact") else "no"
        lines.append(f"| {SYSTEM_NAMES.get(system, system)} | {' | '.join(cells)} | {exact} |")
    lines += ["", f"Host to host (queries in, top-k out), median of repeated calls. {_source(data)}."]
    return "\n".join(lines)


def table_systems() -> str:
    data = comparison_run()
    sizes = sorted({r["n_docs"] for r in _bench_rows(data)})
    out = []
    for k in (1000, 10):
        out += [f"**Batch 256, top-{k}**", ""]
        out.append("| system | " + " | ".join(f"{_size(n)} ms | {_size(n)} QPS" for n in sizes) + " | exact |")
        out.append("|---|" + "---:|---:|" * len(sizes) + ":---:|")
        for system in _systems(data):
            cells, exact = [], None
            for n in sizes:
                r = _row(data, system, n, 256, k)
                cells += ["—", "—"] if r is None else [_ms(r["ms_per_batch"]), _qps(r["qps"])]
                if r is not None:
                    exact = r.get("exact")
            mark = "yes" if exact else f"no (recall {_recall(data, system, k)})"
            out.append(f"| {SYSTEM_NAMES.get(system, system)} | {' | '.join(cells)} | {mark} |")
        out.append("")
    out.append(
        f"*exact*: top-k ids identical to the exact reference's on every query checked; otherwise the share of "
        f"the exact top-k returned. {_source(data)}."
    )
    return "\n".join(out)


def _recall(data: dict, system: str, k: int) -> str:
    vals = [r.get("recall_vs_exact") for r in _bench_rows(data) if r["system"] == system and r["k"] == k]
    vals = [v for v in vals if v is not None]
    return f"{min(vals):.4f}" if vals else "?"


def table_memory_components() -> str:
    data = comparison_run()
    lines = [
        "| documents | postings | index (posting lists) GiB | engine's derived layout GiB | "
        "peak while searching GiB (ours) | peak GiB (the paper's kernel) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for col in data["collections"]:
        n = col["n_docs"]
        ours, paper = _row(data, "ours-tiled", n, 256, 1000), _row(data, "paper-scatter", n, 256, 1000)
        if ours is None:
            continue
        paper_peak = "—" if paper is None else _gib(paper["peak_mem_bytes"])
        lines.append(
            f"| {_size(n)} | {col['n_postings']:,} | {_gib(col['index_bytes'])} | {_gib(ours['derived_bytes'])} | "
            f"{_gib(ours['peak_mem_bytes'])} | {paper_peak} |"
        )
    lines += [
        "",
        "Batch 256, top-1000. Peak = `torch.cuda.max_memory_allocated`, which includes a document-major CSR "
        "copy that the benchmark keeps resident for the systems that need it. The derived layout is what the "
        f"tiled engine builds beside the index (its tiles and the forward copy it rescores from). {_source(data)}.",
    ]
    return "\n".join(lines)


def table_memory_modes() -> str:
    """What the fast engine holds in each residency mode (bench/memory.py), and its speed
    beside the default mode's of the same weights in the same run."""

    def plain(r: dict) -> bool:
        return "rows" in r and not r["config"].get("cap_gib") and not r["config"].get("limit_gib")

    data = newest(
        "*-memory-v*.json",
        lambda d: (
            {r["config"]["mode"] for r in d.get("results", []) if plain(r) and "predicted" in r} >= {"lists", "tiled"}
        ),
    )
    runs = [r for r in data["results"] if plain(r)]
    default = {r["config"]["quantize"]: r["rows"]["1000"]["median_ms"] for r in runs if r["config"]["mode"] == "lists"}
    lines = [
        "| weights | mode | resident on the GPU GB | peak, every allocator GB | predicted peak GB | top-1000 ms "
        "| vs `lists` |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        c = r["config"]
        gpu = sum(n for d, n in r["index_memory"]["by_device"].items() if d != "cpu")
        ms = r["rows"]["1000"]["median_ms"]
        base = default.get(c["quantize"])
        ratio = "—" if c["mode"] == "lists" or not base else f"{ms / base - 1:+.0%}"
        lines.append(
            f"| {'8-bit' if c['quantize'] else 'float32'} | `{c['mode']}` | {gpu / 1e9:.2f} | "
            f"{r['peak']['all_allocators'] / 1e9:.2f} | {r['predicted']['peak'] / 1e9:.2f} | {ms:.2f} | {ratio} |"
        )
    lines += [
        "",
        f"{data['docs']:,} calibrated synthetic documents, batch {data['batch']}, k = 1000, median of "
        "repeated searches host to host. `lists`: padded lists, forward copy and tiled layout on the GPU (the "
        'default); `tiled` (`EngineConfig(resident="tiled")`): the tiled layout alone. Peak = PyTorch\'s '
        "reserved peak plus CuPy's pool; predicted = `gpusparse info --device cuda`. "
        f"{data['device']}, {data['time'][:10]}; raw numbers: `{data['_path']}`.",
    ]
    return "\n".join(lines)


def _paper(part: str) -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpusparse_bench import paper_report

    datas = paper_report.load_results([RESULTS])
    for d in datas:
        d["_path"] = Path(d["_path"]).resolve().relative_to(ROOT).as_posix()
    data = paper_report.source_for(datas, part)
    if data is None:
        return "*Not yet measured.*"
    lines = paper_report.TABLES[part](data)
    return "\n".join([*lines, "", f"{_source(data)}."])


def table_multigpu() -> str:
    files = {w: newest("*-multigpu*.json", lambda d, w=w: d["env"].get("world_size") == w) for w in (2, 4)}
    modes = {"resident": "one batch", "pipelined": "8 batches, pipelined", "pipe-32": "32 batches, pipelined"}
    lines = ["| mode | GPUs | ms per batch | QPS | vs 1 GPU |", "|---|---:|---:|---:|---:|"]
    for world, data in files.items():
        for mode, label in modes.items():
            for r in data["rows"]:
                if r["mode"] != mode or r["gpus"] not in (1, world) or (world == 4 and r["gpus"] == 1):
                    continue
                ms = r.get("ms_per_batch", r["median_ms"])
                speed = f"{r.get('speedup_vs_1_gpu', 1.0):.2f}×"
                lines.append(f"| {label} | {r['gpus']} | {_ms(ms)} | {_qps(r['qps'])} | {speed} |")
    lines += [
        "",
        "8.8M synthetic documents, batch 256, top-1000; every row's results identical to one GPU's. "
        + " ".join(f"{w} GPUs: {_source(d)}." for w, d in files.items()),
    ]
    return "\n".join(lines)


def table_quality() -> str:
    data = newest("*-quality-splade-tiny*.json")
    lines = [
        "| collection | docs | queries | engine | nDCG@10 | RR@10 | R@1000 |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    names = {
        "gpusparse": "GPUSparse (exact, float32)",
        "pisa": "PISA `ranked_or` (weights as int(100·w))",
        "gpusparse (PISA-quantized vectors)": "GPUSparse on PISA's quantized vectors",
        "seismic": "Seismic exact (float16 document weights)",
    }
    for name, res in data["results"].items():
        idx = res["pipeline"]["index"]
        for i, (engine, e) in enumerate(res["engines"].items()):
            m = e["metrics"]
            head = f"{name} | {idx['documents']:,} | {res['pipeline']['search']['queries']:,}" if i == 0 else " |  | "
            lines.append(
                f"| {head} | {names.get(engine, engine)} | {_m(m['nDCG@10'])} | {_m(m['RR@10'])} | {_m(m['R@1000'])} |"
            )
    lines += ["", f"splade-tiny vectors, top-1000, metrics by `ir_measures`. {_source(data)}."]
    return "\n".join(lines)


def table_quantized() -> str:
    data = newest("*-quantized-quality*.json")
    lines = [
        "| collection | weights dropped | float32 RR@10 / nDCG@10 / R@1000 | 8-bit RR@10 / nDCG@10 / R@1000 | "
        "top-10 / top-1000 overlap with float32 | 8-bit run exact |",
        "|---|---:|---|---|---|:---:|",
    ]
    for name, r in data["results"].items():
        f, q = r["float32"], r["q8"]
        lines.append(
            f"| {name} | {100 * r['weights_dropped'] / r['weights']:.2f}% | "
            f"{_m(f['RR@10'])} / {_m(f['nDCG@10'])} / {_m(f['R@1000'])} | "
            f"{_m(q['RR@10'])} / {_m(q['nDCG@10'])} / {_m(q['R@1000'])} | "
            f"{r['overlap_at_10']:.3f} / {r['overlap_at_1000']:.3f} | {'yes' if r['quantized_run_exact'] else 'no'} |"
        )
    lines += ["", f"splade-tiny vectors on the CPU. {_source(data)}."]
    return "\n".join(lines)


def table_serve_load() -> str:
    data = newest("*-serve-load*.json", lambda d: d.get("complete") and d["settings"].get("device") == "cuda")
    s = data["settings"]
    lines = [
        "| offered requests/s | answered/s | p50 ms | p99 ms | 429 | unanswered | mean batch |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['offered_qps']:,.0f} | {r['throughput_qps']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['n_429']:,} | {r['unfinished']} | {r['mean_batch_size']:.1f} |"
        )
    lines += [
        "",
        f"{s['docs']:,} synthetic documents, one query of top-{s['k']} per request, open-loop Poisson arrivals, "
        f"server and load generator on one machine ({data['machine']['cpus']} CPU cores). {_source(data)}.",
    ]
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
    "headline": table_headline,
    "systems": table_systems,
    "memory-components": table_memory_components,
    "memory-modes": table_memory_modes,
    "multigpu": table_multigpu,
    "quality": table_quality,
    "quantized": table_quantized,
    "serve-load": table_serve_load,
    **{f"paper-{p}": (lambda p=p: _paper(p)) for p in ("e2e", "batch", "sparsity", "vocab", "memory", "quality")},
}


# -- plots -------------------------------------------------------------------------------------


def plots(out: Path = IMG) -> list[Path]:
    """QPS against batch size and against collection size, memory per component, GPU scaling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    data = comparison_run()
    written = []
    meta = {"Software": None}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110, metadata=meta)
        plt.close(fig)
        written.append(out / name)

    sizes = sorted({r["n_docs"] for r in _bench_rows(data)})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, n in zip(axes[0], sizes, strict=True):
        for system in _systems(data):
            pts = sorted(
                (r["batch_size"], r["qps"])
                for r in _bench_rows(data)
                if r["system"] == system and r["n_docs"] == n and r["k"] == 1000
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=SYSTEM_NAMES.get(system, system))
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="queries per second")
        ax.set_title(f"{_size(n)}, k=1000")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"QPS against batch size ({_card(data)})", fontsize=10)
    save(fig, "qps-vs-batch.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in _systems(data):
        pts = sorted(
            (r["n_docs"], r["qps"])
            for r in _bench_rows(data)
            if r["system"] == system and r["batch_size"] == 256 and r["k"] == 1000
        )
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=SYSTEM_NAMES.get(system, system))
    ax.set(xscale="log", yscale="log", xlabel="documents", ylabel="queries per second")
    ax.set_title(f"QPS against collection size, batch 256, k=1000 ({_card(data)})", fontsize=10)
    ax.legend(fontsize=7)
    save(fig, "qps-vs-size.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    labels, parts = [], {"posting lists (the index)": [], "engine's derived layout": [], "search temporaries": []}
    shared = []
    for col in data["collections"]:
        r = _row(data, "ours-tiled", col["n_docs"], 256, 1000)
        if r is None:
            continue
        labels.append(_size(col["n_docs"]))
        shared.append((r["resident_bytes"] - col["index_bytes"]) / 2**30)
        parts["posting lists (the index)"].append(col["index_bytes"] / 2**30)
        parts["engine's derived layout"].append(r["derived_bytes"] / 2**30)
        rest = r["peak_mem_bytes"] - r["resident_bytes"] - r["derived_bytes"]
        parts["search temporaries"].append(max(rest, 0) / 2**30)
    parts["benchmark's document CSR (not ours)"] = shared
    bottom = [0.0] * len(labels)
    for label, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ax.set(ylabel="GiB", title=f"Device memory per component, batch 256, k=1000 ({_card(data)})")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    save(fig, "memory.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    modes = {"resident": "one batch", "pipelined": "8 batches, pipelined", "pipe-32": "32 batches, pipelined"}
    files = [newest("*-multigpu*.json", lambda d, w=w: d["env"].get("world_size") == w) for w in (2, 4)]
    for mode, label in modes.items():
        pts = {}
        for d in files:
            for r in d["rows"]:
                if r["mode"] == mode:
                    pts.setdefault(r["gpus"], r["qps"])
        if pts:
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=label)
    ax.set(xlabel="GPUs", ylabel="queries per second", xticks=[1, 2, 4])
    ax.set_title(f"Scaling over GPUs, 8.8M documents, batch 256, k=1000 ({_card(files[0])})", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, "gpu-scaling.png")
    return written


# -- the blocks --------------------------------------------------------------------------------


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def render_text(text: str, where: str, cache: dict[str, str]) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"{where}: unknown table '{name}' (known: {', '.join(TABLES)})")
        if name not in cache:
            cache[name] = TABLES[name]().rstrip("\n")
        return f"{m.group(1)}{cache[name]}\n{m.group(4)}"

    return BLOCK.sub(fill, text)


def stale_documents() -> list[tuple[Path, str]]:
    """(file, rendered text) for every document whose tables differ from what this renders."""
    cache: dict[str, str] = {}
    out = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        new = render_text(text, str(path.relative_to(ROOT)), cache)
        if new != text:
            out.append((path, new))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report tables that differ; exit 1 if any")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    stale = stale_documents()
    if args.check:
        for path, _ in stale:
            print(f"stale tables in {path.relative_to(ROOT)}: run python bench/render_tables.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in stale:
        path.write_text(text, encoding="utf-8")
        print(f"rewrote tables in {path.relative_to(ROOT)}")
    if not args.no_plots:
        for p in plots():
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
