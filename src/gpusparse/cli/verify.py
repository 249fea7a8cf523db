"""``verify``: check a top-k against an independent exact scorer (:mod:`gpusparse.verify`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np
import scipy.sparse as sp

from .. import engines
from ..collection import SparseCollection
from ..distributed import load_shard
from ..formats import read_vectors
from ..index import Index
from ..segment_files import is_segmented
from ..segments import SegmentedIndex
from ..shards import is_sharded, load_sharded, read_sharded_manifest
from ..verify import (
    documents_from_index_arrays,
    quantize_levels,
    quantize_query_rows,
    read_run,
    sample_rows,
    verify_run,
)
from ._common import default_device, fail, friendly_errors, parse_size, progress_option, unknown_option


@click.command("verify")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.argument("queries", type=click.Path(path_type=Path))
@click.option("--run", "run_file", type=click.Path(path_type=Path), help="Check this TREC run [default: search now].")
@click.option(
    "--docs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Score the original document vectors instead of the index's arrays (repeatable).",
)
@click.option("--at", "ks", default="10 100 1000", show_default=True, help="Cutoffs k for Recall@k.")
@click.option("--kernel", default="auto", show_default=True, help="Kernel to check when searching now.")
@click.option("--device", help="Where to search when searching now [default: cuda if available].")
@click.option("--memory-budget", default="256MiB", show_default=True, help="Bytes of float64 scores per chunk.")
@click.option("--sample", type=int, help="Check only N queries drawn at random (bounded memory and time at any size).")
@click.option("--seed", default=0, show_default=True, help="Seed of the --sample draw.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@unknown_option
@progress_option
@friendly_errors
def verify_cmd(
    index_dir: Path,
    queries: Path,
    run_file: Path | None,
    docs: tuple[Path, ...],
    ks: str,
    kernel: str,
    device: str | None,
    memory_budget: str,
    sample: int | None,
    seed: int,
    as_json: bool,
    unknown_tokens: str,
    progress: bool,
) -> None:
    """Check a top-k against an independent exact scorer (float64, scipy, CPU).

    Compares our search of INDEX_DIR with QUERIES (or the run given with --run) with exact
    float64 scores computed by scipy over document chunks. INDEX_DIR is any folder that
    search reads: plain, sharded (index --shards) or segmented (add/delete: only the live
    documents count). Strict: every score must equal
    float32(exact float64 sum), every list must be the exact ranking in order (ties by
    document number) and the rank column must count 1, 2, 3, ...; the first mismatches are
    listed. Exits with status 1 when not exact.

    Shared with GPUSparse: no search code. Quantization and the run's parsing are
    re-implemented in the checker; the query and --docs vector files are read with
    gpusparse's own vector reader (the one indexing uses).
    """
    try:
        cutoffs = sorted({int(x) for x in ks.replace(",", " ").split()})
    except ValueError:
        raise click.BadParameter("expected numbers such as '10 100 1000'", param_hint="--at") from None
    if not cutoffs or cutoffs[0] < 1:
        raise click.BadParameter("cutoffs must be positive", param_hint="--at")
    if kernel != "auto" and kernel not in engines.names():
        raise click.BadParameter(f"choose auto or one of {', '.join(engines.names())}", param_hint="--kernel")
    budget = parse_size(memory_budget)
    segmented, sharded = is_segmented(index_dir), is_sharded(index_dir)
    index: Any  # what the queries are read for: vocabulary and quantization
    if segmented:
        index = SegmentedIndex.load(index_dir)
    elif sharded:
        index = load_sharded(index_dir, range(1))[0]  # all shards share both
    else:
        index = Index.load(index_dir)
    qs = read_vectors(queries, index.vocab, unknown=unknown_tokens, progress=progress)  # type: ignore[arg-type]
    if sample is not None and sample < 1:
        raise click.BadParameter("must be positive", param_hint="--sample")
    if index.quantization is not None:  # exact for the vectors the index actually searches (own quantizer)
        qmat = quantize_query_rows(qs.to_scipy(), index.quantization.bits)
        qs = SparseCollection.from_scipy(qmat, ids=list(qs.ids), vocab=qs.vocab)
    if run_file is not None:
        run = read_run(run_file)
        name = str(run_file)
    else:
        dev = default_device(device)
        if segmented:
            index = SegmentedIndex.load(index_dir, device=dev)
            res = index.search(qs, max(cutoffs), kernel=kernel, progress=progress)
            names, ranked = index.position_ids, res.positions
        else:
            if sharded:
                index = load_shard(index_dir)[0]  # all shards as one index, as `gpusparse search` reads them
            res = index.search(qs, max(cutoffs), device=dev, kernel=kernel, progress=progress)
            names, ranked = index.ids, res.ids
        run = {
            qid: [
                (names[d], float(s)) for d, s in zip(ranked[i].tolist(), res.scores[i].tolist(), strict=True) if d >= 0
            ]
            for i, qid in enumerate(qs.ids)
        }
        name = f"search of {index_dir} ({dev})"
    if docs:
        coll = read_vectors(list(docs), index.vocab, unknown=unknown_tokens, progress=progress)  # type: ignore[arg-type]
        matrix, doc_ids = coll.to_scipy(), coll.ids
        if index.quantization is not None:
            matrix = quantize_levels(matrix, index.quantization.step, index.quantization.bits)
    else:
        terms = None
        if sample is not None:  # only the sampled queries' posting lists
            terms = np.unique(qs.to_scipy()[sample_rows(len(qs), sample, seed)].indices)
        matrix, doc_ids = folder_documents(index_dir, terms)
    report = verify_run(
        run,
        qs,
        matrix,
        doc_ids,
        ks=cutoffs,
        memory_budget=budget,
        progress=progress,
        run_name=str(run_file or ""),
        sample=sample,
        seed=seed,
    )
    if as_json:
        click.echo(json.dumps({"run": name, **report.as_dict()}, indent=2))
    else:
        click.echo(f"run: {name}")
        for line in report.lines():
            click.echo(line)
    if not report.exact:
        fail(f"{name} differs from exact search")


def folder_documents(index_dir: Path, terms: np.ndarray | None = None) -> tuple[sp.csr_matrix, list[str]]:
    """The documents an index folder searches, as ``[n_docs, V]`` CSR rows and their string
    ids, in the order that ranks ties (document number): a plain folder's documents; a sharded
    folder's shards one after the other; a segmented folder's live documents in global
    (insertion) order, deleted ones left out. Each part's arrays are read on their own and
    stacked here with scipy, not joined by the search code. ``terms``: read only these
    terms' posting lists (see :func:`documents_from_index_arrays`)."""
    if is_segmented(index_dir):
        seg = SegmentedIndex.load(index_dir)
        parts = [(s.index, ~s.deleted) for s in seg.segments]
        n_terms = len(seg.vocab)
    elif is_sharded(index_dir):
        n = len(read_sharded_manifest(index_dir)["shards"])
        parts = [(load_sharded(index_dir, range(i, i + 1))[0], None) for i in range(n)]
        n_terms = len(parts[0][0].vocab)
    else:
        index = Index.load(index_dir)
        parts = [(index, None)]
        n_terms = len(index.vocab)
    blocks: list[sp.csr_matrix] = []
    ids: list[str] = []
    for part, live in parts:
        arrays = {k: v.cpu().numpy() for k, v in part.arrays().items()}
        m = documents_from_index_arrays(
            arrays["doc_ids"], arrays["scores"], arrays["offsets"], arrays["lengths"], part.n_docs, terms
        )
        m.resize((m.shape[0], max(n_terms, m.shape[1])))
        names = part.ids
        if live is not None:
            keep = np.flatnonzero(live)
            m, names = m[keep], [names[j] for j in keep]
        blocks.append(m)
        ids += names
    if not blocks:  # a segmented folder with no segment
        return sp.csr_matrix((0, n_terms), dtype=np.float32), ids
    return sp.csr_matrix(sp.vstack(blocks, format="csr")), ids
