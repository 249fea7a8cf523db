"""JSONL vectors read a chunk at a time by one native pass (the C module ``gpusparse._jsonl_native``).

:func:`native_columns` hands a chunk's bytes and the vocabulary's hash table
(:class:`~gpusparse.jsonl_keys.KeyTable`) to the C pass, which checks each line against
JSON's grammar, finds the ids, looks the tokens up in the table and parses the weights
exactly as Python's ``float()`` (then float32), without the GIL. Tokens it cannot decide
(spelled with escapes the table lacks, longer than 24 bytes) are looked up here, one by
one. Where it is not sure it returns ``None`` and the caller reads the chunk by its next
path (:func:`~gpusparse.jsonl_columns.columns_of_chunk`, then orjson, then the strict path).

The module is compiled when the package is installed (``pip install -e .``). A source tree
run without it (``PYTHONPATH=src``) warns once (:class:`NativeReaderWarning`) and reads by
the numpy path.
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from .jsonl_keys import KeyTable

# (by name: the import graph of `make lint` sees .py files only, and would read
# `from . import _jsonl_native` as an import of the whole package)
_native: ModuleType | None
try:
    _native = importlib.import_module(f"{__package__}._jsonl_native")
except ImportError:
    _native = None

NATIVE = _native is not None  # whether the C pass is there
_PENDING = 4096  # tokens a chunk may leave to the one-by-one look-up; more: the next path
_ESCAPED = 1 << 62


class NativeReaderWarning(UserWarning):
    """The JSONL reader's C module is not built: chunks are read by the slower numpy path."""


_warned = False


def warn_if_missing() -> None:
    """Say once (a :class:`NativeReaderWarning`) that the C pass is missing and how to build it."""
    global _warned
    if _native is None and not _warned:
        _warned = True
        warnings.warn(
            "gpusparse._jsonl_native (the JSONL reader's C pass) is not built: reading by the numpy path, "
            "2-3x slower; build it with `pip install -e .` (or `python setup.py build_ext --inplace`) in the checkout",
            NativeReaderWarning,
            stacklevel=3,
        )


@dataclass
class NativeColumns:
    """Records of a chunk read by :func:`native_columns`; weights already float32, their
    problems found by the pass (none is non-finite: such a chunk is refused)."""

    ids: list[object]
    newlines: int
    lines: np.ndarray  # int64
    lengths: np.ndarray  # int64
    terms: np.ndarray  # int32
    weights: np.ndarray  # float32
    negative: tuple[int, float] | None  # (record, value) of the first negative weight
    beyond_f32: tuple[int, float] | None  # and of the first beyond float32
    unknown_skipped: int


def _unescape(raw: bytes) -> str:
    """A JSON string's text from the bytes between its quotes (checked by the pass)."""
    return json.loads(b'"' + raw + b'"')


def native_columns(
    data: bytes, table: KeyTable, lookup: Callable[[str], int | None], unknown: str
) -> NativeColumns | None:
    """The records of ``data`` (whole JSONL lines) by the C pass, or ``None`` where the next
    path must decide (and when the module is not built)."""
    if _native is None:
        return None
    newlines, room = _native.bounds(data)  # (each posting has its ':')
    n_lines = newlines + 1
    lines = np.empty(n_lines, np.int64)
    lengths = np.empty(n_lines, np.int64)
    spans = np.empty(2 * n_lines, np.int64)
    terms = np.empty(room, np.int32)
    weights = np.empty(room, np.float32)
    pending = np.empty(3 * _PENDING, np.int64)
    got = _native.parse(
        data, table.w0, table.w1, table.w2, table.tid, table.bits, table.probes, unknown == "skip",
        lines, lengths, spans, terms, weights, pending,
    )  # fmt: skip
    if got is None:
        return None
    ids, records, postings, n_pending, skipped, newlines, negative, beyond = got
    lines, lengths = lines[:records], lengths[:records]
    terms, weights = terms[:postings], weights[:postings]
    if None in ids:  # ids spelled with escapes
        for r in [i for i, x in enumerate(ids) if x is None]:
            ids[r] = _unescape(data[int(spans[2 * r]) : int(spans[2 * r + 1]) & (_ESCAPED - 1)])
    if n_pending:
        rows = pending[: 3 * n_pending].reshape(-1, 3)
        found: dict[bytes, int | None] = {}
        for at, start, end in rows.tolist():
            raw = data[start:end]
            if raw not in found:
                found[raw] = lookup(_unescape(raw))
            tid = found[raw]
            terms[at] = -1 if tid is None else tid
        if None in found.values():
            if unknown == "error" or negative is not None or beyond is not None:
                return None  # the strict path names the token; the weight problems would move
            keep = terms >= 0
            skipped += int(keep.size - np.count_nonzero(keep))
            rec = np.repeat(np.arange(records), lengths)
            lengths = np.bincount(np.compress(keep, rec), minlength=records).astype(np.int64)
            terms, weights = np.compress(keep, terms), np.compress(keep, weights)
    return NativeColumns(ids, newlines, lines, lengths, terms, weights, negative, beyond, skipped)
