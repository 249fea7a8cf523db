"""The ``gpusparse`` command line: ``index``, ``search``, ``info``.

Errors a user can cause are printed as one line (``gpusparse: error: FILE:LINE: ...``)
with exit status 1; usage errors exit with 2.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from . import __version__

F = TypeVar("F", bound=Callable[..., Any])
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512MB"``, ``"1048576"`` → bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size such as 512MiB, 2GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[unit])


def _fail(message: str) -> None:
    click.echo(f"gpusparse: error: {message}", err=True)
    sys.exit(1)


def friendly_errors(fn: F) -> F:
    """Turn the errors a user can cause into one line and exit status 1."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        from .errors import GPUSparseError

        try:
            return fn(*args, **kwargs)
        except GPUSparseError as exc:
            _fail(str(exc))
        except FileExistsError as exc:
            _fail(str(exc))
        except torch.cuda.OutOfMemoryError:
            _fail("out of GPU memory: lower --batch-size or --memory-budget")
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(f"{where}{exc.strerror or exc}")

    return wrapper  # type: ignore[return-value]


def _device(name: str | None) -> str | None:
    import torch

    if name is None:
        return None
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise click.BadParameter("CUDA is not available on this machine", param_hint="--device")
    return name


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=__version__, prog_name="gpusparse")  # also when run from a source tree
def main() -> None:
    """GPUSparse: exact retrieval over learned sparse vectors (SPLADE and kin), batched on the GPU.

    \b
    Typical use:
      gpusparse index corpus.jsonl.gz --output my-index
      gpusparse search my-index queries.jsonl.gz --k 1000 --output run.trec
      gpusparse info my-index
    """


progress_option = click.option(
    "--progress/--no-progress", default=True, show_default=True, help="Progress bars on a terminal."
)
unknown_option = click.option(
    "--unknown-tokens",
    type=click.Choice(["error", "skip"]),
    default="error",
    show_default=True,
    help="A token missing from the vocabulary is an error, or is dropped and counted.",
)


@main.command("index")
@click.argument("vectors", nargs=-1, required=True, type=click.Path(path_type=Path))
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
    """
    from .formats import ReadStats, read_vectors
    from .index import Index
    from .vocab import Vocabulary

    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists (use --overwrite to replace it)")
    t0 = time.perf_counter()
    stats = ReadStats()
    coll = read_vectors(vectors, Vocabulary.resolve(vocab), unknown=unknown_tokens, progress=progress, stats=stats)  # type: ignore[arg-type]
    click.echo(f"read {stats.summary()}", err=True)
    n_weights = coll.nnz
    dev = _device(device) or "cpu"
    if shards is not None:
        from .shards import document_ranges, save_sharded

        quantization = None
        if quantize is not None:  # one step for the whole collection, so shards rank alike
            from .quantize import quantize_collection

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


def _shard_index(part: Any, device: str, quantization: Any) -> Any:
    """One shard's index; an already quantized shard keeps the whole collection's step."""
    from .index import Index

    index = Index.build(part, device=device)
    index.quantization = quantization
    return index


@main.command("search")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.argument("queries", type=click.Path(path_type=Path))
@click.option("-k", "--k", "k", default=1000, show_default=True, type=click.IntRange(min=1), help="Results per query.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="TREC run file to write.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Queries scored together [default: from the budget].")
@click.option("--device", help="cpu or cuda[:N] [default: cuda if available, else cpu].")
@click.option(
    "--kernel",
    type=click.Choice(["auto", "reference", "scatter", "docpar", "tiled"]),
    default="auto",
    show_default=True,
    help="Scoring kernel; auto picks the fastest exact one for the device.",
)
@click.option("--memory-budget", default="1GiB", show_default=True, help="Bytes of search temporaries.")
@click.option("--tag", default="gpusparse", show_default=True, help="Run tag (last column).")
@unknown_option
@click.option("--verify/--no-verify", default=True, show_default=True, help="Check the index files' checksums.")
@click.option(
    "--distributed",
    is_flag=True,
    help="Under torchrun: each process searches its shards (one GPU each, else the CPU) and the "
    "results are merged on the device; process 0 writes the run.",
)
@click.option(
    "--index-memory",
    help="Device memory the index (or a process's shards) may use; a larger one is streamed from "
    "host memory in pieces [default: 90% of the GPU's free memory; no limit on cpu].",
)
@click.option("--pieces", type=click.IntRange(min=1), help="Stream the index in N pieces (forces streaming).")
@progress_option
@friendly_errors
def search_cmd(
    index_dir: Path,
    queries: Path,
    k: int,
    output: Path,
    batch_size: int | None,
    device: str | None,
    kernel: str,
    memory_budget: str,
    tag: str,
    unknown_tokens: str,
    verify: bool,
    distributed: bool,
    index_memory: str | None,
    pieces: int | None,
    progress: bool,
) -> None:
    """Search an index with the queries in QUERIES and write a TREC run.

    QUERIES is a JsonVectorCollection JSONL(.gz) (or Seismic JSONL/.bin) file read in the
    index's vocabulary; its ids become the run's query ids. With --distributed, start one
    process per GPU: torchrun --nproc-per-node=N $(which gpusparse) search ... --distributed
    (the run equals a single process's, byte for byte).
    """
    import torch

    from .formats import ReadStats, read_vectors

    budget = parse_size(memory_budget)
    if budget < 1 << 16:
        raise click.BadParameter("must be at least 64KiB", param_hint="--memory-budget")
    index_budget = None if index_memory is None else parse_size(index_memory)
    if not output.parent.is_dir():
        raise click.BadParameter(f"folder {output.parent} does not exist", param_hint="--output")
    if tag.split() != [tag]:
        raise click.BadParameter("must be one word", param_hint="--tag")
    if distributed:
        _search_distributed(
            index_dir, queries, k, output, batch_size, device, kernel, budget, tag, unknown_tokens, verify,
            index_budget, pieces, progress,
        )  # fmt: skip
        return
    dev = _device(device) or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_kernel(kernel, dev)
    from .segments import SegmentedIndex, is_segmented

    # An index updated with add/delete/compact is a segmented folder: search its snapshot.
    segmented = is_segmented(index_dir)
    if segmented:
        if index_budget is not None or pieces is not None:
            raise click.UsageError("--index-memory and --pieces apply to plain and sharded index folders")
        index: Any = SegmentedIndex.load(index_dir, device=dev, verify=verify)
    else:
        from .distributed import load_shard, open_for_search

        host, _, _ = load_shard(index_dir, verify=verify)
        index = open_for_search(
            host, dev, kernel=kernel, index_memory=index_budget, pieces=pieces, memory_budget=budget
        )
    stats = ReadStats()
    qs = read_vectors(queries, index.vocab, unknown=unknown_tokens, progress=progress, stats=stats)  # type: ignore[arg-type]
    click.echo(f"read {stats.summary()}", err=True)
    t0 = time.perf_counter()
    res = index.search(qs, k, batch_size=batch_size, kernel=kernel, memory_budget=budget, progress=progress)
    dt = time.perf_counter() - t0
    if segmented:
        doc_names, ranked = index.position_ids, res.positions
    else:
        doc_names, ranked = index.ids, res.ids
    n = _write_run(output, qs.ids, doc_names, res.scores, ranked, tag)
    qps = len(qs) / dt if dt > 0 else float("inf")
    streamed = f" (streamed in {len(index.pieces)} pieces)" if hasattr(index, "pieces") else ""
    click.echo(
        f"searched {len(qs):,} queries on {dev}{streamed} in {dt:.3f} s ({qps:,.0f} queries/s); "
        f"wrote {n:,} lines to {output}",
        err=True,
    )


def _check_kernel(kernel: str, dev: str) -> None:
    import torch

    from .search import choose_kernel

    try:
        choose_kernel(kernel, torch.device(dev))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kernel") from None


def _write_run(output: Path, qids: list[str], doc_names: list[str], scores: Any, ranked: Any, tag: str) -> int:
    """Write a TREC run atomically (temporary file, then rename); the number of lines."""
    from .formats import write_trec_run

    tmp = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        n = write_trec_run(tmp, qids, doc_names, scores.numpy(), ranked.numpy(), tag=tag)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def _search_distributed(
    index_dir: Path,
    queries: Path,
    k: int,
    output: Path,
    batch_size: int | None,
    device: str | None,
    kernel: str,
    budget: int,
    tag: str,
    unknown_tokens: str,
    verify: bool,
    index_budget: int | None,
    pieces: int | None,
    progress: bool,
) -> None:
    """``search --distributed``: one process of a torchrun group (see gpusparse.distributed).

    Set-up errors (a missing shard, bad queries) are shared before any search, so that every
    process stops: process 0 prints the first one, the others exit with status 1 silently.
    """
    import torch.distributed as dist

    from .distributed import first_error, init_from_env, load_shard, open_for_search, search_sharded
    from .errors import GPUSparseError
    from .formats import ReadStats, read_vectors
    from .shards import is_sharded, shard_ids

    rank, world, dev = init_from_env(device)
    try:
        error = None
        try:
            _check_kernel(kernel, str(dev))
            host, offset, n_docs = load_shard(index_dir, rank, world, verify=verify)
            shard = open_for_search(
                host, dev, kernel=kernel, index_memory=index_budget, pieces=pieces, memory_budget=budget
            )
            stats = ReadStats()
            qs = read_vectors(queries, shard.vocab, unknown=unknown_tokens, progress=False, stats=stats)  # type: ignore[arg-type]
            names: list[str] = []
            if rank == 0:
                names = shard_ids(index_dir, verify=verify) if is_sharded(index_dir) else host.ids
        except (GPUSparseError, OSError, click.BadParameter) as exc:
            where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
            error = where + (exc.format_message() if isinstance(exc, click.BadParameter) else str(exc))
        failed = first_error(error)
        if failed is not None:
            if rank == 0:
                _fail(failed[1] if world == 1 else f"process {failed[0]}: {failed[1]}")
            sys.exit(1)
        if rank == 0:
            click.echo(f"read {stats.summary()}", err=True)
        t0 = time.perf_counter()
        res = search_sharded(
            shard, qs, k, offset=offset, n_docs=n_docs, batch_size=batch_size, kernel=kernel,
            memory_budget=budget, progress=progress and rank == 0,
        )  # fmt: skip
        dt = time.perf_counter() - t0
        if rank == 0:
            n = _write_run(output, qs.ids, names, res.scores, res.ids, tag)
            qps = len(qs) / dt if dt > 0 else float("inf")
            click.echo(
                f"searched {len(qs):,} queries on {world} processes ({dev.type}) in {dt:.3f} s "
                f"({qps:,.0f} queries/s); wrote {n:,} lines to {output}",
                err=True,
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


@main.command("info")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@friendly_errors
def info_cmd(index_dir: Path, as_json: bool) -> None:
    """Print an index's statistics: documents, terms, postings, padding, bytes."""
    from .segments import SegmentedIndex, is_segmented
    from .storage import read_manifest

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
    from .shards import is_sharded

    if is_sharded(index_dir):
        _info_sharded(index_dir, as_json)
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


def _info_sharded(index_dir: Path, as_json: bool) -> None:
    from .shards import read_sharded_manifest
    from .storage import read_manifest

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


# -- text to metrics: encode, eval, pipeline, verify -----------------------------------------


# The encoder's defaults, spelled out so that ``--help`` does not import torch (a test checks them).
_ENCODE_DEFAULTS = {
    "model": "naver/splade-cocondenser-ensembledistil",
    "query_max_length": 64,
    "doc_max_length": 256,
    "batch_size": 32,
}


def _encoder_options(fn: F) -> F:
    """Options shared by ``encode`` and ``pipeline`` (defaults: those of :mod:`gpusparse.encode`)."""
    options = [
        click.option(
            "--model",
            default=_ENCODE_DEFAULTS["model"],
            show_default=True,
            help="SPLADE-style masked-LM model: a local folder or a hub id.",
        ),
        click.option(
            "--pooling",
            type=click.Choice(["max", "sum"]),
            default="max",
            show_default=True,
            help="max: SPLADE v2/++; sum: original SPLADE.",
        ),
        click.option(
            "--query-max-length",
            type=click.IntRange(min=2),
            default=_ENCODE_DEFAULTS["query_max_length"],
            show_default=True,
            help="Tokens per query ([CLS]/[SEP] included); longer queries are truncated and counted.",
        ),
        click.option(
            "--doc-max-length",
            type=click.IntRange(min=2),
            default=_ENCODE_DEFAULTS["doc_max_length"],
            show_default=True,
            help="Tokens per document; longer documents are truncated and counted.",
        ),
        click.option(
            "--encode-batch-size",
            type=click.IntRange(min=1),
            default=_ENCODE_DEFAULTS["batch_size"],
            show_default=True,
            help="Texts per forward pass (batches are sorted by length).",
        ),
        click.option("--encode-device", help="Where the model runs: cpu or cuda[:N] [default: cuda if available]."),
        click.option(
            "--dtype",
            type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
            default="auto",
            show_default=True,
            help="auto: bf16/fp16 autocast on a GPU, float32 on the CPU.",
        ),
        click.option("--prune-top", type=click.IntRange(min=1), help="Keep the N largest weights of each vector."),
        click.option("--prune-threshold", type=click.FloatRange(min=0), help="Drop weights below this value."),
        click.option("--split", default="test", show_default=True, help="Qrels split: BEIR_DIR/qrels/SPLIT.tsv."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _make_encoder(model: str, pooling: str, qlen: int, dlen: int, batch: int, device: str | None, dtype: str) -> Any:
    from .encode import SpladeEncoder

    enc = SpladeEncoder(
        model,
        pooling=pooling,  # type: ignore[arg-type]
        query_max_length=qlen,
        doc_max_length=dlen,
        batch_size=batch,
        device=_device(device),
        dtype=dtype,  # type: ignore[arg-type]
    )
    precision = (
        "float32" if enc.autocast_dtype is None else f"{str(enc.autocast_dtype).removeprefix('torch.')} autocast"
    )
    click.echo(f"loaded {enc.name} ({pooling} pooling, {enc.device}, {precision})", err=True)
    return enc


def _warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def _report_collection(beir: Any) -> None:
    """Print what was read and the counted warnings about a BEIR folder."""
    judged = beir.judged_queries()
    qrels = f", {sum(len(v) for v in beir.qrels.values()):,} judgments" if beir.qrels_path else ", no qrels"
    click.echo(
        f"read {beir.path.name}: {len(beir.corpus):,} documents, {len(beir.queries):,} queries "
        f"({len(judged):,} judged){qrels}",
        err=True,
    )
    if beir.qrels_path is not None:
        check = beir.check_qrels()
        for line in check.warnings(beir.qrels_path):
            _warn(line)
        if check.identical_id_pairs:
            click.echo(
                f"note: {check.identical_id_pairs:,} relevant judged pairs have equal query and document ids; "
                "they are kept (see gpusparse eval --help)",
                err=True,
            )
    for name, texts in (("documents", beir.corpus), ("queries", beir.queries)):
        if texts.n_empty:
            _warn(f"{texts.path}: {texts.n_empty:,} {name} have empty text; they get empty vectors")


def _encode_beir(
    enc: Any, beir: Any, queries: Any, prune_top: int | None, prune_threshold: float | None, progress: bool
):
    from .encode import EncodeStats

    out = []
    for kind, texts in (("document", beir.corpus), ("query", queries)):
        stats = EncodeStats()
        coll = enc.encode(
            texts.texts,
            texts.ids,
            kind=kind,
            prune_top=prune_top,
            prune_threshold=prune_threshold,
            progress=progress,
            stats=stats,
        )
        click.echo(stats.summary(), err=True)
        out.append((coll, stats))
    return out


@main.command("encode")
@click.argument("beir_dir", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder for corpus.jsonl.gz, queries.jsonl.gz, qrels.tsv and encoding.json.",
)
@_encoder_options
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
    import shutil

    from .beir import read_beir
    from .formats import write_jsonl
    from .index import Index

    targets = [output / n for n in ("corpus.jsonl.gz", "queries.jsonl.gz", "qrels.tsv", "encoding.json")]
    if not overwrite:
        for path in [*targets, *([index_dir] if index_dir else [])]:
            if path.exists():
                raise FileExistsError(f"{path} already exists (use --overwrite to replace it)")
    beir = read_beir(beir_dir, split, require_qrels=False)
    _report_collection(beir)
    enc = _make_encoder(model, pooling, query_max_length, doc_max_length, encode_batch_size, encode_device, dtype)
    (docs, dstats), (queries, qstats) = _encode_beir(enc, beir, beir.queries, prune_top, prune_threshold, progress)
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
        "corpus": dstats.as_dict(),
        "queries": qstats.as_dict(),
    }
    (output / "encoding.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    click.echo(f"wrote {output}/corpus.jsonl.gz, queries.jsonl.gz, encoding.json", err=True)
    if index_dir is not None:
        index = Index.build(docs, progress=progress)
        index.save(index_dir, overwrite=overwrite)
        click.echo(f"indexed {index.n_docs:,} documents -> {index_dir}", err=True)


@main.command("eval")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("qrels", type=click.Path(path_type=Path))
@click.option(
    "-m",
    "--measures",
    default="RR@10 nDCG@10 R@100 R@1000",
    show_default=True,
    help="Any measures ir_measures parses, separated by spaces (e.g. 'AP P@5 nDCG@20' or TREC 'ndcg_cut.10').",
)
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@friendly_errors
def eval_cmd(run: Path, qrels: Path, measures: str, as_json: bool) -> None:
    """Compute retrieval metrics of a TREC run with ir_measures.

    QRELS are TREC qrels (qid iter docid grade) or BEIR TSV (query-id corpus-id score).
    Every judged query counts: one without results in the run scores 0. Queries of the
    run without judgments are ignored. Both are counted in warnings. Documents are ranked
    by score, ties broken by ir_measures (the rank column is not used), as trec_eval does.

    Identical ids: query and document ids are separate namespaces, and no document is
    dropped for having its query's id (unlike BEIR's default ignore_identical_ids=True):
    in Cranfield and CISI numeric ids collide and such pairs can be truly relevant.
    """
    from .evaluate import evaluate, format_table, parse_measures

    parsed = parse_measures(measures)
    ev = evaluate(run, qrels, parsed)
    for line in ev.warnings():
        _warn(line)
    if as_json:
        click.echo(json.dumps({"run": str(run), "qrels": str(qrels), **ev.as_dict()}, indent=2))
    else:
        click.echo(format_table([(str(run), ev)]))


@main.command("pipeline")
@click.argument("beir_dir", type=click.Path(path_type=Path))
@_encoder_options
@click.option("-k", "--k", "k", default=1000, show_default=True, type=click.IntRange(min=1), help="Results per query.")
@click.option(
    "-m", "--measures", default="RR@10 nDCG@10 R@100 R@1000", show_default=True, help="Measures (see gpusparse eval)."
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Folder for run.trec and metrics.json [default: pipeline-<BEIR_DIR name>].",
)
@click.option("--save-vectors", is_flag=True, help="Also write the vectors (exact float32) to OUTPUT/vectors/.")
@click.option("--save-index", is_flag=True, help="Also save the index to OUTPUT/index/.")
@click.option("--device", help="Where to index and search: cpu or cuda[:N] [default: cuda if available].")
@click.option("--memory-budget", default="1GiB", show_default=True, help="Bytes of search temporaries.")
@progress_option
@friendly_errors
def pipeline_cmd(
    beir_dir: Path,
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
    k: int,
    measures: str,
    output: Path | None,
    save_vectors: bool,
    save_index: bool,
    device: str | None,
    memory_budget: str,
    progress: bool,
) -> None:
    """Encode a BEIR folder, index it, search its judged queries and print the metrics.

    One command for text -> SPLADE vectors -> index -> exact top-k -> ir_measures metrics.
    Writes OUTPUT/run.trec and OUTPUT/metrics.json (settings, counts, metrics, timings).
    Only the queries judged in qrels/SPLIT.tsv are searched.

    Identical ids: query and document ids are separate namespaces, and no document is
    dropped for having its query's id (unlike BEIR's default ignore_identical_ids=True):
    in Cranfield and CISI numeric ids collide and such pairs can be truly relevant.
    """
    import platform

    import torch

    from . import __version__
    from .beir import read_beir
    from .evaluate import evaluate, format_table, parse_measures
    from .formats import write_jsonl, write_trec_run
    from .index import Index

    parsed = parse_measures(measures)
    budget = parse_size(memory_budget)
    output = output or Path(f"pipeline-{beir_dir.resolve().name}")
    dev = _device(device) or ("cuda" if torch.cuda.is_available() else "cpu")
    t_start = time.perf_counter()
    beir = read_beir(beir_dir, split)
    _report_collection(beir)
    judged = beir.judged_queries()
    if not len(judged):
        raise click.UsageError(f"none of the queries of {beir.queries.path} is judged in {beir.qrels_path}")
    enc = _make_encoder(model, pooling, query_max_length, doc_max_length, encode_batch_size, encode_device, dtype)
    (docs, dstats), (queries, qstats) = _encode_beir(enc, beir, judged, prune_top, prune_threshold, progress)
    output.mkdir(parents=True, exist_ok=True)
    if save_vectors:
        (output / "vectors").mkdir(exist_ok=True)
        write_jsonl(docs, output / "vectors" / "corpus.jsonl.gz")
        write_jsonl(queries, output / "vectors" / "queries.jsonl.gz", contents=judged.texts)
    t0 = time.perf_counter()
    index = Index.build(docs, device=dev, progress=progress)
    t_index = time.perf_counter() - t0
    st = index.stats()
    click.echo(f"indexed {st.n_docs:,} documents, {st.n_postings:,} postings in {t_index:.1f} s on {dev}", err=True)
    if save_index:
        index.save(output / "index", overwrite=True)
    t0 = time.perf_counter()
    res = index.search(queries, k, memory_budget=budget, progress=progress)
    t_search = time.perf_counter() - t0
    run_path = output / "run.trec"
    n = write_trec_run(run_path, queries.ids, index.ids, res.scores.numpy(), res.ids.numpy())
    click.echo(f"searched {len(queries):,} queries in {t_search:.3f} s; wrote {n:,} lines to {run_path}", err=True)
    ev = evaluate(run_path, beir.qrels, parsed)
    for line in ev.warnings():
        _warn(line)
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
        },
        "encode": {"corpus": dstats.as_dict(), "queries": qstats.as_dict()},
        "index": {"documents": st.n_docs, "postings": st.n_postings, "seconds": round(t_index, 3)},
        "search": {"queries": len(queries), "device": dev, "seconds": round(t_search, 3)},
        **ev.as_dict(),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.machine()},
    }
    (output / "metrics.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    click.echo(format_table([(beir.path.name, ev)], label="collection"))


@main.command("verify")
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
    as_json: bool,
    unknown_tokens: str,
    progress: bool,
) -> None:
    """Check a top-k against an independent exact scorer (float64, scipy, CPU).

    Compares our search of INDEX_DIR with QUERIES (or the run given with --run) with exact
    float64 scores computed by scipy over document chunks, and reports Recall@k of the
    exact top-k and the largest score difference. Exits with status 1 when not exact.
    """
    import torch

    from .formats import read_trec_run, read_vectors
    from .index import Index
    from .search import available_kernels
    from .verify import documents_from_index_arrays, verify_run

    try:
        cutoffs = sorted({int(x) for x in ks.replace(",", " ").split()})
    except ValueError:
        raise click.BadParameter("expected numbers such as '10 100 1000'", param_hint="--at") from None
    if not cutoffs or cutoffs[0] < 1:
        raise click.BadParameter("cutoffs must be positive", param_hint="--at")
    if kernel != "auto" and kernel not in available_kernels():
        raise click.BadParameter(f"choose auto or one of {', '.join(available_kernels())}", param_hint="--kernel")
    budget = parse_size(memory_budget)
    index = Index.load(index_dir)
    qs = read_vectors(queries, index.vocab, unknown=unknown_tokens, progress=progress)  # type: ignore[arg-type]
    if index.quantization is not None:  # exact for the vectors the index actually searches
        from .quantize import quantize_queries

        qs = quantize_queries(qs, index.quantization.bits)
    if run_file is not None:
        run = read_trec_run(run_file)
        name = str(run_file)
    else:
        dev = _device(device) or ("cuda" if torch.cuda.is_available() else "cpu")
        res = index.search(qs, max(cutoffs), device=dev, kernel=kernel, progress=progress)
        run = {
            qid: [
                (index.ids[d], float(s))
                for d, s in zip(res.ids[i].tolist(), res.scores[i].tolist(), strict=True)
                if d >= 0
            ]
            for i, qid in enumerate(qs.ids)
        }
        name = f"search of {index_dir} ({dev})"
    if docs:
        coll = read_vectors(list(docs), index.vocab, unknown=unknown_tokens, progress=progress)  # type: ignore[arg-type]
        if index.quantization is not None:
            from .quantize import quantize_collection

            coll, _ = quantize_collection(coll, index.quantization.bits, index.quantization.step)
        matrix, doc_ids = coll.to_scipy(), coll.ids
    else:
        arrays = {k: v.numpy() for k, v in index.arrays().items()}
        matrix = documents_from_index_arrays(
            arrays["doc_ids"], arrays["scores"], arrays["offsets"], arrays["lengths"], index.n_docs
        )
        doc_ids = index.ids
    report = verify_run(
        run, qs, matrix, doc_ids, ks=cutoffs, memory_budget=budget, progress=progress, run_name=str(run_file or "")
    )
    if as_json:
        click.echo(json.dumps({"run": name, **report.as_dict()}, indent=2))
    else:
        click.echo(f"run: {name}")
        for line in report.lines():
            click.echo(line)
    if not report.exact:
        _fail(f"{name} differs from exact search")


if __name__ == "__main__":  # pragma: no cover
    main()


# -- benchmark (gpusparse.bench) -------------------------------------------------------------

from .bench.cli import bench as _bench  # noqa: E402  (registered last; imports nothing heavy)

main.add_command(_bench)


# -- updates: add, delete, compact (gpusparse.segments) --------------------------------------


def _segments_summary(index: Any) -> str:
    n = len(index.segments)
    return f"{index.n_docs:,} live documents in {n:,} segment{'s' if n != 1 else ''} (generation {index.generation})"


@main.command("add")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.argument("vectors", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--upsert", is_flag=True, help="Replace documents whose ids are already in the index.")
@unknown_option
@progress_option
@friendly_errors
def add_cmd(index_dir: Path, vectors: tuple[Path, ...], upsert: bool, unknown_tokens: str, progress: bool) -> None:
    """Add the documents in VECTORS to INDEX_DIR as a new segment, without a rebuild.

    An id already in the index is an error unless --upsert. The change is atomic: a crash
    leaves the index as it was before or after. A plain index folder is converted in place
    to a segmented one on the first update.
    """
    from .formats import ReadStats, read_vectors
    from .segments import SegmentedIndex

    index = SegmentedIndex.load(index_dir)
    stats = ReadStats()
    coll = read_vectors(vectors, index.vocab, unknown=unknown_tokens, progress=progress, stats=stats)  # type: ignore[arg-type]
    click.echo(f"read {stats.summary()}", err=True)
    rep = index.add(coll, upsert=upsert)
    replaced = f" ({rep.deleted:,} replaced)" if rep.deleted else ""
    click.echo(f"added {rep.added:,} documents{replaced} -> {index_dir}: {_segments_summary(index)}", err=True)


@main.command("delete")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.argument("ids_file", type=click.Path(path_type=Path))
@friendly_errors
def delete_cmd(index_dir: Path, ids_file: Path) -> None:
    """Delete the documents whose ids are listed in IDS_FILE (one per line; '-' reads stdin).

    Ids not in the index are counted, not an error. The documents stay on disk, marked
    deleted, until `gpusparse compact`.
    """
    from .segments import SegmentedIndex

    text = sys.stdin.read() if str(ids_file) == "-" else ids_file.read_text(encoding="utf-8")
    ids = [line.strip() for line in text.splitlines() if line.strip()]
    index = SegmentedIndex.load(index_dir)
    rep = index.delete(ids)
    unknown = f" ({rep.unknown:,} ids not found)" if rep.unknown else ""
    click.echo(f"deleted {rep.deleted:,} documents{unknown} -> {index_dir}: {_segments_summary(index)}", err=True)


@main.command("compact")
@click.argument("index_dir", type=click.Path(path_type=Path))
@friendly_errors
def compact_cmd(index_dir: Path) -> None:
    """Merge INDEX_DIR's segments into one and drop its deleted documents (same results)."""
    from .segments import SegmentedIndex

    index = SegmentedIndex.load(index_dir)
    before = len(index.segments)
    rep = index.compact()
    click.echo(
        f"compacted {before:,} segments, dropped {rep.deleted:,} deleted documents -> {index_dir}: "
        f"{_segments_summary(index)}",
        err=True,
    )


# -- search server (gpusparse.serve) ---------------------------------------------------------


@main.command("serve")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.option("--model", help="SPLADE model (folder or hub id) to encode text queries [default: vectors only].")
@click.option("--pooling", type=click.Choice(["max", "sum"]), default="max", show_default=True, help="With --model.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--device", help="cpu or cuda[:N] [default: cuda if available, else cpu].")
@click.option(
    "--kernel",
    type=click.Choice(["auto", "reference", "scatter", "docpar", "tiled"]),
    default="auto",
    show_default=True,
    help="Scoring kernel.",
)
@click.option("--max-batch-size", default=256, show_default=True, type=click.IntRange(min=1), help="Queries per batch.")
@click.option(
    "--max-wait-ms",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="How long a request waits for others to join its batch.",
)
@click.option(
    "--queue-size", default=1024, show_default=True, type=click.IntRange(min=1), help="Waiting requests; more get 429."
)
@click.option(
    "--request-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds before an unanswered request gets 504.",
)
@click.option("--max-query-terms", default=1024, show_default=True, type=click.IntRange(min=1), help="Per vector.")
@click.option(
    "--limit-concurrency",
    type=click.IntRange(min=1),
    help="Open connections and requests in progress at most; more get 503 [default: no limit].",
)
@click.option(
    "--auth-token",
    envvar="GPUSPARSE_AUTH_TOKEN",
    show_envvar=True,
    help="Require 'Authorization: Bearer TOKEN' on every request (prefer the variable: argv is visible).",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    help="A name clients may send in Host, besides localhost and --host (repeatable; '*' allows any).",
)
@click.option("--max-body-bytes", default="4MiB", show_default=True, help="Request body size at most; more get 413.")
@click.option(
    "--body-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to receive a request body; slower get 408.",
)
@click.option(
    "--max-connections-per-client",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Open connections per client address; more get 429 (0: no cap; behind a proxy, raise it or 0).",
)
@click.option("--memory-budget", default="1GiB", show_default=True, help="Bytes of search temporaries.")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Check the index files' checksums.")
@friendly_errors
def serve_cmd(
    index_dir: Path,
    model: str | None,
    pooling: str,
    host: str,
    port: int,
    device: str | None,
    kernel: str,
    max_batch_size: int,
    max_wait_ms: float,
    queue_size: int,
    request_timeout: float,
    max_query_terms: int,
    limit_concurrency: int | None,
    auth_token: str | None,
    allow_hosts: tuple[str, ...],
    max_body_bytes: str,
    body_timeout: float,
    max_connections_per_client: int,
    memory_budget: str,
    verify: bool,
) -> None:
    """Serve INDEX_DIR over HTTP/JSON: POST /search, GET /health, GET /metrics, /openapi.json.

    Concurrent requests are batched dynamically (up to --max-batch-size queries, or
    --max-wait-ms); a full queue answers 429; Ctrl-C or SIGTERM finishes the requests in
    flight, then stops. Example: curl -s localhost:8000/search -H 'content-type:
    application/json' -d '{"query": {"wing": 1.2, "flutter": 0.8}, "k": 3}'
    """
    try:
        from .serve import create_app, require_server_stack, serve

        require_server_stack()
    except ImportError:
        _fail("gpusparse serve needs fastapi and uvicorn: pip install 'gpusparse[serve]'")
    import torch

    from .index import Index
    from .search import choose_kernel

    budget = parse_size(memory_budget)
    if budget < 1 << 16:
        raise click.BadParameter("must be at least 64KiB", param_hint="--memory-budget")
    body_limit = parse_size(max_body_bytes)
    if body_limit < 1:
        raise click.BadParameter("must be at least 1 byte", param_hint="--max-body-bytes")
    from .serve.config import DEFAULT_ALLOWED_HOSTS

    # The bound address is a name clients use; a wildcard address is not (give --allow-host).
    bound = () if host in ("0.0.0.0", "::", "") else (host,)
    allowed_hosts = (*DEFAULT_ALLOWED_HOSTS, *bound, *allow_hosts)
    dev = _device(device) or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        choose_kernel(kernel, torch.device(dev))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kernel") from None
    index = Index.load(index_dir, device=dev, verify=verify)
    encoder = None
    if model is not None:
        try:
            from .encode import SpladeEncoder

            encoder = SpladeEncoder(model, pooling=pooling, device=dev)  # type: ignore[arg-type]
        except ImportError as exc:
            _fail(str(exc))
    app = create_app(
        index,
        encoder=encoder,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        queue_size=queue_size,
        request_timeout_s=request_timeout,
        max_query_terms=max_query_terms,
        max_body_bytes=body_limit,
        body_timeout_s=body_timeout,
        max_connections_per_client=max_connections_per_client,
        auth_token=auth_token or None,
        allowed_hosts=allowed_hosts,
        search_kwargs={"kernel": kernel, "memory_budget": budget},
    )
    texts = f"text queries encoded by {encoder.name}" if encoder is not None else "{token: weight} queries only"
    click.echo(
        f"serving {index.n_docs:,} documents from {index_dir} on {dev} ({texts}) at http://{host}:{port}", err=True
    )
    serve(app, host=host, port=port, limit_concurrency=limit_concurrency)
