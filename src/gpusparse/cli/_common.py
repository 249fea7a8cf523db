"""What every command shares: sizes, one-line errors, devices, common options, run files."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import torch

from .. import engines, sizes
from ..errors import GPUSparseError
from ..trec import write_trec_run

F = TypeVar("F", bound=Callable[..., Any])


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512MB"``, ``"1048576"`` → bytes; anything else is a usage error."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def fail(message: str) -> NoReturn:
    """Print ``gpusparse: error: MESSAGE`` on stderr and exit with status 1."""
    click.echo(f"gpusparse: error: {message}", err=True)
    sys.exit(1)


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def friendly_errors(fn: F) -> F:
    """Turn the errors a user can cause into one line and exit status 1."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
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


def check_kernel(kernel: str, dev: str) -> None:
    """A ``--kernel`` that cannot run on ``dev`` is a usage error (exit status 2)."""
    try:
        engines.choose(kernel, torch.device(dev))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kernel") from None


def write_run(output: Path, qids: list[str], doc_names: list[str], scores: Any, ranked: Any, tag: str) -> int:
    """Write a TREC run atomically (temporary file, then rename); the number of lines."""
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
