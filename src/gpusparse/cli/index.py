"""Build and update index folders: ``index``, ``info``, ``add``, ``delete``, ``compact``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from ..formats import ReadStats, read_vectors
from ..index import Index
from ..quantize import Quantization, quantize_collection
from ..segment_files import is_segmented
from ..segments import SegmentedIndex, UpdateReport, read_ids
from ..shard_updates import add_sharded, compact_sharded, delete_sharded, vocabulary_and_quantization
from ..shards import document_ranges, is_sharded, read_sharded_manifest, save_sharded
from ..storage import read_manifest
from ..vocab import Vocabulary
from ._common import (
    device_memory_limit_option,
    device_option,
    friendly_errors,
    limit_option,
    progress_option,
    unknown_option,
)
from ._memory import memory_report, print_memory
from .ciff import build_from_ciff


@click.command("index")
@click.argument("vectors", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--ciff",
    "ciff_path",
    type=click.Path(path_type=Path),
    help="Build from this CIFF file instead of VECTORS (as gpusparse import-ciff; without --quantize, "
    "a GPUSparse export keeps its impact bits, any other file gives float32 weights).",
)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Index folder to create.")
@click.option(
    "--vocab",
    default="bert",
    show_default=True,
    help="Vocabulary: 'bert', a vocab.txt, a tokenizer folder, or integer:N for term-id vectors.",
)
@unknown_option
@click.option("--device", default="cpu", show_default=True, help="Where to build: cpu or cuda[:N].")
@click.option(
    "--quantize",
    type=click.IntRange(1, 8),
    default=None,
    metavar="BITS",
    help="Store BITS-bit impacts (8 as Lucene, PISA and BMP); queries are quantized alike at search time.",
)
@click.option(
    "--shards",
    type=click.IntRange(min=1),
    help="Split the documents into N contiguous shards, one index folder each (for search --distributed).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing index at --output.")
@progress_option
@friendly_errors
def index_cmd(
    vectors: tuple[Path, ...],
    ciff_path: Path | None,
    output: Path,
    vocab: str,
    unknown_tokens: str,
    device: str,
    quantize: int | None,
    shards: int | None,
    overwrite: bool,
    progress: bool,
) -> None:
    """Build an index from sparse vectors.

    VECTORS are JsonVectorCollection (Anserini/Pyserini) or Seismic JSONL files, optionally
    gzipped, Seismic .bin files, or folders of them. Ids must be unique across all files.
    With --ciff IN.ciff (.gz read too), the index is built from a CIFF file (PISA, Anserini
    or GPUSparse exports) instead, as gpusparse import-ciff does.
    """
    if ciff_path is not None and vectors:
        raise click.UsageError("give VECTORS or --ciff, not both")
    if ciff_path is None and not vectors:
        raise click.UsageError("missing VECTORS (or --ciff IN.ciff)")
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists (use --overwrite to replace it)")
    if ciff_path is not None:
        if shards is not None:
            raise click.UsageError("--shards applies to VECTORS; import the CIFF file, then index its vectors")
        build_from_ciff(ciff_path, output, "auto" if quantize is None else quantize, None, device, overwrite)
        return
    t0 = time.perf_counter()
    stats = ReadStats()
    coll = read_vectors(vectors, Vocabulary.resolve(vocab), unknown=unknown_tokens, progress=progress, stats=stats)  # type: ignore[arg-type]
    click.echo(f"read {stats.summary()}", err=True)
    n_weights = coll.nnz
    dev = device_option(device) or "cpu"
    if shards is not None:
        quantization = None
        if quantize is not None:  # one step for the whole collection, so shards rank alike
            coll, report = quantize_collection(coll, quantize)
            quantization = report.quantization
            click.echo(
                f"quantized to {quantize}-bit impacts, step {quantization.step:g}: {report.n_dropped:,} of "
                f"{n_weights:,} weights fell below half a step and were dropped",
                err=True,
            )

        ranges = document_ranges(len(coll), shards)  # one shard built at a time
        parts = (_shard_index(coll[a:b], dev, quantization) for a, b in ranges)
        entries = save_sharded(parts, output, overwrite=overwrite)
        n_post = sum(e["n_postings"] for e in entries)
        click.echo(
            f"indexed {len(coll):,} documents, {n_post:,} postings in {len(entries)} shards of "
            f"{min(b - a for a, b in ranges):,}-{max(b - a for a, b in ranges):,} documents "
            f"in {time.perf_counter() - t0:.1f} s -> {output}",
            err=True,
        )
        return
    index = Index.build(coll, device=dev, progress=progress, quantize=quantize)
    del coll
    index.save(output, overwrite=overwrite)
    st = index.stats()
    if index.quantization is not None:
        click.echo(
            f"quantized to {quantize}-bit impacts, step {index.quantization.step:g}: "
            f"{n_weights - st.n_postings:,} of {n_weights:,} weights fell below half a step and were dropped",
            err=True,
        )
    click.echo(
        f"indexed {st.n_docs:,} documents, {st.n_postings:,} postings over {st.n_nonempty_terms:,} terms "
        f"({st.bytes / 2**20:,.1f} MiB) in {time.perf_counter() - t0:.1f} s -> {output}",
        err=True,
    )


def _shard_index(part: Any, device: str, quantization: Quantization | None) -> Index:
    """One shard's index; an already quantized shard keeps the whole collection's step."""
    index = Index.build(part, device=device)
    index.quantization = quantization
    return index


@click.command("info")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@click.option(
    "--device", help="Also predict the GPU memory a search on this device needs (cuda[:N]; no GPU is needed for this)."
)
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1), help="With --device.")
@click.option("-k", "--k", "k", default=1000, show_default=True, type=click.IntRange(min=1), help="With --device.")
@device_memory_limit_option
@friendly_errors
def info_cmd(
    index_dir: Path, as_json: bool, device: str | None, batch_size: int, k: int, device_memory_limit: str | None
) -> None:
    """Print an index's statistics: documents, terms, postings, padding, bytes.

    With --device cuda, also the GPU memory a search of --batch-size queries at -k will need,
    predicted from the saved index before anything is built or uploaded: per way of searching
    the bytes of each resident component, the temporaries and the peak; with
    --device-memory-limit, the way a search would take under it."""
    limit = limit_option(device_memory_limit)
    if device is not None and not device.startswith("cuda"):
        raise click.BadParameter("predicts GPU memory: give cuda or cuda:N", param_hint="--device")
    if device is not None and is_segmented(index_dir):
        raise click.UsageError("--device applies to plain and sharded index folders")
    memory = None if device is None else memory_report(index_dir, device, batch_size, k, limit)
    if is_segmented(index_dir):  # updated with add/delete/compact
        seg = SegmentedIndex.load(index_dir)
        info_seg = {
            "path": str(index_dir),
            "generation": seg.generation,
            "segments": len(seg.segments),
            "documents": seg.n_docs,
            "deleted_documents": seg.n_positions - seg.n_docs,
            "vocabulary_terms": len(seg.vocab),
            "postings": sum(s.index.stats().n_postings for s in seg.segments),
        }
        if as_json:
            click.echo(json.dumps(info_seg, indent=2))
            return
        click.echo(f"index          {index_dir} (segmented, generation {seg.generation})")
        click.echo(f"segments       {len(seg.segments):,} (gpusparse compact merges them)")
        click.echo(f"documents      {seg.n_docs:,} live, {info_seg['deleted_documents']:,} deleted")
        click.echo(f"vocabulary     {len(seg.vocab):,} terms")
        click.echo(f"postings       {info_seg['postings']:,} (deleted documents' included until compaction)")
        return
    if is_sharded(index_dir):
        _info_sharded(index_dir, as_json, memory)
        return
    m = read_manifest(index_dir)
    n_bytes = sum(f["bytes"] for f in m["files"].values())
    info = {
        "path": str(index_dir),
        "format_version": m["format_version"],
        "created_by": m.get("created_by"),
        "documents": m["n_docs"],
        "empty_documents": m.get("n_empty_docs"),
        "vocabulary_terms": m["n_terms"],
        "postings": m["n_postings"],
        "padded_postings": m["n_padded"],
        "padding_overhead": (m["n_padded"] - m["n_postings"]) / m["n_postings"] if m["n_postings"] else 0.0,
        "bytes_on_disk": n_bytes,
        "quantization": m.get("quantization"),
    }
    if memory is not None:
        info["gpu_memory"] = memory
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"index          {index_dir} (format {m['format_version']}, {m.get('created_by')})")
    click.echo(f"documents      {m['n_docs']:,} ({m.get('n_empty_docs', 0):,} empty)")
    click.echo(f"vocabulary     {m['n_terms']:,} terms")
    click.echo(f"postings       {m['n_postings']:,} (+{info['padding_overhead']:.1%} padding to multiples of 32)")
    click.echo(f"size on disk   {n_bytes / 2**20:,.1f} MiB")
    if m.get("quantization"):
        qz = m["quantization"]
        click.echo(f"quantization   {qz['bits']}-bit impacts, step {qz['step']:g} (queries quantized alike)")
    if memory is not None:
        print_memory(memory)


def _info_sharded(index_dir: Path, as_json: bool, memory: dict | None) -> None:
    m = read_sharded_manifest(index_dir)
    shards = []
    for e in m["shards"]:
        sm = read_manifest(index_dir / e["name"])
        shards.append(
            {
                "name": e["name"],
                "offset": e["offset"],
                "documents": e["n_docs"],
                "postings": sm["n_postings"],
                "bytes_on_disk": sum(f["bytes"] for f in sm["files"].values()),
            }
        )
    info = {
        "path": str(index_dir),
        "format_version": m["format_version"],
        "created_by": m.get("created_by"),
        "documents": m["n_docs"],
        "vocabulary_terms": m["n_terms"],
        "postings": sum(sh["postings"] for sh in shards),
        "bytes_on_disk": sum(sh["bytes_on_disk"] for sh in shards),
        "shards": shards,
    }
    if memory is not None:
        info["gpu_memory"] = memory
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"index          {index_dir} (sharded, format {m['format_version']}, {m.get('created_by')})")
    click.echo(f"documents      {m['n_docs']:,}")
    click.echo(f"vocabulary     {m['n_terms']:,} terms")
    click.echo(f"postings       {info['postings']:,}")
    click.echo(f"size on disk   {info['bytes_on_disk'] / 2**20:,.1f} MiB")
    click.echo(f"shards         {len(shards)} (search --distributed: one or more per process)")
    for sh in shards:
        last = sh["offset"] + sh["documents"] - 1
        click.echo(
            f"  {sh['name']}     documents {sh['offset']:,}-{last:,}, {sh['postings']:,} postings, "
            f"{sh['bytes_on_disk'] / 2**20:,.1f} MiB"
        )
    if memory is not None:
        print_memory(memory)


# -- updates: add, delete, compact (gpusparse.segments) --------------------------------------


def _segments_summary(index: SegmentedIndex) -> str:
    n = len(index.segments)
    return f"{index.n_docs:,} live documents in {n:,} segment{'s' if n != 1 else ''} (generation {index.generation})"


def _sharded_summary(index_dir: Path, generation: int) -> str:
    m = read_sharded_manifest(index_dir)
    n = len(m["shards"])
    return f"{m['n_docs']:,} documents in {n:,} shard{'s' if n != 1 else ''} (generation {generation})"


def _unknown(rep: UpdateReport) -> str:
    """`` (2 ids not found: 'a', 'b')``, or nothing."""
    if not rep.unknown:
        return ""
    listed = ", ".join(repr(i) for i in rep.unknown_ids[:5]) + (", ..." if rep.unknown > 5 else "")
    return f" ({rep.unknown:,} id{'s' if rep.unknown != 1 else ''} not found: {listed})"


@click.command("add")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.argument("vectors", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--upsert", is_flag=True, help="Replace documents whose ids are already in the index.")
@click.option(
    "--max-shard-docs",
    type=click.IntRange(min=1),
    help="Sharded folders: the most documents the last shard may hold after the add; more go to a new "
    "shard [default: as many as the largest shard].",
)
@unknown_option
@progress_option
@friendly_errors
def add_cmd(
    index_dir: Path,
    vectors: tuple[Path, ...],
    upsert: bool,
    max_shard_docs: int | None,
    unknown_tokens: str,
    progress: bool,
) -> None:
    """Add the documents in VECTORS to INDEX_DIR, without a rebuild.

    An id already in the index is an error unless --upsert. The change is atomic: a crash
    leaves the index as it was before or after. A plain index folder is converted in place
    to a segmented one on the first update (the documents go to a new segment). In a sharded
    folder (index --shards) they go to the last shard, or to a new shard when the last one
    would exceed --max-shard-docs.
    """
    sharded = is_sharded(index_dir)
    if max_shard_docs is not None and not sharded:
        raise click.UsageError("--max-shard-docs applies to sharded index folders (index --shards)")
    index = None if sharded else SegmentedIndex.load(index_dir)
    vocab = vocabulary_and_quantization(index_dir)[0] if index is None else index.vocab
    stats = ReadStats()
    coll = read_vectors(vectors, vocab, unknown=unknown_tokens, progress=progress, stats=stats)  # type: ignore[arg-type]
    click.echo(f"read {stats.summary()}", err=True)
    if index is None:
        rep = add_sharded(index_dir, coll, upsert=upsert, max_shard_docs=max_shard_docs)
        summary = _sharded_summary(index_dir, rep.generation)
    else:
        rep = index.add(coll, upsert=upsert)
        summary = _segments_summary(index)
    replaced = f" ({rep.deleted:,} replaced)" if rep.deleted else ""
    click.echo(f"added {rep.added:,} documents{replaced} -> {index_dir}: {summary}", err=True)


@click.command("delete")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.argument("ids_file", type=click.Path(path_type=Path))
@friendly_errors
def delete_cmd(index_dir: Path, ids_file: Path) -> None:
    """Delete the documents whose ids are listed in IDS_FILE (one per line; '-' reads stdin).

    Ids not in the index are counted and listed, not an error. In a plain or segmented folder
    the documents stay on disk, marked deleted, until `gpusparse compact`; in a sharded
    folder the shards holding them are rewritten without them.
    """
    ids = read_ids(ids_file)
    if is_sharded(index_dir):
        rep = delete_sharded(index_dir, ids)
        summary = _sharded_summary(index_dir, rep.generation)
    else:
        index = SegmentedIndex.load(index_dir)
        rep = index.delete(ids)
        summary = _segments_summary(index)
    click.echo(f"deleted {rep.deleted:,} documents{_unknown(rep)} -> {index_dir}: {summary}", err=True)


@click.command("compact")
@click.argument("index_dir", type=click.Path(path_type=Path))
@friendly_errors
def compact_cmd(index_dir: Path) -> None:
    """Merge INDEX_DIR's segments into one and drop its deleted documents (same results).

    A sharded folder's documents are spread evenly over its shards again (sizes within one,
    as index --shards makes them; same results).
    """
    if is_sharded(index_dir):
        m = read_sharded_manifest(index_dir)
        rep = compact_sharded(index_dir)
        what = "shard sizes already even" if rep.generation == m.get("generation", 0) else "spread the documents evenly"
        click.echo(f"{what} -> {index_dir}: {_sharded_summary(index_dir, rep.generation)}", err=True)
        return
    index = SegmentedIndex.load(index_dir)
    before_n = len(index.segments)
    rep = index.compact()
    click.echo(
        f"compacted {before_n:,} segments, dropped {rep.deleted:,} deleted documents -> {index_dir}: "
        f"{_segments_summary(index)}",
        err=True,
    )
