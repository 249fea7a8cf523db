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
@click.version_option(package_name="gpusparse")
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
@click.option("--overwrite", is_flag=True, help="Replace an existing index at --output.")
@progress_option
@friendly_errors
def index_cmd(
    vectors: tuple[Path, ...],
    output: Path,
    vocab: str,
    unknown_tokens: str,
    device: str,
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
    index = Index.build(coll, device=_device(device) or "cpu", progress=progress)
    del coll
    index.save(output, overwrite=overwrite)
    st = index.stats()
    click.echo(
        f"indexed {st.n_docs:,} documents, {st.n_postings:,} postings over {st.n_nonempty_terms:,} terms "
        f"({st.bytes / 2**20:,.1f} MiB) in {time.perf_counter() - t0:.1f} s -> {output}",
        err=True,
    )


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
    progress: bool,
) -> None:
    """Search an index with the queries in QUERIES and write a TREC run.

    QUERIES is a JsonVectorCollection JSONL(.gz) (or Seismic JSONL/.bin) file read in the
    index's vocabulary; its ids become the run's query ids.
    """
    import torch

    from .formats import ReadStats, read_vectors, write_trec_run
    from .index import Index

    budget = parse_size(memory_budget)
    if budget < 1 << 16:
        raise click.BadParameter("must be at least 64KiB", param_hint="--memory-budget")
    if not output.parent.is_dir():
        raise click.BadParameter(f"folder {output.parent} does not exist", param_hint="--output")
    dev = _device(device) or ("cuda" if torch.cuda.is_available() else "cpu")
    if tag.split() != [tag]:
        raise click.BadParameter("must be one word", param_hint="--tag")
    index = Index.load(index_dir, device=dev, verify=verify)
    stats = ReadStats()
    qs = read_vectors(queries, index.vocab, unknown=unknown_tokens, progress=progress, stats=stats)  # type: ignore[arg-type]
    click.echo(f"read {stats.summary()}", err=True)
    t0 = time.perf_counter()
    res = index.search(qs, k, batch_size=batch_size, kernel=kernel, memory_budget=budget, progress=progress)
    dt = time.perf_counter() - t0
    tmp = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        n = write_trec_run(tmp, qs.ids, index.ids, res.scores.numpy(), res.ids.numpy(), tag=tag)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    qps = len(qs) / dt if dt > 0 else float("inf")
    click.echo(
        f"searched {len(qs):,} queries on {dev} in {dt:.3f} s ({qps:,.0f} queries/s); wrote {n:,} lines to {output}",
        err=True,
    )


@main.command("info")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@friendly_errors
def info_cmd(index_dir: Path, as_json: bool) -> None:
    """Print an index's statistics: documents, terms, postings, padding, bytes."""
    from .storage import read_manifest

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
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"index          {index_dir} (format {m['format_version']}, {m.get('created_by')})")
    click.echo(f"documents      {m['n_docs']:,} ({m.get('n_empty_docs', 0):,} empty)")
    click.echo(f"vocabulary     {m['n_terms']:,} terms")
    click.echo(f"postings       {m['n_postings']:,} (+{info['padding_overhead']:.1%} padding to multiples of 32)")
    click.echo(f"size on disk   {n_bytes / 2**20:,.1f} MiB")


if __name__ == "__main__":  # pragma: no cover
    main()
