"""``bench``: the benchmark harness's commands, loaded only when ``gpusparse bench`` runs."""

from __future__ import annotations

import click

from ._common import fail


def load_harness() -> click.Group | None:
    """The harness's ``bench`` group, or ``None`` where it cannot be imported."""
    try:
        from ..bench.cli import bench
    except ImportError:
        return None
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
            fail("gpusparse bench needs the benchmark harness of a source checkout")
        return super().parse_args(ctx, args)


@click.group("bench", cls=BenchGroup)
def bench_cmd() -> None:
    """Benchmark every system side by side on synthetic MS MARCO-scale collections."""
