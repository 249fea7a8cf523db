"""``gpusparse bench paper`` results → Markdown tables beside the paper's figures, and plots.

:data:`PAPER` holds every figure of the paper that these tables compare with, quoted from
``../shared/design/paper.md`` (the paper, arXiv 2606.26441, H100 80GB SXM, real MS MARCO
SPLADE, and the authors' later re-measurements). Each table comes from the newest result
file that measured its part — on a GPU for the speed and memory parts (a CPU dry run
never fills them: they read "not yet measured on a GPU"), anywhere for quality — and
names its card, date, commit and command.

``gpusparse bench paper-report bench/results --out bench/results --readme README.md``
re-renders everything (``bench/results/paper-tables.md``, the plots, and the README block
between ``<!-- paper-tables:start -->`` and ``<!-- paper-tables:end -->``).
"""

from __future__ import annotations

import json
from pathlib import Path

from .report import _ms, _size

SOURCE = "../shared/design/paper.md (GPUSparse, arXiv 2606.26441; H100 80GB SXM, MS MARCO SPLADE)"
NOT_MEASURED = "not yet measured on a GPU"
START, END = "<!-- paper-tables:start -->", "<!-- paper-tables:end -->"

# The paper's figures, per part, as paper.md states them.
PAPER: dict[str, dict[str, object]] = {
    "e2e": {
        "source": "paper.md, headline figures: 'end to end with encoding, 1M, batch 32'",
        "model": "naver/splade-cocondenser-ensembledistil (BERT-base), HF transformers",
        "by_batch": {32: "0.43 ms/query (encode 6.8 ms + score 7.1 ms per batch), 1M passages"},
    },
    "batch": {
        "source": "paper.md, headline figures: '50K passages, top-10'",
        "by_batch": {1: "0.33 ms (batch 1)", 128: "118,704 QPS (batch 128)"},
    },
    "sparsity": {
        "source": "paper.md, design: 'Memory ≈ N · k̄ · 8 bytes · (1 + padding overhead)'; "
        "no latency figure per sparsity",
        "posting_bytes": 8,
    },
    "vocab": {
        "source": "paper.md gives no figure per vocabulary size (BERT's 30,522 terms throughout)",
    },
    "memory": {
        "source": "paper.md, headline figures and the authors' re-measurements",
        "index": {100_000: "93 MB", 1_000_000: "970 MB", 8_841_823: "8.5 GB (re-measured: 7.9 GiB)"},
        "peak": {
            8_841_823: "44 GB at batch 500 (the [B × N] fp32 buffer); at batch 256: 16.4 GiB monolithic, "
            "8.0 GiB chunked"
        },
    },
    "quality": {
        "source": "paper.md, headline figures: 'BEIR (SPLADE, exact)', full-size SPLADE "
        "(splade-cocondenser-ensembledistil), nDCG@10",
        "ndcg10": {"nfcorpus": "0.314", "scifact": "0.586", "trec-covid": "0.297 (50K subset)"},
    },
}

GPU_PARTS = ("e2e", "batch", "sparsity", "vocab", "memory")
TITLES = {
    "e2e": "End to end: query encoding + scoring + top-k",
    "batch": "Batch-size sweep",
    "sparsity": "Sparsity sensitivity",
    "vocab": "Vocabulary sensitivity",
    "memory": "Memory footprint",
    "quality": "Cross-domain quality (the text pipeline, checked for exactness)",
}


def load_results(paths: list[Path]) -> list[dict]:
    """Result files (folders are searched for ``*-paper*.json``), oldest first by date."""
    files: list[Path] = []
    for p in paths:
        files += sorted(Path(p).glob("*-paper*.json")) if Path(p).is_dir() else [Path(p)]
    datas = []
    for f in files:
        data = json.loads(f.read_text())
        if "parts" in data:
            data["_path"] = str(f)
            datas.append(data)
    return sorted(datas, key=lambda d: (str(d["env"].get("date", "")), d["_path"]))


def _on_gpu(data: dict) -> bool:
    return str(data["env"].get("card", "cpu")) != "cpu"


def source_for(datas: list[dict], part: str, *, require_gpu: bool = True) -> dict | None:
    """The newest result that measured ``part`` (on a GPU, for the speed and memory parts,
    unless ``require_gpu`` is false: a dry run shows its own numbers)."""
    for data in reversed(datas):
        if data["parts"].get(part, {}).get("status") != "ok":
            continue
        if require_gpu and part in GPU_PARTS and not _on_gpu(data):
            continue
        return data
    return None


def _rows(data: dict, part: str) -> list[dict]:
    return [r for r in data["results"] if r.get("part") == part and r.get("status") == "ok"]


def _provenance(data: dict) -> str:
    env = data["env"]
    card = str(env.get("card", "")).replace("NVIDIA ", "")
    where = f"**{card}**" if card != "cpu" else f"**CPU** ({env.get('cpu')}, {env.get('cpu_threads')} threads)"
    path = data.get("_path", "")
    return (
        f"Measured on {where}, {str(env.get('date', ''))[:10]}, commit `{str(env.get('git_commit', ''))[:10]}`, "
        f"torch {env.get('torch')}, Triton {env.get('triton')}; command `{env.get('command')}`; raw: `{path}`."
    )


def _mib(b: float | None) -> str:
    return "" if b is None else f"{b / 2**20:,.1f}"


def _gib(b: float | None) -> str:
    return "" if b is None else f"{b / 2**30:.2f}"


def _by(rows: list[dict], **match: object) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _systems(rows: list[dict]) -> tuple[str | None, str | None]:
    ours = next((r["system"] for r in rows if r.get("family") == "ours"), None)
    paper = next((r["system"] for r in rows if r["system"] == "paper-scatter"), None)
    return ours, paper


def table_e2e(data: dict | None) -> list[str]:
    fig = PAPER["e2e"]["by_batch"]
    head = [
        "| encoder | B | encode ms | score ms (ours) | ms/query | QPS | score ms (paper's kernel) | exact "
        "| paper (H100) |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    if data is None:
        return [*head, *(f"| BERT-base SPLADE | {b} | {NOT_MEASURED} |  |  |  |  |  | {fig[b]} |" for b in fig)]
    rows = _rows(data, "e2e")
    ours, paper = _systems(rows)
    lines = [*head]
    models = list(dict.fromkeys(r["model"] for r in rows))
    for m in models:
        for b in sorted({r["batch_size"] for r in rows if r["model"] == m}):
            o = _by(rows, model=m, batch_size=b, system=ours)
            p = _by(rows, model=m, batch_size=b, system=paper)
            if o is None:
                continue
            lines.append(
                f"| {m} | {b} | {_ms(o['encode_ms'])} | {_ms(o['score_ms'])} | {o['ms_per_query']:.3g} | "
                f"{o['qps']:,.0f} | {'' if p is None else _ms(p['score_ms'])} | {'yes' if o['exact'] else 'no'} | "
                f"{fig.get(b, '') if m.startswith('bert-base') else ''} |"
            )
    info = next((r.get("model_info") for r in rows), None)
    src = data.get("parts_info", {}).get("e2e_query_texts", "")
    lines += [
        "",
        f'{ours} = our engine (`kernel="auto"`); k = {rows[0]["k"] if rows else ""}; '
        f"{_size(rows[0]['n_docs']) if rows else ''} synthetic documents (MS MARCO-calibrated); queries: {src}. "
        "encode ms: `SpladeEncoder.encode` host to host (tokenise, forward pass under autocast, pooling, sparse "
        "vectors to the host); score ms: search of those vectors, host to host; ms/query and QPS count both.",
    ]
    if info:
        lines.append(
            f"{rows[0]['model']}: {info.get('model')} ({info.get('parameters', 0):,} parameters, "
            f"{info.get('precision')}); its random outputs are dense, so its vectors are cut to the "
            f"{info.get('pruned_to')} largest weights (MS MARCO's mean query length). splade-tiny: the real small "
            "model, unpruned. The paper's encoder is the trained BERT-base SPLADE."
        )
    return lines


def table_batch(data: dict | None) -> list[str]:
    fig = PAPER["batch"]["by_batch"]
    head = [
        "| B | ours ms | ours QPS | paper's kernel ms | paper's kernel QPS | ours exact | paper (H100) |",
        "|---:|---:|---:|---:|---:|:---:|---|",
    ]
    if data is None:
        return [*head, *(f"| {b} | {NOT_MEASURED} |  |  |  |  | {fig[b]} |" for b in sorted(fig))]
    rows = _rows(data, "batch")
    ours, paper = _systems(rows)
    lines = [*head]
    for b in sorted({r["batch_size"] for r in rows}):
        o, p = _by(rows, batch_size=b, system=ours), _by(rows, batch_size=b, system=paper)
        cells = [f"{_ms(r['ms_per_batch'])} | {r['qps']:,.0f}" if r else "— | —" for r in (o, p)]
        exact = "" if o is None else ("yes" if o["exact"] else "no")
        lines.append(f"| {b} | {cells[0]} | {cells[1]} | {exact} | {fig.get(b, '')} |")
    if rows:
        lines += [
            "",
            f"{ours} vs paper-scatter, {_size(rows[0]['n_docs'])} documents, k = {rows[0]['k']}, host to host.",
        ]
    return lines


def table_sparsity(data: dict | None) -> list[str]:
    head = [
        "| non-zeros / doc | postings | index MiB (paper layout) | paper's formula MiB | ours extra MiB | ours ms "
        "| paper's kernel ms | paper / ours |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if data is None:
        return [*head, f"| {NOT_MEASURED} |  |  |  |  |  |  |  |"]
    rows = _rows(data, "sparsity")
    ours, paper = _systems(rows)
    pb = PAPER["sparsity"]["posting_bytes"]
    colls = {c["doc_nnz"]: c for c in data.get("collections", []) if c.get("part") == "sparsity"}
    lines = [*head]
    for nnz in sorted(colls):
        c = colls[nnz]
        o, p = _by(rows, doc_nnz=nnz, system=ours), _by(rows, doc_nnz=nnz, system=paper)
        formula = c["n_postings"] * pb  # N · k̄ · 8 B (padding left out: the formula's lower end)
        ratio = "" if o is None or p is None else f"{p['ms_per_batch'] / o['ms_per_batch']:.2f}×"
        lines.append(
            f"| {nnz} | {c['n_postings']:,} | {_mib(c['index_bytes'])} | ≥ {_mib(formula)} | "
            f"{'' if o is None else _mib(o.get('derived_bytes'))} | {'' if o is None else _ms(o['ms_per_batch'])} | "
            f"{'' if p is None else _ms(p['ms_per_batch'])} | {ratio} |"
        )
    if rows:
        lines += [
            "",
            f"{_size(rows[0]['n_docs'])} synthetic documents, batch {rows[0]['batch_size']}, k = {rows[0]['k']}; "
            "document lengths scaled from the calibrated shape (sd and max in proportion to the mean). "
            "Paper's formula: N · k̄ · 8 B before padding. Ours extra: the tiled layout our engine derives and "
            f"keeps beside the paper-layout index. {PAPER['sparsity']['source']}.",
        ]
    return lines


def table_vocab(data: dict | None) -> list[str]:
    head = [
        "| vocabulary | non-empty lists | postings | index MiB | ours ms | paper's kernel ms | paper / ours |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if data is None:
        return [*head, f"| {NOT_MEASURED} |  |  |  |  |  |  |"]
    rows = _rows(data, "vocab")
    ours, paper = _systems(rows)
    colls = {c["n_terms"]: c for c in data.get("collections", []) if c.get("part") == "vocab"}
    lines = [*head]
    for v in sorted(colls):
        c = colls[v]
        o, p = _by(rows, n_terms=v, system=ours), _by(rows, n_terms=v, system=paper)
        ratio = "" if o is None or p is None else f"{p['ms_per_batch'] / o['ms_per_batch']:.2f}×"
        lines.append(
            f"| {v:,} | {c['stats'].get('nonempty_lists', 0):,} | {c['n_postings']:,} | {_mib(c['index_bytes'])} | "
            f"{'' if o is None else _ms(o['ms_per_batch'])} | {'' if p is None else _ms(p['ms_per_batch'])} | "
            f"{ratio} |"
        )
    if rows:
        lines += [
            "",
            f"{_size(rows[0]['n_docs'])} synthetic documents (same postings for every vocabulary; the share of terms "
            f"that occur kept), batch {rows[0]['batch_size']}, k = {rows[0]['k']}. {PAPER['vocab']['source']}.",
        ]
    return lines


def table_memory(data: dict | None) -> list[str]:
    fig = PAPER["memory"]
    head = [
        "| N | postings | index GiB, paper layout | index GiB, ours (paper layout + tiled) | peak GiB ours | "
        "peak GiB paper's kernel | peak GiB paper chunked | paper (H100) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def paper_cell(n: int) -> str:
        parts = [
            f"index {fig['index'][n]}" if n in fig["index"] else "",
            f"peak {fig['peak'][n]}" if n in fig["peak"] else "",
        ]
        return "; ".join(p for p in parts if p)

    if data is None:
        sizes = sorted(set(fig["index"]) | set(fig["peak"]))
        return [*head, *(f"| {_size(n)} | {NOT_MEASURED} |  |  |  |  |  | {paper_cell(n)} |" for n in sizes)]
    rows = [r for r in data["results"] if r.get("part") == "memory"]
    ok = [r for r in rows if r.get("status") == "ok"]
    ours = next((r["system"] for r in ok if r.get("family") == "ours"), None)
    lines = [*head]
    for n in sorted({r["n_docs"] for r in rows}):
        o = _by(ok, n_docs=n, system=ours)
        p = _by(ok, n_docs=n, system="paper-scatter")
        c = _by(ok, n_docs=n, system="paper-scatter-chunked")
        any_r = o or p or c
        if any_r is None:
            why = next((r.get("reason", "") for r in rows if r["n_docs"] == n), "")
            lines.append(f"| {_size(n)} | not measured: {why[:80]} |  |  |  |  |  | {paper_cell(n)} |")
            continue

        def peak(r: dict | None) -> str:
            return "" if r is None else _gib(r.get("peak_mem_bytes"))

        lines.append(
            f"| {_size(n)} | {any_r['n_postings']:,} | {_gib(any_r['paper_layout_bytes'])} | "
            f"{'' if o is None else _gib(o['index_bytes'])} | {peak(o)} | {peak(p)} | {peak(c)} | {paper_cell(n)} |"
        )
    if ok:
        lines += [
            "",
            f"Batch {ok[0]['batch_size']}, k = {ok[0]['k']}; peak = `torch.cuda.max_memory_allocated` over a "
            "system's first searches (the resident index included, and for ours the building of its tiled layout; "
            "no document CSR resident). Ours keeps the paper-layout index and derives the tiled layout (6 B a "
            "posting) beside it. Paper: real MS MARCO SPLADE (1.06e9 "
            "postings at 8.8M); ours: the calibrated synthetic collections.",
        ]
    return lines


def table_quality(data: dict | None) -> list[str]:
    fig = PAPER["quality"]["ndcg10"]
    head = [
        "| collection | docs | queries | nDCG@10 | RR@10 | R@100 | R@1000 | exact vs float64 scorer | "
        "paper nDCG@10 (full SPLADE) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    if data is None:
        return [*head, "| not yet measured |  |  |  |  |  |  |  |  |"]
    rows = _rows(data, "quality")
    lines = [*head]
    for r in sorted(rows, key=lambda r: r["collection"]):
        m, v = r["measures"], r["verify"]
        rec = v["recall"]
        check = (
            f"{'yes' if v['exact'] else 'NO'} (R@10/100/1000 "
            + "/".join("n/a" if rec.get(k) is None else f"{rec[k]:.4f}" for k in ("R@10", "R@100", "R@1000"))
            + f", max {v['max_ulp_score_diff']:.2g} ulp)"
        )
        name = r["collection"] + (" (subset)" if r.get("subset") else "")
        lines.append(
            f"| {name} | {r['documents']:,} | {r['queries']:,} | {m.get('nDCG@10', 0):.4f} | {m.get('RR@10', 0):.4f} | "
            f"{m.get('R@100', 0):.4f} | {m.get('R@1000', 0):.4f} | {check} | {fig.get(r['collection'], '—')} |"
        )
    if rows:
        lines += [
            "",
            f"Encoder: splade-tiny (`{rows[0]['model']}`, {rows[0]['encode_device']}), max pooling, documents 256 "
            f"tokens, queries 64; search: {rows[0]['system']}, k = {rows[0]['k']}; metrics: `ir_measures`; exactness: "
            "`gpusparse.verify` (scipy float64 over the encoded vectors, no index code). The paper's figures are "
            f"for a full-size SPLADE model; {PAPER['quality']['source']}; SciFact "
            f"{fig['scifact']} and TREC-COVID {fig['trec-covid']} are not in ../shared/data.",
        ]
    return lines


TABLES = {
    "e2e": table_e2e,
    "batch": table_batch,
    "sparsity": table_sparsity,
    "vocab": table_vocab,
    "memory": table_memory,
    "quality": table_quality,
}


def paper_markdown(datas: list[dict], *, heading: str = "###", require_gpu: bool = True) -> str:
    """Every table, each from its newest result, the paper's figures beside ours
    (``require_gpu=False``: speed tables from CPU dry runs too)."""
    out = [
        "The paper's figures (H100 80GB, real MS MARCO SPLADE; quoted in `bench/gpusparse_bench/paper_report.py` from "
        f"{SOURCE}) beside ours, measured by `gpusparse bench paper`. Cards and data differ: compare ours with the "
        "paper's kernel run beside it, and the paper's absolute figures only as such.",
        "",
    ]
    for part, render in TABLES.items():
        data = source_for(datas, part, require_gpu=require_gpu)
        out.append(f"{heading} {TITLES[part]}")
        out.append("")
        if data is None:
            out.append(
                f"*{NOT_MEASURED}*: no result of this part yet."
                if part in GPU_PARTS
                else "*not yet measured*: no result of this part yet."
            )
        else:
            out.append(_provenance(data))
        out.append("")
        out += render(data)
        skipped = (
            [] if data is None else [r for r in data["results"] if r.get("part") == part and r.get("status") != "ok"]
        )
        for r in skipped:
            what = r.get("system") or r.get("model") or r.get("collection") or ""
            out.append(f"- not measured: {what}: {r.get('status')}: {str(r.get('reason', ''))[:160]}")
        out.append("")
    return "\n".join(out)


def plots(datas: list[dict], out_dir: Path) -> list[Path]:
    """QPS vs batch (batch sweep, the paper's point) and ms vs non-zeros (sparsity); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    data = source_for(datas, "batch")
    if data is not None:
        rows = _rows(data, "batch")
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for system in sorted({r["system"] for r in rows}):
            pts = sorted((r["batch_size"], r["qps"]) for r in rows if r["system"] == system)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{system} (this run)")
        ax.plot([128], [118_704], marker="*", markersize=14, linestyle="", label="paper: 118,704 QPS at B 128 (H100)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("queries / s")
        ax.set_title(f"50K documents, top-10, {data['env'].get('card')}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "paper-batch-qps.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    data = source_for(datas, "sparsity")
    if data is not None:
        rows = _rows(data, "sparsity")
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for system in sorted({r["system"] for r in rows}):
            pts = sorted((r["doc_nnz"], r["ms_per_batch"]) for r in rows if r["system"] == system)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("non-zeros per document")
        ax.set_ylabel("ms per batch")
        ax.set_title(f"sparsity sweep, {data['env'].get('card')}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "paper-sparsity.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the paper-tables markers replaced by ``block``."""
    a, b = text.find(START), text.find(END)
    if a < 0 or b < a:
        raise ValueError(f"the markers {START} and {END} were not found (in this order)")
    return text[: a + len(START)] + "\n" + block.rstrip("\n") + "\n" + text[b:]


def render_paper(paths: list[Path], out_dir: Path, *, readme: Path | None = None) -> list[Path]:
    """Write ``out_dir/paper-tables.md`` and the plots; rewrite the README block if asked."""
    datas = load_results(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = paper_markdown(datas, heading="####")
    p = out_dir / "paper-tables.md"
    p.write_text(md)
    written = [p, *plots(datas, out_dir)]
    if readme is not None:
        sources = ", ".join(f"`{d['_path']}`" for d in datas) or "none yet"
        block = (
            f"<!-- generated by `gpusparse bench paper-report bench/results --out bench/results --readme {readme}` "
            f"from {sources}; regenerate, do not edit -->\n\n" + md
        )
        readme.write_text(replace_block(readme.read_text(), block))
        written.append(readme)
    return written
