"""CIFF, the Common Index File Format: ``export-ciff`` and ``import-ciff``."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import GPUSparseError
from ..integrations._ciff_messages import messages
from ..integrations.ciff import export_ciff, index_from_ciff, read_ciff_header
from ._common import device_option, friendly_errors


@click.command("export-ciff")
@click.argument("index", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--bits",
    type=click.IntRange(1, 8),
    default=8,
    show_default=True,
    help="Impact levels of a float32 index (a quantized index keeps its own).",
)
@click.option("--description", help="Text for the CIFF header, after GPUSparse's line with the scale.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUTPUT.")
@friendly_errors
def export_ciff_cmd(index: Path, output: Path, bits: int, description: str | None, overwrite: bool) -> None:
    """Write INDEX as a CIFF file (OUTPUT; gzipped if it ends in .gz) for PISA, Anserini, JASS.

    Impacts are integer tf: an 8-bit quantized index's levels exactly; a float32 index's
    weights rounded to BITS-bit levels of a power-of-two step, recorded in the header.
    """
    _need_protobuf()
    report = export_ciff(index, output, bits=bits, description=description, overwrite=overwrite)
    dropped = f"; {report.n_dropped:,} postings below half a step dropped" if report.n_dropped else ""
    click.echo(
        f"wrote {output}: {report.n_docs:,} documents, {report.n_terms:,} terms, {report.n_postings:,} postings, "
        f"tf = weight / {report.step:g} ({report.bits}-bit){dropped}",
        err=True,
    )


@click.command("import-ciff")
@click.argument("ciff", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Index folder to create.")
@click.option(
    "--quantize",
    default="auto",
    show_default=True,
    metavar="BITS|auto|none",
    help="auto: the bits of a file exported from a quantized GPUSparse index, else a float32 index.",
)
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), help="Weight of one tf unit [default: 1, "
              "or the step a GPUSparse file records].")  # fmt: skip
@click.option("--device", default="cpu", show_default=True, help="Where to build: cpu or cuda[:N].")
@click.option("--overwrite", is_flag=True, help="Replace an existing index at --output.")
@friendly_errors
def import_ciff_cmd(ciff: Path, output: Path, quantize: str, scale: float | None, device: str, overwrite: bool) -> None:
    """Build an index folder from a CIFF file (PISA, Anserini or GPUSparse exports; .gz read too)."""
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists (use --overwrite to replace it)")
    bits: int | str | None
    if quantize in ("auto", "none"):
        bits = None if quantize == "none" else "auto"
    elif quantize.isdigit() and 1 <= int(quantize) <= 8:
        bits = int(quantize)
    else:
        raise click.BadParameter(f"expected auto, none or 1..8, not {quantize!r}", param_hint="--quantize")
    build_from_ciff(ciff, output, bits, scale, device, overwrite)


def build_from_ciff(
    ciff: Path, output: Path, bits: int | str | None, scale: float | None, device: str, overwrite: bool
) -> None:
    """``import-ciff`` and ``index --ciff``: the index folder ``output`` from the CIFF file ``ciff``."""
    _need_protobuf()
    head = read_ciff_header(ciff)
    index = index_from_ciff(ciff, quantize=bits, scale=scale, device=device_option(device) or "cpu")
    index.save(output, overwrite=overwrite)
    q = index.quantization
    click.echo(
        f"read {ciff}: {head.num_doc_records:,} documents, {head.num_postings_lists:,} terms; wrote {output}"
        + (f" ({q.bits}-bit impacts)" if q is not None else " (float32 weights)"),
        err=True,
    )


def _need_protobuf() -> None:
    """Say in one line what to install when protobuf is missing."""
    try:
        messages()
    except ImportError as exc:
        raise GPUSparseError(str(exc)) from None
