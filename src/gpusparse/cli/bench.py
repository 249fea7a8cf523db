"""``bench``: the benchmark harness's commands, which a source checkout has and an install does not.

The harness (package ``gpusparse_bench``) lives in the checkout's ``bench/`` folder, beside
the other benchmark scripts, outside the shipped package. This is the one place in
``gpusparse`` that imports it, and only when ``gpusparse bench`` runs: an importable
``gpusparse_bench`` first, else the one next to the ``src/`` this package was imported from
(a checkout, installed editable or on ``PYTHONPATH``). Without either, ``gpusparse bench``
fails with one line.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click

from ._common import fail

# src/gpusparse/cli/bench.py -> the checkout's bench/gpusparse_bench
CHECKOUT_HARNESS = Path(__file__).resolve().parents[3] / "bench" / "gpusparse_bench"


def load_harness() -> click.Group | None:
    """The harness's ``bench`` group, or ``None`` where it cannot be found."""
    if "gpusparse_bench" not in sys.modules and importlib.util.find_spec("gpusparse_bench") is None:
        init = CHECKOUT_HARNESS / "__init__.py"
        if not init.is_file():
            return None
        # Import the package from its folder without putting bench/ on sys.path: its scripts'
        # names (kernels, segments, ...) must not shadow other top-level modules.
        spec = importlib.util.spec_from_file_location(
            "gpusparse_bench", init, submodule_search_locations=[str(CHECKOUT_HARNESS)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpusparse_bench"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["gpusparse_bench"]
            raise
    from gpusparse_bench.cli import bench

    return bench


class BenchGroup(click.Group):
    """``gpusparse bench``: forwards to the harness's group, imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        harness = load_harness()
        return harness.list_commands(ctx) if harness is not None else []

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        harness = load_harness()
        return harness.get_command(ctx, cmd_name) if harness is not None else None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if load_harness() is None:
            fail("gpusparse bench needs a source checkout: its harness is bench/gpusparse_bench, not installed")
        return super().parse_args(ctx, args)


@click.group("bench", cls=BenchGroup)
def bench_cmd() -> None:
    """Benchmark every system side by side on synthetic MS MARCO-scale collections."""
