"""``encode``: a BEIR folder's texts (or only its queries) into sparse-vector files and/or an index."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import click

from .. import __version__
from ..beir import Texts, beir_file, read_beir, read_queries
from ..pipeline import TextPipeline
from ..topics import read_query_texts
from ..vector_writers import VECTOR_FORMATS, write_jsonl, write_vectors
from ._common import friendly_errors, progress_option, warn
from ._text import echo_err, encoder_options, make_encoder, report_collection


@click.command("encode")
@click.argument("beir_dir", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Folder for the vectors (corpus.jsonl.gz, .npz or .bin; queries.jsonl.gz), qrels.tsv and "
    "encoding.json [default: none, with --index: no vector files].",
)
@encoder_options
@click.option(
    "--vectors-format",
    type=click.Choice(VECTOR_FORMATS),
    default="jsonl",
    show_default=True,
    help="The corpus file in OUTPUT: jsonl (corpus.jsonl.gz, with texts), npz (corpus.npz: GPUSparse's binary "
    "arrays, ids kept) or bin (corpus.bin: Seismic's binary format, no ids). Queries are always JSONL.",
)
@click.option(
    "--decimals", type=click.IntRange(0, 9), help="Round JSONL weights to N decimals [default: exact float32]."
)
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
    cuda_graphs: str,
    prune_top: int | None,
    prune_threshold: float | None,
    split: str,
    vectors_format: str,
    decimals: int | None,
    contents: str,
    queries_only: bool,
    index_dir: Path | None,
    overwrite: bool,
    progress: bool,
) -> None:
    """Encode a BEIR folder's corpus and queries into sparse vectors, and/or index the corpus.

    BEIR_DIR holds corpus.jsonl, queries.jsonl and (optionally) qrels/SPLIT.tsv. With
    -o OUTPUT, writes the corpus vectors as OUTPUT/corpus.jsonl.gz (JsonVectorCollection,
    exact float32 weights), corpus.npz or corpus.bin (--vectors-format), the query vectors as
    OUTPUT/queries.jsonl.gz (search with them), a copy of the qrels as OUTPUT/qrels.tsv, and
    the settings and counts in OUTPUT/encoding.json. A document's text is title + " " + text.

    With --index INDEX, the corpus vectors go straight from the encoder into the index
    builder, on the encoder's device, and the index is saved to INDEX: no vector file is
    written or read unless -o is given too (the index is the same either way). --index
    alone encodes the corpus only.

    With --queries-only, only the queries are read and encoded (OUTPUT/queries.jsonl.gz, the
    qrels if BEIR_DIR has them, encoding.json); BEIR_DIR may then also be a text query file
    (BEIR queries.jsonl, Anserini JSONL or TSV topics).
    """
    if queries_only and index_dir is not None:
        raise click.UsageError("--index needs the corpus: drop --queries-only or --index")
    if output is None and index_dir is None:
        raise click.UsageError("nothing to write: give -o OUTPUT (vector files), --index INDEX, or both")
    if decimals is not None and vectors_format != "jsonl":
        raise click.UsageError(f"--decimals rounds JSONL weights; --vectors-format {vectors_format} keeps float32")
    corpus_name = {"jsonl": "corpus.jsonl.gz", "npz": "corpus.npz", "bin": "corpus.bin"}[vectors_format]
    names = ("queries.jsonl.gz", "qrels.tsv", "encoding.json")
    targets = [] if output is None else [output / n for n in (names if queries_only else (corpus_name, *names))]
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
        model, pooling, query_max_length, doc_max_length, encode_batch_size, encode_device, dtype, backend, cuda_graphs
    )
    pipe = TextPipeline(corpus, query_texts, enc, log=echo_err)
    prune = {"prune_top": prune_top, "prune_threshold": prune_threshold, "progress": progress}
    outputs = []
    if queries_only:
        queries = pipe.encode_queries(**prune)
    elif output is None:
        docs = pipe.encode_documents(**prune)
    else:
        docs, queries = pipe.encode(**prune)
        outputs.append((docs, corpus, contents == "all", corpus_name))
    if output is not None:
        outputs.append((queries, query_texts, contents != "none", "queries.jsonl.gz"))
        _write_outputs(output, outputs, decimals)
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
            "vectors_format": vectors_format,
            "decimals": decimals,
            "document_text": "title + ' ' + text (text alone when the title is empty)",
            **({} if queries_only else {"corpus": pipe.doc_stats.as_dict()}),
            "queries": pipe.query_stats.as_dict(),
        }
        (output / "encoding.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        click.echo(f"wrote {output}/{', '.join(name for *_, name in outputs)}, encoding.json", err=True)
    if index_dir is not None:
        index = pipe.build_index(enc.device, progress=progress)
        t0 = time.perf_counter()
        index.save(index_dir, overwrite=overwrite)
        click.echo(
            f"indexed {index.n_docs:,} documents on {enc.device} in {pipe.index_seconds:.1f} s, "
            f"saved in {time.perf_counter() - t0:.1f} s -> {index_dir}",
            err=True,
        )


def _write_outputs(output: Path, outputs: list, decimals: int | None) -> None:
    """Write each ``(vectors, texts, keep texts, file name)`` to ``output`` (atomically: a
    temporary name, then a rename)."""
    output.mkdir(parents=True, exist_ok=True)
    for coll, texts, keep, name in outputs:
        tmp = output / f".tmp-{uuid.uuid4().hex[:8]}-{name}"  # keeps the suffix
        try:
            if name.endswith(".jsonl.gz"):
                write_jsonl(coll, tmp, contents=texts.texts if keep else None, decimals=decimals)
            else:
                write_vectors(coll, tmp)
            os.replace(tmp, output / name)
        finally:
            tmp.unlink(missing_ok=True)


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
