"""``info --device cuda``: the GPU memory a search will need, predicted from the saved index."""

from __future__ import annotations

from pathlib import Path

import click
import torch

from ..config import engine_config
from ..device_memory import decide, device_memory, fallback_kernel, gb
from ..errors import DeviceMemoryError
from ..footprint import H100_SMS, IndexShape, predict
from ..index import Index

WHAT = {
    "lists": "tiled engine, padded lists + forward copy + tiled layout on the GPU (resident='lists')",
    "tiled": "tiled engine, the tiled layout alone on the GPU (resident='tiled')",
    "scatter": "scatter-add kernel, padded lists on the GPU + the memory budget",
}


def memory_report(index_dir: Path, device: str, batch_size: int, k: int, limit: int | None) -> dict:
    """Per mode the predicted components and peak of searching ``index_dir`` on ``device`` in
    batches of ``batch_size`` at ``k``; the device's memory where there is one; under
    ``limit`` the mode a search would take. Reads the index on the host (memory-mapped):
    nothing is built or uploaded."""
    index = Index.load(index_dir, device="cpu", mmap=True, verify=False)
    shape = IndexShape(index)
    dev = torch.device(device)
    here = dev.type == "cuda" and torch.cuda.is_available()
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count if here else H100_SMS
    opts = {"batch_size": batch_size, "k": k, "n_sm": n_sm}
    modes = {m: predict(shape, m, **opts) for m in WHAT}
    out: dict = {"device": str(dev), "batch_size": batch_size, "k": k, "multiprocessors": n_sm,
                 "configured": engine_config().resident}  # fmt: skip
    out["modes"] = {m: fp.as_dict() for m, fp in modes.items()}
    memory = None
    if here:
        memory = device_memory(dev)
        out["device_name"] = torch.cuda.get_device_name(dev)
        out["device_total"], out["device_free"] = memory.total, memory.free
    if limit is not None:
        out["limit"] = limit
        try:
            d = decide(shape, limit, wanted=engine_config().resident, fallback_kernel=fallback_kernel(dev) if here
                       else "scatter", allow_streaming=True, memory=memory, **opts)  # fmt: skip
            message = d.message() if d.fallback else None
            out["under_limit"] = {"mode": d.chosen.mode, "kernel": d.kernel, "peak": d.chosen.peak,
                                  "pieces": d.chosen.pieces, "message": message}  # fmt: skip
        except DeviceMemoryError as exc:
            out["under_limit"] = {"mode": None, "message": str(exc)}
    return out


def print_memory(report: dict) -> None:
    """The report of :func:`memory_report`, for people."""
    where = report["device"]
    if "device_name" in report:
        where += f" ({report['device_name']}, {gb(report['device_total'])}, {gb(report['device_free'])} free)"
    else:
        where += f" (no such GPU here: {report['multiprocessors']} multiprocessors assumed, as an H100's)"
    batch, k = report["batch_size"], report["k"]
    click.echo(f"GPU memory     predicted for searches of {batch} queries at k = {k} on {where}")
    for mode, fp in report["modes"].items():
        star = " (configured)" if mode == report["configured"] else ""
        click.echo(f"  {mode:8} peak {gb(fp['peak'])}: {WHAT[mode]}{star}")
        click.echo("           " + _parts(fp))
    under = report.get("under_limit")
    if under is not None:
        limit = gb(report["limit"])
        if under["mode"] is None:
            click.echo(f"  under a {limit} limit: refused: {under['message']}")
        elif under["message"]:
            click.echo(f"  under a {limit} limit: {under['message']}")
        else:
            click.echo(f"  under a {limit} limit: {under['mode']} fits ({gb(under['peak'])})")


def _parts(fp: dict) -> str:
    prefix = "tiled layout: "
    parts = [f"{name} {gb(n)}" for name, n in fp["components"].items() if not name.startswith(prefix)]
    tiled = {name[len(prefix) :]: n for name, n in fp["components"].items() if name.startswith(prefix)}
    if tiled:
        inside = ", ".join(f"{name} {gb(n)}" for name, n in tiled.items())
        parts.append(f"tiled layout {gb(sum(tiled.values()))} ({inside})")
    temps = ", ".join(f"{name} {gb(n)}" for name, n in fp["temporaries"].items())
    return f"resident {gb(fp['resident'])} ({', '.join(parts)}); temporaries {temps}; reserve {gb(fp['reserve'])}"
