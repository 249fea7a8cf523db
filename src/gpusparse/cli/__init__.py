"""The ``gpusparse`` command line: one module per command group.

* :mod:`._common`: what every command shares (``parse_size``, one-line errors, devices,
  the ``--progress`` and ``--unknown-tokens`` options, atomic run files);
* :mod:`.index`: ``index``, ``info``, ``add``, ``delete``, ``compact``;
* :mod:`.search`: ``search`` (one process, or ``--distributed`` under torchrun);
* :mod:`.encode`, :mod:`.pipeline` (sharing :mod:`._text`), :mod:`.eval`: text to metrics;
* :mod:`.verify`: ``verify``;  :mod:`.serve`: ``serve``;
* :mod:`.ciff`: ``export-ciff``, ``import-ciff`` (needs ``gpusparse[ciff]``);
* :mod:`.bench`: ``bench``, the benchmark harness's commands.

The commands parse options, call the library and print; the workflows themselves live
below (e.g. :mod:`gpusparse.pipeline` for text → vectors → index → run).

Imports: every command module imports the gpusparse modules it needs at its top, and
this module imports every command module. Loading the commands lazily would not make
start-up faster: importing the ``gpusparse`` package already imports torch (its
``__init__`` exports :class:`~gpusparse.Index`), which is most of a command's start-up.
Only optional packages are imported inside functions, by the library modules that use
them (transformers, fastapi, uvicorn), and so is the benchmark harness, which is not
part of the installed package (:mod:`.bench`).

Errors a user can cause are printed as one line (``gpusparse: error: FILE:LINE: ...``)
with exit status 1; usage errors exit with 2.
"""

from __future__ import annotations

import click

from .. import __version__
from ._common import parse_size
from .bench import bench_cmd
from .ciff import export_ciff_cmd, import_ciff_cmd
from .encode import encode_cmd
from .eval import eval_cmd
from .index import add_cmd, compact_cmd, delete_cmd, index_cmd, info_cmd
from .pipeline import pipeline_cmd
from .search import search_cmd
from .serve import serve_cmd
from .verify import verify_cmd

__all__ = ["main", "parse_size"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=__version__, prog_name="gpusparse")  # also when run from a source tree
def main() -> None:
    """GPUSparse: exact retrieval over learned sparse vectors (SPLADE and kin), batched on the GPU.

    \b
    Typical use:
      gpusparse index corpus.jsonl.gz --output my-index
      gpusparse search my-index queries.jsonl.gz --k 1000 --output run.trec
      gpusparse info my-index
    """


for _command in (
    index_cmd, search_cmd, info_cmd, encode_cmd, eval_cmd, pipeline_cmd, verify_cmd,
    bench_cmd, add_cmd, delete_cmd, compact_cmd, serve_cmd, export_ciff_cmd, import_ciff_cmd,
):  # fmt: skip
    main.add_command(_command)
