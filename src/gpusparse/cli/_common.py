"""What every command shares: sizes, one-line errors, devices, common options, run files."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from functools import wraps
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import torch

from .. import engines, sizes
from ..config import override_config
from ..device_memory import DeviceMemoryWarning
from ..errors import GPUSparseError
from ..trec import write_trec_run

F = TypeVar("F", bound=Callable[..., Any])


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512MB"``, ``"1048576"`` → bytes; anything else is a usage error."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def limit_option(text: str | None) -> int | None:
    """``--device-memory-limit`` in bytes (``None``: no limit)."""
    if text is None:
        return None
    try:
        limit = sizes.parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--device-memory-limit") from None
    if limit < 1 << 20:
        raise click.BadParameter("must be at least 1MiB", param_hint="--device-memory-limit")
    return limit


device_memory_limit_option = click.option(
    "--device-memory-limit",
    help="GPU memory a search may take over every allocator (16GiB, 24GB, bytes): a mode that does not fit "
    "gives way to a slower one that does, with a warning, or the search is refused [default: no limit].",
)


@contextlib.contextmanager
def device_memory_scope(limit: int | None) -> Iterator[None]:
    """Searches in the block use ``limit`` (:attr:`~gpusparse.config.EngineConfig.device_memory_limit`);
    their fallback warnings print as ``warning: ...`` lines."""
    with override_config(device_memory_limit=limit), warnings.catch_warnings():
        warnings.simplefilter("always", DeviceMemoryWarning)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            if issubclass(category, DeviceMemoryWarning):
                warn(str(message))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def fail(message: str) -> NoReturn:
    """Print ``gpusparse: error: MESSAGE`` on stderr and exit with status 1."""
    click.echo(f"gpusparse: error: {message}", err=True)
    sys.exit(1)


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def friendly_errors(fn: F) -> F:
    """Turn the errors a user can cause into one line and exit status 1; Ctrl-C into one
    line and exit status 130 (128 + SIGINT, as shells do)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("\ngpusparse: interrupted", err=True)
            sys.exit(130)
        except GPUSparseError as exc:
            fail(str(exc))
        except FileExistsError as exc:
            fail(str(exc))
        except torch.cuda.OutOfMemoryError:
            fail("out of GPU memory: lower --batch-size or --memory-budget")
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            fail(f"{where}{exc.strerror or exc}")

    return wrapper  # type: ignore[return-value]


def device_option(name: str | None) -> str | None:
    """A ``--device`` value checked against this machine (``None`` stays ``None``: the command's default)."""
    if name is None:
        return None
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise click.BadParameter("CUDA is not available on this machine", param_hint="--device")
    return name


def default_device(name: str | None) -> str:
    """``--device``, else cuda when there is one, else cpu."""
    return device_option(name) or ("cuda" if torch.cuda.is_available() else "cpu")


def check_kernel(kernel: str, dev: str) -> str:
    """The name of the engine ``--kernel`` runs on ``dev``; one that cannot run there is a
    usage error (exit status 2). When ``auto`` falls back to a slower engine on a GPU, says
    why and what to install, once, on stderr (:func:`gpusparse.engines.fallback_reason`)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", engines.SlowEngineWarning)
            engine = engines.choose(kernel, torch.device(dev))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kernel") from None
    for w in caught:
        if issubclass(w.category, engines.SlowEngineWarning):
            warn(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return engine.name


def check_output(output: Path, overwrite: bool, option: str = "--output") -> None:
    """Refuse an ``--output`` file in a missing folder, or an existing one without
    ``--overwrite`` (``-`` is stdout: always fine)."""
    if str(output) == "-":
        return
    if not output.parent.is_dir():
        raise click.BadParameter(f"folder {output.parent} does not exist", param_hint=option)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists (use --overwrite to replace it)")


def output_name(output: Path) -> str:
    """How a summary line names ``output`` (``-``: stdout)."""
    return "stdout" if str(output) == "-" else str(output)


def write_run(output: Path, qids: list[str], doc_names: list[str], scores: Any, ranked: Any, tag: str) -> int:
    """Write a TREC run atomically (temporary file, then rename; ``-``: to stdout); the number of lines."""
    if str(output) == "-":
        with tempfile.TemporaryDirectory(prefix="gpusparse-run-") as folder:
            tmp = Path(folder) / "run.trec"
            n = write_trec_run(tmp, qids, doc_names, scores.numpy(), ranked.numpy(), tag=tag)
            with open(tmp, encoding="utf-8") as f:
                shutil.copyfileobj(f, sys.stdout)
            sys.stdout.flush()
        return n
    tmp = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        n = write_trec_run(tmp, qids, doc_names, scores.numpy(), ranked.numpy(), tag=tag)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return n


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
kernel_choice = click.Choice(["auto", *engines.names()])
