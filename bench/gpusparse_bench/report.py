"""Benchmark results (JSON) → text table, Markdown tables, headline ratios and matplotlib plots.

``gpusparse bench report RESULTS.json --out DIR`` writes ``DIR/<stem>.md``,
``DIR/<stem>-latency-vs-size.png`` and ``DIR/<stem>-qps-vs-batch.png``. Plots need
matplotlib (the ``bench`` extra); without it the Markdown is still written.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

HEADLINE_B, HEADLINE_K = 256, 1000


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def ok_rows(data: dict) -> list[dict]:
    rows = [r for r in data["results"] if r.get("status") == "ok"]
    for r in rows:
        if r.get("floor_bandwidth_ms") is not None:
            r["frac_of_dram_floor"] = r["floor_bandwidth_ms"] / r["ms_per_batch"]
    return rows


def onchip_valid(env: dict) -> bool:
    """Whether the run's on-chip copy rate can be a ceiling (it must beat the DRAM rate)."""
    return env.get("onchip_copy_bytes_per_s", 0) > env.get("copy_bandwidth_bytes_per_s", 0)


def _size(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M".replace(".0M", "M")
    if n >= 1000:
        return f"{n / 1e3:.0f}K"
    return str(n)


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def short_table(data: dict) -> str:
    """Fixed-width table of every measured row, then the skipped systems."""
    lines = [f"{'system':<24}{'N':>10}{'B':>6}{'k':>6}{'ms/batch':>11}{'QPS':>11}{'floor':>8}{'exact':>7}{'recall':>8}"]
    for r in ok_rows(data):
        lines.append(
            f"{r['system']:<24}{_size(r['n_docs']):>10}{r['batch_size']:>6}{r['k']:>6}{r['ms_per_batch']:>11.3f}"
            f"{r['qps']:>11,.0f}{r.get('frac_of_floor', 0):>8.1%}{r['exact']!s:>7}{r['recall_vs_exact']:>8.4f}"
        )
    skipped = {(r["system"], r["n_docs"], r.get("reason", "")) for r in data["results"] if r.get("status") != "ok"}
    for s, n, why in sorted(skipped):
        lines.append(f"not measured: {s} at N={_size(n)}: {why[:150]}")
    return "\n".join(lines)


def quantized(r: dict) -> bool:
    """A system exact for quantized vectors only (``ours-tiled-q8``): never "our best" exact one."""
    return bool(r.get("exact_against"))


def best_ours(rows: list[dict], n: int, b: int, k: int) -> dict | None:
    """Our fastest float32-exact system for one configuration."""
    cand = [
        r
        for r in rows
        if r["family"] == "ours" and not quantized(r) and (r["n_docs"], r["batch_size"], r["k"]) == (n, b, k)
    ]
    return min(cand, key=lambda r: r["ms_per_batch"]) if cand else None


def headline(data: dict, b: int = HEADLINE_B, k: int = HEADLINE_K) -> list[dict]:
    """Per collection size: our best kernel, and each other system's time over ours."""
    rows = ok_rows(data)
    out = []
    for n in sorted({r["n_docs"] for r in rows}):
        ours = best_ours(rows, n, b, k)
        if ours is None:
            continue
        others = {}
        for r in rows:
            if r["n_docs"] != n or (r["family"] == "ours" and not quantized(r)):
                continue
            kb = r["batch_size"]
            if r["k"] != k or (kb != b and r["family"] != "cpu"):
                continue
            if r["family"] == "cpu":
                # CPU engines: compare per-query latency at their largest batch.
                o = best_ours(rows, n, b, k)
                ratio = r["ms_per_query"] / o["ms_per_query"]
            else:
                ratio = r["ms_per_batch"] / ours["ms_per_batch"]
            prev = others.get(r["system"])
            if prev is None or r["batch_size"] > prev["batch_size"]:
                others[r["system"]] = {
                    "ratio": ratio,
                    "ms_per_query": r["ms_per_query"],
                    "batch_size": r["batch_size"],
                    "recall": r["recall_vs_exact"],
                }
        out.append(
            {
                "n_docs": n,
                "ours": ours["system"],
                "ours_ms_per_batch": ours["ms_per_batch"],
                "ours_qps": ours["qps"],
                "ours_frac_of_floor": ours.get("frac_of_floor"),
                "ours_frac_of_dram_floor": ours.get("frac_of_dram_floor"),
                "others": others,
            }
        )
    return out


def markdown(data: dict) -> str:
    """Markdown: environment, collection statistics, headline table, then every result."""
    env = data["env"]
    rows = ok_rows(data)
    parts = [
        f"Card: **{env.get('card')}** (driver {env.get('driver')}, CUDA {env.get('cuda')}), torch {env.get('torch')}, "
        f"Triton {env.get('triton')}, CPU {env.get('cpu')} ({env.get('cpu_threads')} threads); "
        f"date {str(env.get('date', ''))[:10]}, commit `{str(env.get('git_commit', ''))[:10]}`.  ",
        f"Command: `{env.get('command')}`.  ",
        f"Copy bandwidth {env.get('copy_bandwidth_bytes_per_s', 0) / 1e12:.2f} TB/s (DRAM), on-chip copy "
        f"{env.get('onchip_copy_bytes_per_s', 0) / 1e12:.2f} TB/s (read + write). DRAM floor = distinct postings "
        f"of the batch × {env.get('posting_bytes', 8)} B / DRAM rate; floor = max(DRAM floor, all postings read × "
        f"{env.get('posting_bytes', 8)} B / on-chip rate)."
        + (
            ""
            if onchip_valid(env)
            else " **The on-chip rate of this run is launch-bound (below the DRAM rate), so the on-chip term and "
            "'% of floor' overstate the floor; '% of DRAM floor' is the valid bound.**"
        ),
        "",
    ]
    colls = data.get("collections", [])
    if colls:
        keys = [
            ("n_postings", "postings"),
            ("doc_nnz_mean", "doc nnz mean"),
            ("doc_nnz_sd", "doc nnz sd"),
            ("doc_nnz_max", "doc nnz max"),
            ("nonempty_lists", "non-empty lists"),
            ("longest_list_frac", "longest list / N"),
            ("query_nnz_mean", "query nnz mean"),
            ("query_nnz_max", "query nnz max"),
            ("frac_docs_touched", "docs touched per query"),
            ("postings_per_query_per_doc", "postings per query / N"),
            ("weight_max", "max weight"),
        ]
        targets = data.get("targets", {})
        tkeys = {"n_postings": "postings_at_8.8M"}
        parts.append("| statistic | " + " | ".join(_size(c["n_docs"]) for c in colls) + " | MS MARCO target |")
        parts.append("|---|" + "---:|" * (len(colls) + 1))
        for key, label in keys:
            vals = [c["stats"].get(key) for c in colls]
            t = targets.get(tkeys.get(key, key))
            parts.append(
                f"| {label} | " + " | ".join(_num(v) for v in vals) + f" | {_num(t) if t is not None else ''} |"
            )
        parts.append("")
    heads = headline(data)
    if heads:
        parts.append(f"Headline (B = {HEADLINE_B}, k = {HEADLINE_K}): each system's time over our best kernel's.")
        parts.append("")
        systems = sorted({s for h in heads for s in h["others"]})
        parts.append("| N | ours (best) | ms/batch | QPS | % of DRAM floor | " + " | ".join(systems) + " |")
        parts.append("|---|---|---:|---:|---:|" + "---:|" * len(systems))
        for h in heads:
            cells = []
            for s in systems:
                o = h["others"].get(s)
                cells.append("" if o is None else f"{o['ratio']:.1f}×")
            f = h["ours_frac_of_dram_floor"]
            parts.append(
                f"| {_size(h['n_docs'])} | {h['ours']} | {_ms(h['ours_ms_per_batch'])} | {h['ours_qps']:,.0f} | "
                f"{'' if f is None else f'{f:.1%}'} | " + " | ".join(cells) + " |"
            )
        parts.append("")
    parts.append(
        "| system | N | B | k | ms/batch | ms/query | QPS | peak GiB | % of DRAM floor | % of floor | exact | recall "
        "| reps |"
    )
    parts.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["n_docs"], r["batch_size"], r["k"], r["ms_per_batch"])):
        peak = r.get("peak_mem_bytes")
        parts.append(
            f"| {r['system']} | {_size(r['n_docs'])} | {r['batch_size']} | {r['k']} | {_ms(r['ms_per_batch'])} | "
            f"{r['ms_per_query']:.3g} | {r['qps']:,.0f} | {'' if peak is None else f'{peak / 2**30:.1f}'} | "
            f"{r.get('frac_of_dram_floor', 0):.2%} | {r.get('frac_of_floor', 0):.1%} | "
            f"{'yes' if r['exact'] else 'no'} | {r['recall_vs_exact']:.4f} | "
            f"{r['reps']} |"
        )
    skipped = sorted(
        {
            (r["system"], r["n_docs"], r.get("status", ""), r.get("reason", ""))
            for r in data["results"]
            if r.get("status") != "ok"
        }
    )
    if skipped:
        parts.append("")
        parts.append("Not measured:")
        parts.append("")
        for s, n, st, why in skipped:
            parts.append(f"- {s} at N = {_size(n)}: {st}: {why}")
    return "\n".join(parts) + "\n"


def _num(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1000):
        return f"{int(v):,}"
    return f"{v:.3g}"


def plots(data: dict, out_dir: Path, stem: str) -> list[Path]:
    """Latency vs collection size (log-log) and QPS vs batch size; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = ok_rows(data)
    card = data["env"].get("card", "")
    cmap = plt.get_cmap("tab20")
    colors = {name: cmap(i % 20) for i, name in enumerate(sorted({r["system"] for r in rows}))}
    written = []
    ks = sorted({r["k"] for r in rows})
    # Latency vs size at the headline batch (or the largest batch present).
    fig, axes = plt.subplots(1, len(ks), figsize=(6.5 * len(ks) + 2, 4.8), squeeze=False)
    for ax, k in zip(axes[0], ks, strict=True):
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            if r["k"] == k and r["batch_size"] == HEADLINE_B and r["family"] != "cpu":
                series[r["system"]].append((r["n_docs"], r["ms_per_batch"]))
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, **_style(name, colors))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("documents")
        ax.set_ylabel(f"ms per batch of {HEADLINE_B}")
        ax.set_title(f"latency vs collection size, k={k}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"GPUSparse benchmark, {card}: batch {HEADLINE_B}, host to host", fontsize=10)
    fig.tight_layout()
    p = out_dir / f"{stem}-latency-vs-size.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    # QPS vs batch at each size that has several batches.
    sizes = sorted({r["n_docs"] for r in rows})
    fig, axes = plt.subplots(len(ks), len(sizes), figsize=(5 * len(sizes), 4 * len(ks)), squeeze=False)
    for i, k in enumerate(ks):
        for j, n in enumerate(sizes):
            ax = axes[i][j]
            series = defaultdict(list)
            for r in rows:
                if r["k"] == k and r["n_docs"] == n:
                    series[r["system"]].append((r["batch_size"], r["qps"]))
            for name, pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, **_style(name, colors))
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel("queries / s")
            ax.set_title(f"N={_size(n)}, k={k}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"QPS vs batch size, {card}", fontsize=10)
    fig.tight_layout()
    p = out_dir / f"{stem}-qps-vs-batch.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written


def _style(name: str, colors: dict) -> dict:
    style = {"color": colors.get(name)}
    if name.startswith("ours-"):
        return style | {"linewidth": 2.4}
    if name.startswith("paper"):
        return style | {"linestyle": "--"}
    if name in ("seismic", "bmp", "pisa"):
        return style | {"linestyle": ":"}
    return style | {"linewidth": 1.0, "alpha": 0.8}


def render(path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the Markdown report and the plots for one result file; returns the paths."""
    path, out_dir = Path(path), Path(out_dir)
    data = load(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{path.stem}.md"
    md.write_text(markdown(data))
    return [md, *plots(data, out_dir, path.stem)]


# -- the README's Performance section --------------------------------------------------------

# The GPUSparse paper's figures (H100 80GB, real MS MARCO SPLADE; ../shared/design/paper.md),
# with the row of this run to put beside each: (what, paper, system, n_docs, batch, k).
PAPER_FIGURES = [
    ("paper's kernel, 1M, top-1000", "35.3 ms / batch of 500 (70.5 µs/q)", "paper-scatter", 1_000_000, 256, 1000),
    ("paper's kernel, 100K, top-1000", "3.34 ms / batch of 500 (6.7 µs/q)", "paper-scatter", 100_000, 256, 1000),
    (
        "8.8M, top-1000, chunked + compacted top-k",
        "131.8 ms / batch of 256 (0.515 ms/q)",
        "paper-scatter-chunked",
        8_841_823,
        256,
        1000,
    ),
    ("8.8M, monolithic", "20.3 ms / batch of 16 (1.27 ms/q)", "paper-scatter", 8_841_823, 32, 1000),
    ("SPARe iterative, 1M", "421–2,049 ms / batch of 500", "spare-iterative", 1_000_000, 256, 1000),
    ("BMP exact, top-1000", "3.79 ms/q (1 core, 8.8M)", "bmp", 1_000_000, 32, 1000),
    ("Seismic, top-1000", "8.8 ms/q (1 core), 0.39 ms/q (96 cores), R 0.953", "seismic", 1_000_000, 32, 1000),
    ("PISA block-max WAND, top-1000", "~30 ms/q (1 thread)", "pisa", 1_000_000, 32, 1000),
]


def _row(rows: list[dict], system: str, n: int, b: int, k: int) -> dict | None:
    for r in rows:
        if (r["system"], r["n_docs"], r["batch_size"], r["k"]) == (system, n, b, k):
            return r
    return None


def performance_section(data: dict, json_rel: str, md_rel: str, plot_rel: str) -> str:
    """The README's "Performance" section, generated from one result file."""
    env = data["env"]
    rows = ok_rows(data)
    sizes = sorted({r["n_docs"] for r in rows})
    big = [n for n in sizes if n >= 1_000_000]
    card = str(env.get("card", "")).replace("NVIDIA ", "")
    threads = env.get("cpu_engine_cores") or env.get("cpu_threads")
    lines = [
        "## Performance",
        "",
        f"<!-- generated from {json_rel} by `gpusparse bench report {json_rel} --out "
        f"{Path(json_rel).parent} --readme`; regenerate, do not edit -->",
        "",
        f"One run of `gpusparse bench run` on an **NVIDIA {card}** ({env.get('cpu_threads')} CPU threads; driver "
        f"{env.get('driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}, Triton {env.get('triton')}) on "
        f"{str(env.get('date', ''))[:10]}, commit `{str(env.get('git_commit', ''))[:10]}`, command "
        f"`{env.get('command')}`. Every system ran in that run on the same synthetic collections (seeded, generated "
        "on the GPU, calibrated to SPLADE on MS MARCO: ~120 terms per document, ~45 per query, a query touches "
        "~53% of the documents and reads ~2 postings per document; see `bench/NOTES.md`) and the same queries, "
        "timed host to host (queries in, top-k out; median of up to 10 calls after warm-up, CUDA events). "
        f"Raw numbers: `{json_rel}`; every configuration: `{md_rel}`.",
        "",
        f"Batch {HEADLINE_B}, k = {HEADLINE_K}, ms per batch (CPU engines: batch 32 on {threads} cores, "
        "per query). *exact*: top-k ids identical to the exact reference on every query checked; *recall*: "
        "share of the exact top-k returned (both at the largest size run). Peak memory "
        "(`torch.cuda.max_memory_allocated`) includes the resident index and document CSR that every system "
        "shares; the tiled kernel's CuPy buffers are outside it.",
        "",
    ]
    last_n = _size(big[-1]) if big else ""
    head = (
        "| system | "
        + " | ".join(f"{_size(n)} ms | {_size(n)} QPS" for n in big)
        + f" | {last_n} peak GiB | exact | recall |"
    )
    lines += [head, "|---|" + "---:|---:|" * len(big) + "---:|:---:|---:|"]
    systems = []
    for r in rows:
        if r["system"] not in systems:
            systems.append(r["system"])
    for s in systems:
        cells, last = [], None
        for n in big:
            b = 32 if s in ("seismic", "bmp", "pisa") else HEADLINE_B
            r = _row(rows, s, n, b, HEADLINE_K)
            if r is None:
                cells.append("— | —")
                continue
            last = r
            ms = r["ms_per_query"] if r["family"] == "cpu" else r["ms_per_batch"]
            cells.append(f"{_ms(ms)}{' /q' if r['family'] == 'cpu' else ''} | {r['qps']:,.0f}")
        if last is None:
            continue
        peak = last.get("peak_mem_bytes")
        lines.append(
            f"| {s} | " + " | ".join(cells) + f" | {'' if peak is None else f'{peak / 2**30:.1f}'} | "
            f"{'yes' if last['exact'] else 'no'} | {last['recall_vs_exact']:.4f} |"
        )
    lines.append("")
    for h in headline(data):
        if h["n_docs"] not in big:
            continue
        o = h["others"]
        parts = [f"{s} {v['ratio']:.1f}×" for s, v in sorted(o.items(), key=lambda kv: kv[1]["ratio"])]
        f = h.get("ours_frac_of_dram_floor")
        lines.append(
            f"- **{_size(h['n_docs'])}**: our best kernel ({h['ours']}) {_ms(h['ours_ms_per_batch'])} ms per batch, "
            f"{h['ours_qps']:,.0f} QPS, {'' if f is None else f'{f:.1%} of the DRAM floor'}; others' time over "
            "ours: " + ", ".join(parts) + "."
        )
    lines += ["", f"![latency vs collection size]({plot_rel})", ""]
    lines += [
        "The paper's figures (H100 80GB, real MS MARCO SPLADE) beside this run's (synthetic data, "
        f"{card}). Cards and data differ: compare ratios within a column, not absolute times across.",
        "",
        f"| what | paper | this run ({card}) |",
        "|---|---|---|",
    ]
    for what, paper, system, n, b, k in PAPER_FIGURES:
        r = _row(rows, system, n, b, k)
        mine = "not measured"
        if r is not None:
            q = r["ms_per_query"]
            per_q = f"{q:.3g} ms/q" if q >= 1 else f"{q * 1e3:.3g} µs/q"
            mine = f"{system}: {_ms(r['ms_per_batch'])} ms / batch of {b} ({per_q}), N = {_size(n)}"
            if r["recall_vs_exact"] < 1:
                mine += f", recall {r['recall_vs_exact']:.3f}"
        lines.append(f"| {what} | {paper} | {mine} |")
    lines += [
        "",
        "To reproduce: `scripts/fetch_bench_wheels.sh` fetches the CPU engines' wheels (the GPU machine has no "
        "package index), then on the GPU machine `pip install --no-index --find-links .whl pyseismic-lsr bmp "
        "pyterrier-pisa` (or the `--target` install in the script's header) and `gpusparse bench run` (all sizes, "
        "every system; `--quick` for a pipeline check); `gpusparse bench report RESULTS.json --out DIR` renders "
        "the tables and plots anywhere. Notes on the data and on each finding: `bench/NOTES.md`.",
    ]
    return "\n".join(lines) + "\n"
