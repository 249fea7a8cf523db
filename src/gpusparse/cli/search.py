"""``search``: a TREC run from an index folder (plain, sharded or segmented), one process or many."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch.distributed as dist

from ..collection import SparseCollection
from ..distributed import first_error, init_from_env, load_shard, same_snapshot, search_sharded
from ..errors import GPUSparseError, InputError
from ..formats import ReadStats, read_vectors
from ..segment_files import is_segmented
from ..segments import SegmentedIndex
from ..shards import is_sharded, read_sharded_manifest, shard_ids
from ..streaming import open_for_search
from ..topics import is_text_query_file, read_query_texts
from ..vocab import Vocabulary
from ._common import (
    check_kernel,
    check_output,
    default_device,
    device_memory_limit_option,
    device_memory_scope,
    fail,
    friendly_errors,
    kernel_choice,
    limit_option,
    output_name,
    parse_size,
    progress_option,
    unknown_option,
    write_run,
)
from ._text import backend_option, make_encoder


@click.command("search")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.argument("queries", type=click.Path(path_type=Path))
@click.option("-k", "--k", "k", default=1000, show_default=True, type=click.IntRange(min=1), help="Results per query.")
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="TREC run file to write ('-': stdout)."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing --output file.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Queries scored together [default: from the budget].")
@click.option("--device", help="cpu or cuda[:N] [default: cuda if available, else cpu].")
@click.option(
    "--kernel",
    type=kernel_choice,
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
@device_memory_limit_option
@click.option(
    "--model",
    help="Encode text queries (BEIR queries.jsonl, Anserini JSONL or TSV topics) with this SPLADE model: "
    "a local folder or a hub id, the model that encoded the corpus.",
)
@backend_option
@click.option(
    "--pooling", type=click.Choice(["max", "sum"]), default="max", show_default=True, help="With --model: pooling."
)
@click.option(
    "--query-max-length",
    type=click.IntRange(min=2),
    default=64,
    show_default=True,
    help="With --model: tokens per query; longer ones are truncated.",
)
@click.option("--encode-device", help="With --model: where it runs [default: cuda if available].")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
    default="auto",
    show_default=True,
    help="With --model: auto is bf16/fp16 autocast on a GPU, float32 on the CPU.",
)
@progress_option
@friendly_errors
def search_cmd(
    index_dir: Path,
    queries: Path,
    k: int,
    output: Path,
    overwrite: bool,
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
    device_memory_limit: str | None,
    model: str | None,
    backend: str,
    pooling: str,
    query_max_length: int,
    encode_device: str | None,
    dtype: str,
    progress: bool,
) -> None:
    """Search an index with the queries in QUERIES and write a TREC run.

    QUERIES is a JsonVectorCollection JSONL(.gz) (or Seismic JSONL/.bin) file read in the
    index's vocabulary, or, with --model, a text query file (BEIR queries.jsonl with _id and
    text; Anserini topics: JSONL with qid and query/title/text, or TSV 'qid<TAB>text'),
    encoded with the model. Its ids become the run's query ids. The summary line names the
    engine that ran. With --distributed, start one process per GPU: torchrun
    --nproc-per-node=N $(which gpusparse) search ... --distributed (the run equals a single
    process's, byte for byte; vector queries only).
    """
    budget = parse_size(memory_budget)
    if budget < 1 << 16:
        raise click.BadParameter("must be at least 64KiB", param_hint="--memory-budget")
    index_budget = None if index_memory is None else parse_size(index_memory)
    limit = limit_option(device_memory_limit)
    check_output(output, overwrite)
    if tag.split() != [tag]:
        raise click.BadParameter("must be one word", param_hint="--tag")
    text_queries = is_text_query_file(queries)
    if text_queries and model is None:
        fail(f"{queries}: these are text queries: pass --model MODEL (the SPLADE model of the corpus) to encode them")
    if model is not None and not text_queries:
        raise click.UsageError(f"--model encodes text queries, but {queries} holds vectors (or is not a query file)")
    if distributed:
        if text_queries:
            raise click.UsageError("--distributed searches vector queries: encode them first (gpusparse encode)")
        if limit is not None:
            raise click.UsageError("--device-memory-limit applies to one process (--distributed: use --index-memory)")
        _search_distributed(
            index_dir, queries, k, output, batch_size, device, kernel, budget, tag, unknown_tokens, verify,
            index_budget, pieces, progress,
        )  # fmt: skip
        return
    dev = default_device(device)
    engine_name = check_kernel(kernel, dev)
    # An index updated with add/delete/compact is a segmented folder: search its snapshot.
    segmented = is_segmented(index_dir)
    if segmented:
        if index_budget is not None or pieces is not None or limit is not None:
            raise click.UsageError(
                "--index-memory, --pieces and --device-memory-limit apply to plain and sharded index folders"
            )
        index: Any = SegmentedIndex.load(index_dir, device=dev, verify=verify)
    else:
        host, _, _ = load_shard(index_dir, verify=verify)
        with device_memory_scope(limit):
            index = open_for_search(
                host, dev, kernel=kernel, index_memory=index_budget, pieces=pieces, memory_budget=budget,
                batch_size=batch_size, k=k,
            )  # fmt: skip
    if text_queries:
        qs = _encoded_queries(
            queries,
            index.vocab,
            model,
            backend,
            pooling,
            query_max_length,
            encode_device,
            dtype,
            progress,  # type: ignore[arg-type]
        )
    else:
        stats = ReadStats()
        qs = read_vectors(queries, index.vocab, unknown=unknown_tokens, progress=progress, stats=stats)  # type: ignore[arg-type]
        click.echo(f"read {stats.summary()}", err=True)
    t0 = time.perf_counter()
    with device_memory_scope(limit):
        res = index.search(qs, k, batch_size=batch_size, kernel=kernel, memory_budget=budget, progress=progress)
    dt = time.perf_counter() - t0
    engine_name = getattr(res, "engine", "") or engine_name  # a segmented index's results do not carry it
    if segmented:
        doc_names, ranked = index.position_ids, res.positions
    else:
        doc_names, ranked = index.ids, res.ids
    n = write_run(output, qs.ids, doc_names, res.scores, ranked, tag)
    qps = len(qs) / dt if dt > 0 else float("inf")
    streamed = f" (streamed in {len(index.pieces)} pieces)" if hasattr(index, "pieces") else ""
    click.echo(
        f"searched {len(qs):,} queries on {dev}{streamed} with engine {engine_name} in {dt:.3f} s "
        f"({qps:,.0f} queries/s); wrote {n:,} lines to {output_name(output)}",
        err=True,
    )


def _encoded_queries(
    path: Path,
    vocab: Vocabulary,
    model: str,
    backend: str,
    pooling: str,
    query_max_length: int,
    encode_device: str | None,
    dtype: str,
    progress: bool,
) -> SparseCollection:
    """The text queries of ``path`` encoded with ``model``, checked against the index's vocabulary."""
    texts = read_query_texts(path)
    click.echo(f"read {len(texts):,} text queries from {path}", err=True)
    enc = make_encoder(model, pooling, query_max_length, query_max_length, 32, encode_device, dtype, backend)
    t0 = time.perf_counter()
    qs = enc.encode_queries(texts.texts, texts.ids, progress=progress)
    click.echo(f"encoded {len(qs):,} queries in {time.perf_counter() - t0:.1f} s", err=True)
    if qs.vocab != vocab and not vocab.is_integer:
        # An index read from vector files has its own token vocabulary: the same tokens by
        # name. A query token the index lacks matches no document, so dropping it is exact.
        qs = SparseCollection.from_dicts(_token_dicts(qs), qs.ids, vocab, unknown="skip")
    return qs


def _token_dicts(qs: SparseCollection) -> list[dict[str, float]]:
    tokens = qs.vocab.tokens()
    indptr, indices, values = (np.asarray(a) for a in (qs.indptr, qs.indices, qs.values))
    return [
        {tokens[t]: float(w) for t, w in zip(indices[a:b].tolist(), values[a:b].tolist(), strict=True)}
        for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist(), strict=True)
    ]


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
    rank, world, dev = init_from_env(device)
    try:
        error = None
        try:
            check_kernel(kernel, str(dev))
            snapshot = read_sharded_manifest(index_dir) if is_sharded(index_dir) else None
            host, offset, n_docs = load_shard(index_dir, rank, world, verify=verify, manifest=snapshot)
            shard = open_for_search(
                host, dev, kernel=kernel, index_memory=index_budget, pieces=pieces, memory_budget=budget
            )
            stats = ReadStats()
            qs = read_vectors(queries, shard.vocab, unknown=unknown_tokens, progress=False, stats=stats)  # type: ignore[arg-type]
            names: list[str] = []
            if rank == 0:
                names = shard_ids(index_dir, verify=verify, manifest=snapshot) if snapshot else host.ids
        except (GPUSparseError, OSError, click.BadParameter) as exc:
            where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
            error = where + (exc.format_message() if isinstance(exc, click.BadParameter) else str(exc))
        failed = first_error(error)
        if failed is not None:
            if rank == 0:
                fail(failed[1] if world == 1 else f"process {failed[0]}: {failed[1]}")
            sys.exit(1)
        try:
            same_snapshot(snapshot)  # an update committed while the processes loaded: all refuse
        except InputError as exc:
            if rank == 0:
                fail(str(exc))
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
            n = write_run(output, qs.ids, names, res.scores, res.ids, tag)
            qps = len(qs) / dt if dt > 0 else float("inf")
            click.echo(
                f"searched {len(qs):,} queries on {world} processes ({dev.type}) in {dt:.3f} s "
                f"({qps:,.0f} queries/s); wrote {n:,} lines to {output}",
                err=True,
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
