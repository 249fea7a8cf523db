"""``python -m gpusparse.bench run|report ...``: the same as ``gpusparse bench`` without the script installed."""

from .cli import bench

if __name__ == "__main__":  # pragma: no cover
    bench(prog_name="python -m gpusparse.bench")
