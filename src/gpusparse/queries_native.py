"""A query batch's work per term by the C module ``gpusparse._queries_native``: quantization
(:func:`quantized_rows`), the padded layout (:func:`pad_rows`), and a CUDA graph's batch
(:func:`longest_row`, :func:`stage_rows`), one pass each.

Every search of a quantized index quantizes its queries on the host, and a CUDA graph's batch is
laid out padded on the host, both before the batch's launch: at batch 256 the numpy versions took
~0.4 ms of a ~5 ms search on an H200's host. The module is compiled when the package is
installed (``pip install -e .``); a source tree run without it (``PYTHONPATH=src``) warns once
(:class:`NativeQueriesWarning`) and takes the numpy paths, which give the same arrays.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import numpy as np

# (by name: the import graph of `make lint` sees .py files only)
_native: ModuleType | None
try:
    _native = importlib.import_module(f"{__package__}._queries_native")
except ImportError:
    _native = None

NATIVE = _native is not None  # whether the C passes are there


class NativeQueriesWarning(UserWarning):
    """The queries' C module is not built: quantization and padding take the slower numpy path."""


_warned = False


def _missing() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "gpusparse._queries_native (the queries' C passes) is not built: quantizing and laying out query "
            "batches by numpy, ~0.4 ms more a batch of 256; build it with `pip install -e .` (or "
            "`python setup.py build_ext --inplace`) in the checkout",
            NativeQueriesWarning,
            stacklevel=3,
        )


def _rows(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' arrays as the C passes read them: C-contiguous int64, int32, float32."""
    return (
        np.ascontiguousarray(indptr, dtype=np.int64),
        np.ascontiguousarray(indices, dtype=np.int32),
        np.ascontiguousarray(values, dtype=np.float32),
    )


def quantized_rows(
    indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows (``indptr`` int64, ``indices`` int32, ``values`` float32) with each row's weights as
    levels of its own power-of-two step, ``level · step`` as float32, and terms of level 0
    dropped (:func:`gpusparse.quantize.quantize_queries`'s rule): new ``(indptr, indices,
    values)``; ``None`` without the C module (warned once)."""
    if _native is None:
        _missing()
        return None
    n, nnz = len(indptr) - 1, len(values)
    out_ptr = np.empty(n + 1, dtype=np.int64)
    out_ind, out_val = np.empty(nnz, dtype=np.int32), np.empty(nnz, dtype=np.float32)
    kept = _native.quantize(*_rows(indptr, indices, values), bits, out_ptr, out_ind, out_val)
    return out_ptr, out_ind[:kept], out_val[:kept]


def pad_rows(
    indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, terms: np.ndarray, weights: np.ndarray
) -> bool:
    """Rows (``indptr`` int64, ``indices`` int32, ``values`` float32) into ``terms`` (int64) and
    ``weights`` (float32), both C-contiguous ``[rows, width]``: ``-1`` and ``0`` after each row's
    end (a row longer than ``width`` is refused). ``False`` without the C module (warned once):
    the caller pads by numpy."""
    if _native is None:
        _missing()
        return False
    _native.pad(*_rows(indptr, indices, values), terms, weights)
    return True


def longest_row(indptr: np.ndarray) -> int | None:
    """The most terms of a row of ``indptr`` (int64, rising; 0 for no rows); ``None`` without the
    C module (warned once)."""
    if _native is None:
        _missing()
        return None
    return int(_native.longest(np.ascontiguousarray(indptr, dtype=np.int64)))


def stage_rows(
    indptr: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray,
    out_indptr: np.ndarray,
    out_indices: np.ndarray,
    out_values: np.ndarray,
) -> int | None:
    """Rows (``indptr`` int64, ``indices`` int32, ``values`` float32) as they are into a CUDA
    graph's staging views: int32 row pointers from 0 into ``out_indptr`` (``[rows + 1]``), the
    terms and weights at the start of ``out_indices`` and ``out_values`` (room for all of them
    is checked). Returns the most terms of a row (0 for no rows); ``None`` without the C module
    (warned once): the caller copies by numpy."""
    if _native is None:
        _missing()
        return None
    return int(_native.stage(*_rows(indptr, indices, values), out_indptr, out_indices, out_values))
