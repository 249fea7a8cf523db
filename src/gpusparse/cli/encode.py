"""``encode``: a BEIR folder's texts into sparse-vector files (and optionally an index)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import click

from .. import __version__
from ..beir import read_beir
from ..index import Index
from ..pipeline import TextPipeline
from ..vector_writers import write_jsonl
from ._common import friendly_errors, progress_option
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
@click.option("--index", "index_dir", type=click.Path(path_type=Path), help="Also index the corpus into this folder.")
@click.option("--overwrite", is_flag=True, help="Replace existing output files (and index).")
@progress_option
@friendly_errors
def encode_cmd(
    beir_dir: Path,
    output: Path,
    model: str,
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
    index_dir: Path | None,
    overwrite: bool,
    progress: bool,
) -> None:
    """Encode a BEIR folder's corpus and queries into sparse vectors.

    BEIR_DIR holds corpus.jsonl, queries.jsonl and (optionally) qrels/SPLIT.tsv. Writes
    JsonVectorCollection files OUTPUT/corpus.jsonl.gz and OUTPUT/queries.jsonl.gz (index
    the first, search with the second), a copy of the qrels as OUTPUT/qrels.tsv, and the
    settings and counts in OUTPUT/encoding.json. A document's text is title + " " + text.
    """
    targets = [output / n for n in ("corpus.jsonl.gz", "queries.jsonl.gz", "qrels.tsv", "encoding.json")]
    if not overwrite:
        for path in [*targets, *([index_dir] if index_dir else [])]:
            if path.exists():
                raise FileExistsError(f"{path} already exists (use --overwrite to replace it)")
    beir = read_beir(beir_dir, split, require_qrels=False)
    report_collection(beir)
    enc = make_encoder(model, pooling, query_max_length, doc_max_length, encode_batch_size, encode_device, dtype)
    pipe = TextPipeline(beir.corpus, beir.queries, enc, log=echo_err)
    docs, queries = pipe.encode(prune_top=prune_top, prune_threshold=prune_threshold, progress=progress)
    output.mkdir(parents=True, exist_ok=True)
    for coll, texts, keep, name in (
        (docs, beir.corpus, contents == "all", "corpus.jsonl.gz"),
        (queries, beir.queries, contents != "none", "queries.jsonl.gz"),
    ):
        tmp = output / f".tmp-{uuid.uuid4().hex[:8]}-{name}"  # keeps the .gz suffix
        try:
            write_jsonl(coll, tmp, contents=texts.texts if keep else None, decimals=decimals)
            os.replace(tmp, output / name)
        finally:
            tmp.unlink(missing_ok=True)
    if beir.qrels_path is not None:
        shutil.copyfile(beir.qrels_path, output / "qrels.tsv")
    settings = {
        "gpusparse": __version__,
        "source": str(beir_dir),
        "split": split,
        "model": enc.name,
        "pooling": pooling,
        "query_max_length": query_max_length,
        "doc_max_length": doc_max_length,
        "dtype": dtype,
        "prune_top": prune_top,
        "prune_threshold": prune_threshold,
        "decimals": decimals,
        "document_text": "title + ' ' + text (text alone when the title is empty)",
        "corpus": pipe.doc_stats.as_dict(),
        "queries": pipe.query_stats.as_dict(),
    }
    (output / "encoding.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    click.echo(f"wrote {output}/corpus.jsonl.gz, queries.jsonl.gz, encoding.json", err=True)
    if index_dir is not None:
        index = Index.build(docs, progress=progress)
        index.save(index_dir, overwrite=overwrite)
        click.echo(f"indexed {index.n_docs:,} documents -> {index_dir}", err=True)
