"""``encode``: a BEIR folder's texts (or only its queries) into sparse-vector files (and optionally an index)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import click

from .. import __version__
from ..beir import Texts, beir_file, read_beir, read_queries
from ..index import Index
from ..pipeline import TextPipeline
from ..topics import read_query_texts
from ..vector_writers import write_jsonl
from ._common import friendly_errors, progress_option, warn
from ._text import echo_err, encoder_options, make_encoder, report_collection


@click.command("encode")
@click.argument("beir_dir", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder for corpus.jsonl.gz, queries.jsonl.gz, qrels.tsv and encoding.json.",
)
@encoder_options
@click.option("--decimals", type=click.IntRange(0, 9), help="Round weights to N decimals [default: exact float32].")
@click.option(
    "--contents",
    type=click.Choice(["all", "queries", "none"]),
    default="all",
    show_default=True,
    help="Which records keep their text in the 'contents' field.",
)
@click.option(
    "--queries-only",
    is_flag=True,
    help="Encode only the queries (no corpus): of BEIR_DIR, or of a text query file given as BEIR_DIR.",
)
@click.option("--index", "index_dir", type=click.Path(path_type=Path), help="Also index the corpus into this folder.")
@click.option("--overwrite", is_flag=True, help="Replace existing output files (and index).")
@progress_option
@friendly_errors
def encode_cmd(
    beir_dir: Path,
    output: Path,
    model: str,
    backend: str,
    pooling: str,
    query_max_length: int,
    doc_max_length: int,
    encode_batch_size: int,
    encode_device: str | None,
    dtype: str,
    prune_top: int | None,
    prune_threshold: float | None,
    split: str,
    decimals: int | None,
    contents: str,
    queries_only: bool,
    index_dir: Path | None,
    overwrite: bool,
    progress: bool,
) -> None:
    """Encode a BEIR folder's corpus and queries into sparse vectors.

    BEIR_DIR holds corpus.jsonl, queries.jsonl and (optionally) qrels/SPLIT.tsv. Writes
    JsonVectorCollection files OUTPUT/corpus.jsonl.gz and OUTPUT/queries.jsonl.gz (index
    the first, search with the second), a copy of the qrels as OUTPUT/qrels.tsv, and the
    settings and counts in OUTPUT/encoding.json. A document's text is title + " " + text.

    With --queries-only, only the queries are read and encoded (OUTPUT/queries.jsonl.gz, the
    qrels if BEIR_DIR has them, encoding.json); BEIR_DIR may then also be a text query file
    (BEIR queries.jsonl, Anserini JSONL or TSV topics).
    """
    if queries_only and index_dir is not None:
        raise click.UsageError("--index needs the corpus: drop --queries-only or --index")
    names = ("queries.jsonl.gz", "qrels.tsv", "encoding.json")
    targets = [output / n for n in (names if queries_only else ("corpus.jsonl.gz", *names))]
    if not overwrite:
        for path in [*targets, *([index_dir] if index_dir else [])]:
            if path.exists():
                raise FileExistsError(f"{path} already exists (use --overwrite to replace it)")
    if queries_only:
        query_texts, qrels_path = _read_queries_only(beir_dir, split)
        corpus = Texts([], [], query_texts.path)
    else:
        beir = read_beir(beir_dir, split, require_qrels=False)
        report_collection(beir)
        corpus, query_texts, qrels_path = beir.corpus, beir.queries, beir.qrels_path
    enc = make_encoder(
        model, pooling, query_max_length, doc_max_length, encode_batch_size, encode_device, dtype, backend
    )
    pipe = TextPipeline(corpus, query_texts, enc, log=echo_err)
    outputs = []
    if queries_only:
        queries = pipe.encode_queries(prune_top=prune_top, prune_threshold=prune_threshold, progress=progress)
    else:
        docs, queries = pipe.encode(prune_top=prune_top, prune_threshold=prune_threshold, progress=progress)
        outputs.append((docs, corpus, contents == "all", "corpus.jsonl.gz"))
    outputs.append((queries, query_texts, contents != "none", "queries.jsonl.gz"))
    output.mkdir(parents=True, exist_ok=True)
    for coll, texts, keep, name in outputs:
        tmp = output / f".tmp-{uuid.uuid4().hex[:8]}-{name}"  # keeps the .gz suffix
        try:
            write_jsonl(coll, tmp, contents=texts.texts if keep else None, decimals=decimals)
            os.replace(tmp, output / name)
        finally:
            tmp.unlink(missing_ok=True)
    if qrels_path is not None:
        shutil.copyfile(qrels_path, output / "qrels.tsv")
    settings = {
        "gpusparse": __version__,
        "source": str(beir_dir),
        "split": split,
        "model": enc.name,
        "backend": backend,
        "pooling": pooling,
        "query_max_length": query_max_length,
        "doc_max_length": doc_max_length,
        "dtype": dtype,
        "prune_top": prune_top,
        "prune_threshold": prune_threshold,
        "decimals": decimals,
        "document_text": "title + ' ' + text (text alone when the title is empty)",
        **({} if queries_only else {"corpus": pipe.doc_stats.as_dict()}),
        "queries": pipe.query_stats.as_dict(),
    }
    (output / "encoding.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    click.echo(f"wrote {output}/{', '.join(name for *_, name in outputs)}, encoding.json", err=True)
    if index_dir is not None:
        index = Index.build(outputs[0][0], progress=progress)
        index.save(index_dir, overwrite=overwrite)
        click.echo(f"indexed {index.n_docs:,} documents -> {index_dir}", err=True)


def _read_queries_only(path: Path, split: str) -> tuple[Texts, Path | None]:
    """``--queries-only``: the queries of a BEIR folder (and its qrels, if any) or of a text query file."""
    if path.is_dir():
        texts = read_queries(beir_file(path, "queries"))
        qrels = path / "qrels" / f"{split}.tsv"
        qrels_path = qrels if qrels.is_file() else None
    else:
        texts, qrels_path = read_query_texts(path), None
    click.echo(f"read {len(texts):,} queries from {texts.path}", err=True)
    if texts.n_empty:
        warn(f"{texts.path}: {texts.n_empty:,} queries have empty text; they get empty vectors")
    return texts, qrels_path
