"""JSONL vectors parsed a chunk of lines at a time: a fast path, and the strict one behind it.

:func:`parse_chunk` turns the bytes of whole lines into compact arrays (ids, line numbers,
postings per record, int32 term ids, float32 weights: :class:`ChunkResult`). It first tries
the native pass (:mod:`gpusparse.jsonl_native`: one C pass over the chunk, float32 weights
and their problems found there), then the numpy columnar path
(:mod:`gpusparse.jsonl_columns`), then the orjson path: orjson decodes each line, and the
per-posting work runs in C over the whole chunk (all tokens → ids with one ``itemgetter``
call and one ``bytes.join``, all weights with one ``np.fromiter``). Each fast path takes a
chunk only when it is sure the strict path would read it the same; on any doubt or error it
gives up and the next one tries, the last being the strict path (:func:`strict_line`), line
by line, which produces the exact error message and stops there. The paths in Python parse
weights as float64 (as ``json`` does), check them (:func:`weight_problems`) and convert them
to float32 in the chunk, so a read never holds float64 weights beyond one chunk.

Checks that depend on other chunks (duplicate ids across chunks, weight values over the
whole read) are reported by the caller (:mod:`gpusparse.formats`), so chunks can be parsed
in any order, in other processes, and give the same collection and the same errors.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any, Literal

import numpy as np
import orjson

from .collection import _short, check_id, id_problem, json_type_name
from .errors import InputError
from .jsonl_columns import KeyTable, columns_of_chunk
from .jsonl_native import native_columns, warn_if_missing
from .vocab import Vocabulary

Unknown = Literal["error", "skip"]
_F32_MAX = 3.4028234663852886e38


class _Fallback(Exception):
    """The fast path is not sure: parse the chunk with the strict path."""


class TokenIds:
    """A vocabulary's token -> term id map in the forms the chunk parsers use.

    ``get`` is :attr:`Vocabulary.lookup` (``None`` for an unknown token); ``table`` finds the
    tokens of a whole chunk at once in numpy (:class:`~gpusparse.jsonl_columns.KeyTable`);
    ``packed`` (made when first needed) maps each token to its id as 4 little-endian bytes,
    so that a chunk's tokens decoded by orjson become an int32 array with one ``itemgetter``
    call and one ``bytes.join``, both in C. ``table`` and ``packed`` are ``None`` for an
    integer vocabulary, whose tokens are parsed by ``get``. Pickled to worker processes.
    """

    def __init__(self, vocab: Vocabulary) -> None:
        self.get = vocab.lookup
        self.table: KeyTable | None = None
        self._tokens: list[str] | None = None
        self._packed: dict[str, bytes] | None = None
        if not vocab.is_integer:
            self._tokens = vocab.tokens()
            self.table = KeyTable(self._tokens)
            warn_if_missing()  # once, in the process that sets up the read

    @property
    def packed(self) -> dict[str, bytes] | None:
        if self._packed is None and self._tokens is not None:
            packed: dict[str, bytes] = {}
            for i, tok in enumerate(self._tokens):
                packed.setdefault(tok, i.to_bytes(4, "little"))  # the first of repeated tokens, as Vocabulary
            self._packed = packed
        return self._packed


# A weight refused by the whole-read checks, in the order they are applied (see weight_problems).
WEIGHT_CHECKS = ("is not finite", "is negative", "overflows float32")


@dataclass
class ChunkResult:
    """Records of one chunk, line numbers relative to the chunk (0 = its first line).

    Weights are float32 already (converted from the parsed float64 values, as every reader
    does); the checks that need the float64 values ran before the conversion and left the
    first offending weight of each kind in ``bad_weights``, for the caller to report once
    the whole read is done.
    """

    ids: list[str]
    lines: np.ndarray  # int64, relative line of each record
    lengths: np.ndarray  # int64, postings of each record
    terms: np.ndarray  # int32
    weights: np.ndarray  # float32
    bad_weights: tuple[tuple[int, float] | None, ...]  # per WEIGHT_CHECKS: (record in chunk, value)
    unknown_skipped: int = 0
    newlines: int = 0  # newline characters in the chunk: the next chunk's line offset
    parser: str = "strict"  # which path read the chunk: native, columnar, orjson, strict
    # The strict path's error, if any: (reason, relative line, field). The records above
    # are those before the error line, so the caller can report earlier problems first.
    error: tuple[str, int, str | None] | None = None


def weight_problems(values: np.ndarray, lengths: np.ndarray) -> tuple[tuple[int, float] | None, ...]:
    """For each of :data:`WEIGHT_CHECKS`, the first weight of ``values`` (float64) failing it,
    as (record, value) with records of ``lengths`` postings each; ``None`` if none fails."""
    if values.size == 0 or bool(np.all((values >= 0) & (values <= _F32_MAX))):  # NaN fails both
        return (None, None, None)
    out: list[tuple[int, float] | None] = []
    ends = np.cumsum(lengths)
    for bad in (~np.isfinite(values), values < 0, np.abs(values) > _F32_MAX):
        i = int(np.argmax(bad))
        out.append((int(np.searchsorted(ends, i, side="right")), float(values[i])) if bad[i] else None)
    return tuple(out)


def _result(
    ids: list[str], lines: np.ndarray, lengths: np.ndarray, terms: np.ndarray, values: np.ndarray, newlines: int
) -> ChunkResult:
    """A chunk's records with float64 ``values`` checked, then converted to float32."""
    with np.errstate(over="ignore"):  # a weight beyond float32 is in bad_weights, reported later
        weights = values.astype(np.float32)
    return ChunkResult(
        ids=ids,
        lines=lines,
        lengths=lengths,
        terms=terms,
        weights=weights,
        bad_weights=weight_problems(values, lengths),
        newlines=newlines,
    )


# -- the strict path: one line, json with every check --------------------------------------


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | tuple[tuple[str, Any], ...]:
    """A decoded JSON object: a dict, or its pairs as a tuple when a key repeats.

    json's default keeps the last of repeated keys; a vector naming one token twice must
    have it summed (like any duplicate term), so such an object keeps all its pairs. JSON
    makes tuples of nothing else: a tuple is always an object with a repeated key.
    """
    d = dict(pairs)
    return d if len(d) == len(pairs) else tuple(pairs)


_DECODER = json.JSONDecoder(object_pairs_hook=_json_object)


def decode_json_line(
    text: bytes | str, *, path: str | os.PathLike[str] | None = None, line: int | None = None
) -> object:
    """Decode one JSONL line as the readers do, or raise a one-line :class:`InputError`.

    Bytes must be UTF-8 (a leading byte-order mark is allowed). JSON objects come back as
    dicts, except an object with a repeated key: a tuple of all its ``(key, value)`` pairs
    (``dict(pairs)`` keeps the last, as ``json.loads`` would). Malformed JSON, nesting too
    deep for the decoder and integers beyond Python's digit limit are errors naming
    ``path:line``.
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if text.startswith("\ufeff"):
            text = text[1:]
        return _DECODER.decode(text)
    except UnicodeDecodeError:
        raise InputError("not UTF-8 text", path=path, line=line) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"malformed JSON: {exc.msg} at column {exc.colno}", path=path, line=line) from None
    except RecursionError:
        raise InputError("malformed JSON: nested too deeply", path=path, line=line) from None
    except ValueError as exc:  # int("...") beyond sys.get_int_max_str_digits()
        reason = (
            f"a number with more than {sys.get_int_max_str_digits():,} digits"
            if "integer string conversion" in str(exc)
            else str(exc).split("\n")[0]
        )
        raise InputError(f"malformed JSON: {reason}", path=path, line=line) from None


VECTOR_RECORD_KEYS = ("id", "_id", "vector")


def record_dict(
    pairs: tuple[tuple[str, Any], ...],
    keys: tuple[str, ...] | list[str] = VECTOR_RECORD_KEYS,
    *,
    path: str | os.PathLike[str] | None = None,
    line: int | None = None,
) -> dict[str, Any]:
    """The record of a JSON line whose object repeats a key (:func:`decode_json_line` gave its pairs).

    A repeated key among ``keys``, those the caller reads, is refused: which of two ids or
    vectors is meant? Other repeated keys keep the last value, as ``json.loads`` does.
    """
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen and key in keys:
            raise InputError("key repeated in one record", path=path, line=line, field=key)
        seen.add(key)
    return dict(pairs)


@dataclass
class StrictRecords:
    """Records parsed by :func:`strict_line`, growing one line at a time."""

    ids: list[str] = field(default_factory=list)
    lines: array = field(default_factory=lambda: array("q"))
    lengths: array = field(default_factory=lambda: array("q"))
    terms: array = field(default_factory=lambda: array("i"))
    weights: array = field(default_factory=lambda: array("d"))
    unknown_skipped: int = 0


def strict_line(
    line: bytes, lineno: int, lookup: Callable[[str], int | None], unknown: Unknown, out: StrictRecords
) -> None:
    """Parse one non-blank line into ``out`` with every check, or raise :class:`InputError`
    (without a path: the caller adds it)."""
    obj = decode_json_line(line, line=lineno)
    if type(obj) is not dict:
        if type(obj) is not tuple:
            raise InputError(f"expected a JSON object, got {json_type_name(obj)}", line=lineno)
        obj = record_dict(obj, line=lineno)
    doc_id = check_id(obj.get("id", obj.get("_id")), line=lineno)
    vec = obj.get("vector")
    if vec is None:
        raise InputError("missing", line=lineno, field="vector")
    if type(vec) is dict:
        toks, vals = vec.keys(), vec.values()
    elif type(vec) is tuple:  # a repeated token: keep both, they are summed with other duplicates
        toks, vals = zip(*vec, strict=True)
    else:
        raise InputError(f"expected a {{token: weight}} object, got {json_type_name(vec)}", line=lineno, field="vector")
    tids = list(map(lookup, toks))
    if None in tids:
        if unknown == "error":
            tok = list(toks)[tids.index(None)]
            raise InputError(
                f"unknown token {tok!r} (use --unknown-tokens skip to drop such tokens)", line=lineno, field="vector"
            )
        keep = [i is not None for i in tids]
        out.unknown_skipped += keep.count(False)
        tids = [i for i, k in zip(tids, keep, strict=True) if k]
        vals = [w for w, k in zip(vals, keep, strict=True) if k]
    # JSON true/false would pass as 1.0/0.0: look for them only when the line could hold one.
    bad_bool = (b"true" in line or b"false" in line) and any(type(w) is bool for w in vals)
    n = len(out.weights)
    try:
        if bad_bool:
            raise TypeError
        out.weights.extend(vals)
    except (TypeError, OverflowError):
        del out.weights[n:]
        bad = next(w for w in vals if type(w) not in (int, float) or abs(w) > _F32_MAX)
        what = "is not a number" if type(bad) not in (int, float) else "overflows float32"
        raise InputError(f"weight {_short(bad)} {what}", line=lineno, field="vector") from None
    out.terms.extend(tids)
    out.ids.append(doc_id)
    out.lines.append(lineno)
    out.lengths.append(len(tids))


def _strict_chunk(data: bytes, lookup: Callable[[str], int | None], unknown: Unknown) -> ChunkResult:
    out = StrictRecords()
    error = None
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            strict_line(line, i, lookup, unknown, out)
        except InputError as exc:
            error = (exc.reason, i, exc.field)
            break
    res = _result(
        out.ids,
        np.frombuffer(out.lines, np.int64).copy(),
        np.frombuffer(out.lengths, np.int64).copy(),
        np.frombuffer(out.terms, np.int32).copy(),
        np.frombuffer(out.weights, np.float64),
        data.count(b"\n"),
    )
    res.unknown_skipped, res.error = out.unknown_skipped, error
    return res


# -- the fast path -------------------------------------------------------------------------


def _has_bool(values: np.ndarray, lengths: np.ndarray, vecs: list[dict[str, Any]]) -> bool:
    """Whether a weight was JSON ``true``/``false`` (read as 1.0/0.0): only the records with
    a weight of exactly 1 or 0 are looked at."""
    maybe = np.flatnonzero((values == 1.0) | (values == 0.0))
    if maybe.size == 0:
        return False
    rows = np.unique(np.searchsorted(np.cumsum(lengths), maybe, side="right")).tolist()
    return any(type(w) is bool for r in rows for w in vecs[r].values())


def _fast_chunk(data: bytes, ids_of: TokenIds, unknown: Unknown) -> ChunkResult:
    ids: list[str] = []
    lines: list[int] = []
    vecs: list[dict[str, Any]] = []
    loads = orjson.loads
    for i, line in enumerate(data.split(b"\n")):
        if not line or line.isspace():
            continue
        obj = loads(line)  # any error: the strict path says what it is
        if type(obj) is not dict:
            raise _Fallback
        raw = obj.get("id", obj.get("_id"))
        if type(raw) is not str or id_problem(raw) is not None:
            raw = check_id(raw)  # an integer id, or an error
        vec = obj.get("vector")
        if type(vec) is not dict:
            raise _Fallback
        # orjson keeps the last of repeated keys; the strict path sums repeated tokens and
        # refuses a repeated id or vector. Each key-value pair has one ':' outside strings,
        # so as many ':' bytes as decoded pairs proves that no key repeats.
        if line.count(b":") != len(obj) + len(vec) and not _no_repeats(line, obj, vec):
            raise _Fallback
        ids.append(raw)
        lines.append(i)
        vecs.append(vec)
    lengths = np.fromiter(map(len, vecs), np.int64, len(vecs))
    total = int(lengths.sum())
    # Weights in C: a string, null, list or object is a TypeError, an int beyond float64 an
    # OverflowError (np.fromiter is faster but reads "1.5" as 1.5 and null as nan).
    values = np.frombuffer(array("d", chain.from_iterable(map(dict.values, vecs))), np.float64)
    if _has_bool(values, lengths, vecs):
        raise _Fallback  # true/false pass as 1.0/0.0
    terms, skipped = _term_ids(vecs, total, ids_of, unknown)
    if skipped is not None:  # unknown tokens dropped: their weights and lengths too
        values, lengths = values[skipped.keep], skipped.lengths
    res = _result(ids, np.array(lines, np.int64), lengths, terms, values, data.count(b"\n"))
    res.unknown_skipped = 0 if skipped is None else skipped.dropped
    res.parser = "orjson"
    return res


@dataclass
class _Skipped:
    keep: np.ndarray  # bool, per posting
    lengths: np.ndarray  # int64, postings kept per record
    dropped: int


def _term_ids(
    vecs: list[dict[str, Any]], total: int, ids_of: TokenIds, unknown: Unknown
) -> tuple[np.ndarray, _Skipped | None]:
    """The term ids of all tokens of ``vecs`` (int32), looked up in C for the whole chunk."""
    if ids_of.packed is not None and total > 1:
        try:
            packed = itemgetter(*chain.from_iterable(vecs))(ids_of.packed)
            return np.frombuffer(b"".join(packed), np.int32), None
        except KeyError:  # an unknown token
            pass
    tids = list(map(ids_of.get, chain.from_iterable(vecs)))
    if None not in tids:
        return np.array(tids, np.int32).reshape(-1), None
    if unknown == "error":
        raise _Fallback  # the strict path names the token and the line
    keep = np.fromiter((t is not None for t in tids), bool, len(tids))
    rows = np.repeat(np.arange(len(vecs)), np.fromiter(map(len, vecs), np.int64, len(vecs)))
    lengths = np.bincount(rows[keep], minlength=len(vecs)).astype(np.int64)
    terms = np.array([t for t in tids if t is not None], np.int32).reshape(-1)
    return terms, _Skipped(keep, lengths, int(keep.size - np.count_nonzero(keep)))


def _no_repeats(line: bytes, obj: dict[str, Any], vec: dict[str, Any]) -> bool:
    """Whether the ':' bytes of ``line`` beyond its decoded pairs are all inside strings we
    can see (top-level string values, vector tokens); if not, the strict path decides."""
    inside = sum(v.count(":") for v in obj.values() if type(v) is str) + sum(k.count(":") for k in obj)
    inside += sum(k.count(":") for k in vec)
    return line.count(b":") == len(obj) + len(vec) + inside


def _checked_ids(ids: list[object]) -> list[str]:
    """Raw ids (strings or integers) as :func:`check_id` reads them; an error raises."""
    joined = "".join(ids) if set(map(type, ids)) == {str} else None  # type: ignore[arg-type]
    if joined is None or not joined.isprintable() or " " in joined or "" in ids:  # else all pass id_problem
        for i, raw in enumerate(ids):
            if type(raw) is not str or id_problem(raw) is not None:
                ids[i] = check_id(raw)  # an integer id, or an error
    return ids  # type: ignore[return-value]


def _native_chunk(data: bytes, ids_of: TokenIds, unknown: Unknown) -> ChunkResult:
    """The chunk read by the C pass (:func:`~gpusparse.jsonl_native.native_columns`)."""
    cols = None if ids_of.table is None else native_columns(data, ids_of.table, ids_of.get, unknown)
    if cols is None:
        raise _Fallback
    return ChunkResult(
        ids=_checked_ids(cols.ids),
        lines=cols.lines,
        lengths=cols.lengths,
        terms=cols.terms,
        weights=cols.weights,
        bad_weights=(None, cols.negative, cols.beyond_f32),  # (a weight not finite: refused by the pass)
        unknown_skipped=cols.unknown_skipped,
        newlines=cols.newlines,
        parser="native",
    )


def _columns_chunk(data: bytes, ids_of: TokenIds, unknown: Unknown) -> ChunkResult:
    """The chunk read by :func:`~gpusparse.jsonl_columns.columns_of_chunk` (no Python object a posting)."""
    cols = None if ids_of.table is None else columns_of_chunk(data, ids_of.table, ids_of.get, unknown)
    if cols is None:
        raise _Fallback
    ids = _checked_ids(cols.raw_ids)
    res = _result(ids, cols.lines, cols.lengths, cols.terms, cols.values, cols.newlines)
    res.unknown_skipped = cols.unknown_skipped
    res.parser = "columnar"
    return res


def parse_chunk(data: bytes, ids_of: TokenIds, unknown: Unknown) -> ChunkResult:
    """Records of ``data`` (whole lines): by the native pass when possible, else by
    columns, else by orjson, else as the strict path reads them."""
    for fast in (_native_chunk, _columns_chunk):
        try:
            return fast(data, ids_of, unknown)
        except (_Fallback, InputError):
            pass
    try:
        return _fast_chunk(data, ids_of, unknown)
    except (_Fallback, InputError, orjson.JSONDecodeError, TypeError, OverflowError, ValueError, RecursionError):
        return _strict_chunk(data, ids_of.get, unknown)


GZIP_ERRORS = (EOFError, gzip.BadGzipFile)
