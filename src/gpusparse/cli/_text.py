"""What ``encode`` and ``pipeline`` share: the encoder's options and reporting on a BEIR folder."""

from __future__ import annotations

from typing import Any

import click

from ..beir import BeirCollection
from ..errors import GPUSparseError
from ..integrations import encoders
from ._common import F, device_option, warn

# The encoder's defaults, spelled out so that ``--help`` does not load a model (a test checks them).
_ENCODE_DEFAULTS = {
    "model": "naver/splade-cocondenser-ensembledistil",
    "query_max_length": 64,
    "doc_max_length": 256,
    "batch_size": 32,
}


def backend_option(fn: F) -> F:
    """``--backend``: which library loads and runs the model (see :mod:`gpusparse.integrations.encoders`)."""
    return click.option(
        "--backend",
        type=click.Choice(encoders.BACKENDS),
        default="transformers",
        show_default=True,
        help="transformers: our SPLADE encoder (max/sum pooling, autocast); sentence-transformers: any "
        "SparseEncoder model (asymmetric and inference-free query encoders too; pooling and dtype are the model's).",
    )(fn)


def encoder_options(fn: F) -> F:
    """Options shared by ``encode`` and ``pipeline`` (defaults: those of :mod:`gpusparse.encode`)."""
    options = [
        click.option(
            "--model",
            default=_ENCODE_DEFAULTS["model"],
            show_default=True,
            help="SPLADE-style masked-LM model: a local folder or a hub id.",
        ),
        backend_option,
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
        click.option(
            "--cuda-graphs",
            type=click.Choice(["auto", "on", "off"]),
            default="auto",
            show_default=True,
            help="Replay the model as CUDA graphs, one per batch-length bucket (auto: on a CUDA device). "
            "off: the eager forward (less memory, no capture time).",
        ),
        click.option("--prune-top", type=click.IntRange(min=1), help="Keep the N largest weights of each vector."),
        click.option("--prune-threshold", type=click.FloatRange(min=0), help="Drop weights below this value."),
        click.option("--split", default="test", show_default=True, help="Qrels split: BEIR_DIR/qrels/SPLIT.tsv."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def make_encoder(
    model: str,
    pooling: str,
    qlen: int,
    dlen: int,
    batch: int,
    device: str | None,
    dtype: str,
    backend: str = "transformers",
    cuda_graphs: str = "auto",
) -> Any:  # SpladeEncoder | SparseEncoderAdapter
    """Load the encoder the options describe (with ``backend``) and say so on stderr."""
    if backend == "sentence-transformers" and (pooling != "max" or dtype != "auto"):
        raise click.UsageError("--backend sentence-transformers takes pooling and dtype from the model: drop "
                               "--pooling and --dtype")  # fmt: skip
    if backend == "sentence-transformers" and cuda_graphs != "auto":
        raise click.UsageError("--cuda-graphs is the transformers backend's: drop it for sentence-transformers")
    graphs = {"auto": "auto", "on": True, "off": False}[cuda_graphs]
    try:
        enc = encoders.make_encoder(
            model,
            backend,  # type: ignore[arg-type]
            pooling=pooling,
            query_max_length=qlen,
            doc_max_length=dlen,
            batch_size=batch,
            device=device_option(device),
            dtype=dtype,
            **({"cuda_graphs": graphs} if backend == "transformers" else {}),
        )
    except ImportError as exc:  # the backend's package is missing: the message names the extra
        raise GPUSparseError(str(exc)) from None
    except GPUSparseError:  # a bad model folder (InputError) and the like: reported as they are
        raise
    except ValueError as exc:  # an option the encoder refuses (e.g. --cuda-graphs on without a GPU): one line
        raise click.UsageError(str(exc)) from None
    how = "sentence-transformers SparseEncoder" if backend == "sentence-transformers" else f"{pooling} pooling"
    precision = (
        "model dtype"
        if backend == "sentence-transformers"
        else "float32"
        if enc.autocast_dtype is None
        else f"{str(enc.autocast_dtype).removeprefix('torch.')} autocast"
    )
    click.echo(f"loaded {enc.name} ({how}, {enc.device}, {precision})", err=True)
    return enc


def report_collection(beir: BeirCollection) -> None:
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
            warn(line)
        if check.identical_id_pairs:
            click.echo(
                f"note: {check.identical_id_pairs:,} relevant judged pairs have equal query and document ids; "
                "they are kept (see gpusparse eval --help)",
                err=True,
            )
    for name, texts in (("documents", beir.corpus), ("queries", beir.queries)):
        if texts.n_empty:
            warn(f"{texts.path}: {texts.n_empty:,} {name} have empty text; they get empty vectors")


def echo_err(line: str) -> None:
    """A progress line on stderr (stdout carries only results)."""
    click.echo(line, err=True)
