"""``python -m gpusparse_bench run|report ...``: the same as ``gpusparse bench``."""

from .cli import bench

if __name__ == "__main__":  # pragma: no cover
    bench(prog_name="python -m gpusparse_bench")
