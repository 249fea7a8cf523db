"""The GPU kernels and their launchers.

Triton kernels that fill a ``[B, W]`` float32 score buffer for one document chunk:

* :func:`scatter_add_scores`: the paper's fused scatter-add (one program per query term);
* :func:`docpar_scores`: the paper's document-parallel CSR kernel (one program per query
  and block of documents), over the document-major copy (:func:`gpusparse.layout.forward.forward_index`).

Both write approximate float32 scores (float32 sums, in any order, of ``w_q · w_d``;
exactly 0 for documents sharing no term with the query) that
:func:`gpusparse.exact.select_exact_topk` turns into the exact top-k.

CUDA kernels, compiled at run time through CuPy (sources in ``cuda/*.cu``, package data):

* :mod:`.tile_candidates`: the tiled engine's per-(query, tile) accumulation and candidates;
* :mod:`.compact`: the compaction of a wave's candidates;
* :mod:`.rescore`: canonical rescoring of (query, document) pairs and candidates' ranking keys;
* :mod:`.rowsort`: the top-k of rows of ranking keys, and the NCCL merge's pack and merge;
* :mod:`.cupy_launch`: the one compile cache and launch path they share (and ``available``).

Importing this package imports neither Triton nor CuPy: the Triton launchers are loaded on
first use (PEP 562), and raise an :class:`ImportError` saying what to install when Triton is
missing; the CUDA modules are imported by name and import CuPy only to compile or launch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .docpar import docpar_scores
    from .scatter import scatter_add_scores

__all__ = ["docpar_scores", "scatter_add_scores", "triton_available"]

TRITON_HINT = (
    "the GPU kernels need Triton: `pip install triton` (it ships with the CUDA builds of PyTorch on Linux x86-64)"
)

# Public name -> submodule defining it; loaded lazily so that `import gpusparse.kernels`
# works (and stays cheap) without Triton.
_LAZY = {
    "scatter_add_scores": ".scatter",
    "docpar_scores": ".docpar",
}


def triton_available() -> bool:
    """Whether the kernels can run here: Triton imports and there is a CUDA device or
    ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, for tests and debugging)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
