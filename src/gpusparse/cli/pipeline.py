"""``pipeline``: a BEIR folder's texts to metrics in one command (steps: :mod:`gpusparse.pipeline`)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import click
import torch

from .. import __version__
from ..beir import read_beir
from ..collection import SparseCollection
from ..evaluate import evaluate, format_table, parse_measures
from ..formats import ReadStats, read_vectors
from ..pipeline import TextPipeline
from ..vector_writers import VECTOR_FORMATS, write_jsonl, write_vectors
from ..vocab import Vocabulary
from ._common import (
    default_device,
    device_memory_limit_option,
    device_memory_scope,
    friendly_errors,
    limit_option,
    parse_size,
    progress_option,
    warn,
)
from ._text import echo_err, encoder_options, make_encoder, report_collection
from .eval import DEFAULT_MEASURES


@click.command("pipeline")
@click.argument("beir_dir", type=click.Path(path_type=Path))
@encoder_options
@click.option("-k", "--k", "k", default=1000, show_default=True, type=click.IntRange(min=1), help="Results per query.")
@click.option("-m", "--measures", default=DEFAULT_MEASURES, show_default=True, help="Measures (see gpusparse eval).")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Folder for run.trec and metrics.json [default: pipeline-<BEIR_DIR name>].",
)
@click.option(
    "--vectors",
    "vectors_path",
    type=click.Path(path_type=Path),
    help="Reuse these corpus vectors instead of encoding the corpus: a JSONL(.gz), .npz or Seismic .bin file "
    "(its records in corpus order), or a folder written by gpusparse encode (its corpus file) or by "
    "--save-vectors. The queries are still encoded.",
)
@click.option("--save-vectors", is_flag=True, help="Also write the vectors (exact float32) to OUTPUT/vectors/.")
@click.option(
    "--vectors-format",
    type=click.Choice(VECTOR_FORMATS),
    default="jsonl",
    show_default=True,
    help="--save-vectors' corpus file: corpus.jsonl.gz, corpus.npz or corpus.bin (queries: queries.jsonl.gz).",
)
@click.option("--save-index", is_flag=True, help="Also save the index to OUTPUT/index/.")
@click.option("--device", help="Where to index and search: cpu or cuda[:N] [default: cuda if available].")
@click.option("--memory-budget", default="1GiB", show_default=True, help="Bytes of search temporaries.")
@device_memory_limit_option
@click.option("--overwrite", is_flag=True, help="Replace the outputs of an earlier run in OUTPUT.")
@progress_option
@friendly_errors
def pipeline_cmd(
    beir_dir: Path,
    model: str,
    backend: str,
    pooling: str,
    query_max_length: int,
    doc_max_length: int,
    encode_batch_size: int,
    encode_device: str | None,
    dtype: str,
    cuda_graphs: str,
    prune_top: int | None,
    prune_threshold: float | None,
    split: str,
    k: int,
    measures: str,
    output: Path | None,
    vectors_path: Path | None,
    save_vectors: bool,
    vectors_format: str,
    save_index: bool,
    device: str | None,
    memory_budget: str,
    device_memory_limit: str | None,
    overwrite: bool,
    progress: bool,
) -> None:
    """Encode a BEIR folder, index it, search its judged queries and print the metrics.

    One command for text -> SPLADE vectors -> index -> exact top-k -> ir_measures metrics.
    Writes OUTPUT/run.trec and OUTPUT/metrics.json (settings, counts, metrics, timings).
    Only the queries judged in qrels/SPLIT.tsv are searched. With --vectors, the corpus is
    not encoded: its vectors are read (they must be those of BEIR_DIR's documents, encoded
    with the same model) and only the queries are encoded.

    Identical ids: query and document ids are separate namespaces, and no document is
    dropped for having its query's id (unlike BEIR's default ignore_identical_ids=True):
    in Cranfield and CISI numeric ids collide and such pairs can be truly relevant.
    """
    parsed = parse_measures(measures)
    budget = parse_size(memory_budget)
    limit = limit_option(device_memory_limit)
    output = output or Path(f"pipeline-{beir_dir.resolve().name}")
    if not overwrite:
        for path in (output / "run.trec", output / "metrics.json", output / "vectors", output / "index"):
            if path.exists():
                raise FileExistsError(f"{path} already exists (use --overwrite to replace it)")
    dev = default_device(device)
    t_start = time.perf_counter()
    beir = read_beir(beir_dir, split)
    report_collection(beir)
    judged = beir.judged_queries()
    if not len(judged):
        raise click.UsageError(f"none of the queries of {beir.queries.path} is judged in {beir.qrels_path}")
    enc = make_encoder(
        model, pooling, query_max_length, doc_max_length, encode_batch_size, encode_device, dtype, backend, cuda_graphs
    )
    pipe = TextPipeline(beir.corpus, judged, enc, log=echo_err)
    if vectors_path is None:
        docs, queries = pipe.encode(prune_top=prune_top, prune_threshold=prune_threshold, progress=progress)
    else:
        docs = _read_corpus_vectors(vectors_path, enc.vocab, progress, beir.corpus.ids)
        pipe.use_documents(docs)
        queries = pipe.encode_queries(prune_top=prune_top, prune_threshold=prune_threshold, progress=progress)
    output.mkdir(parents=True, exist_ok=True)
    if save_vectors:
        (output / "vectors").mkdir(exist_ok=True)
        name = {"jsonl": "corpus.jsonl.gz", "npz": "corpus.npz", "bin": "corpus.bin"}[vectors_format]
        write_vectors(docs, output / "vectors" / name)
        write_jsonl(queries, output / "vectors" / "queries.jsonl.gz", contents=judged.texts)
    # Under a limit the index is built on the host: its first search decides what goes to the GPU.
    index = pipe.build_index("cpu" if limit is not None and dev.startswith("cuda") else dev, progress=progress)
    if index.device.type != torch.device(dev).type:
        index.search_device = torch.device(dev)
        pipe.device = dev
    st = index.stats()
    click.echo(
        f"indexed {st.n_docs:,} documents, {st.n_postings:,} postings in {pipe.index_seconds:.1f} s on {dev}", err=True
    )
    if save_index:
        index.save(output / "index", overwrite=True)
    with device_memory_scope(limit):
        pipe.search(k, memory_budget=budget, progress=progress)
    run_path = output / "run.trec"
    n = pipe.write_run(run_path)
    click.echo(
        f"searched {len(queries):,} queries in {pipe.search_seconds:.3f} s; wrote {n:,} lines to {run_path}", err=True
    )
    ev = evaluate(run_path, beir.qrels, parsed)  # the run file as written, as `gpusparse eval` would score it
    for line in ev.warnings():
        warn(line)
    report = {
        "collection": beir.path.name,
        "gpusparse": __version__,
        "model": enc.name,
        "settings": {
            "pooling": pooling,
            "query_max_length": query_max_length,
            "doc_max_length": doc_max_length,
            "dtype": dtype,
            "prune_top": prune_top,
            "prune_threshold": prune_threshold,
            "split": split,
            "k": k,
            "backend": backend,
            "vectors": None if vectors_path is None else str(vectors_path),
        },
        **pipe.summary(),
        **ev.as_dict(),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.machine()},
    }
    (output / "metrics.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    click.echo(format_table([(beir.path.name, ev)], label="collection"))


def _read_corpus_vectors(path: Path, vocab: Vocabulary, progress: bool, corpus_ids: list[str]) -> SparseCollection:
    """``--vectors``: a vector file, a folder written by ``encode``/``--save-vectors`` (its
    corpus file, not its queries), or any folder of vector files; in the model's vocabulary.
    A Seismic ``.bin`` file holds no ids: its records are the corpus documents in order."""
    if path.is_dir():
        found = [path / n for n in ("corpus.jsonl.gz", "corpus.npz", "corpus.bin") if (path / n).is_file()]
        path = found[0] if found else path
    stats = ReadStats()
    docs = read_vectors(path, vocab, progress=progress, stats=stats)
    click.echo(f"read {stats.summary()} (corpus vectors; the corpus is not encoded)", err=True)
    if path.name.endswith(".bin") and len(docs) == len(corpus_ids):
        docs = SparseCollection(docs.indptr, docs.indices, docs.values, ids=corpus_ids, vocab=docs.vocab, copy=False)
    return docs
