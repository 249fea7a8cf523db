"""JSONL vectors parsed a chunk of lines at a time: a fast path, and the strict one behind it.

:func:`parse_chunk` turns the bytes of whole lines into growing arrays (ids, line numbers,
postings per record, term ids, float64 weights). It first tries the fast path: orjson
decodes each line, and the per-posting work runs in C over the whole chunk (tokens → ids
through the vocabulary's dict, weights into an ``array('d')`` in bulk). The fast path takes
a chunk only when it is sure the strict path would read it the same; on any doubt or
error it gives up and the chunk is parsed again, line by line, by the strict path
(:func:`strict_line`), which produces the exact error message and stops there.

Checks that depend on other chunks (duplicate ids across chunks, weight values over the
whole read) are the caller's (:mod:`gpusparse.formats`), so chunks can be parsed in any
order, in other processes, and give the same collection and the same errors.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

from .collection import _short, check_id, id_problem, json_type_name
from .errors import InputError

Unknown = Literal["error", "skip"]
_BOOL_VALUE = re.compile(rb":[ \t\r]*(?:true|false)")
_F32_MAX = 3.4028234663852886e38


class _Fallback(Exception):
    """The fast path is not sure: parse the chunk with the strict path."""


@dataclass
class ChunkResult:
    """Records of one chunk, line numbers relative to the chunk (0 = its first line)."""

    ids: list[str] = field(default_factory=list)
    lines: array = field(default_factory=lambda: array("q"))
    lengths: array = field(default_factory=lambda: array("q"))
    terms: array = field(default_factory=lambda: array("i"))
    weights: array = field(default_factory=lambda: array("d"))
    unknown_skipped: int = 0
    newlines: int = 0  # newline characters in the chunk: the next chunk's line offset
    # The strict path's error, if any: (reason, relative line, field). The records above
    # are those before the error line, so the caller can report earlier problems first.
    error: tuple[str, int, str | None] | None = None


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


def strict_line(
    line: bytes, lineno: int, lookup: Callable[[str], int | None], unknown: Unknown, out: ChunkResult
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
    out = ChunkResult(newlines=data.count(b"\n"))
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            strict_line(line, i, lookup, unknown, out)
        except InputError as exc:
            out.error = (exc.reason, i, exc.field)
            break
    return out


# -- the fast path -------------------------------------------------------------------------


def _fast_chunk(data: bytes, lookup: Callable[[str], int | None], unknown: Unknown) -> ChunkResult:
    out = ChunkResult(newlines=data.count(b"\n"))
    ids, lines, lengths, weights = out.ids, out.lines, out.lengths, out.weights
    keys: list[str] = []
    loads = orjson.loads
    # A JSON true/false value follows a ':' (tokens "true" and "false" are keys, not values).
    may_hold_bool = _BOOL_VALUE.search(data) is not None
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
        n = len(vec)
        # orjson keeps the last of repeated keys; the strict path sums repeated tokens and
        # refuses a repeated id or vector. Each key-value pair has one ':' outside strings,
        # so as many ':' bytes as decoded pairs proves that no key repeats.
        if line.count(b":") != len(obj) + n and not _no_repeats(line, obj, vec):
            raise _Fallback
        if may_hold_bool and any(type(w) is bool for w in vec.values()):
            raise _Fallback
        weights.extend(vec.values())  # TypeError on a string or null, OverflowError on a huge int
        keys.extend(vec)
        ids.append(raw)
        lines.append(i)
        lengths.append(n)
    try:  # token -> id in C, for the whole chunk; None (an unknown token) is a TypeError
        out.terms = array("i", np.fromiter(map(lookup, keys), np.int32, len(keys)).tobytes())
    except TypeError:
        if unknown == "error":
            raise _Fallback from None
        _skip_unknown(out, list(map(lookup, keys)))
    return out


def _skip_unknown(out: ChunkResult, tids: list[int | None]) -> None:
    """Drop the postings of unknown tokens (``unknown="skip"``), counting them."""
    keep = np.array([t is not None for t in tids], dtype=bool)
    out.unknown_skipped = int(keep.size - np.count_nonzero(keep))
    out.terms = array("i", np.array([t for t in tids if t is not None], dtype=np.int32).tobytes())
    out.weights = array("d", np.frombuffer(out.weights, np.float64)[keep].tobytes())
    lengths = np.frombuffer(out.lengths, np.int64)
    rows = np.repeat(np.arange(lengths.size), lengths)
    kept = np.bincount(rows[keep], minlength=lengths.size)
    out.lengths = array("q", kept.astype(np.int64).tobytes())


def _no_repeats(line: bytes, obj: dict[str, Any], vec: dict[str, Any]) -> bool:
    """Whether the ':' bytes of ``line`` beyond its decoded pairs are all inside strings we
    can see (top-level string values, vector tokens); if not, the strict path decides."""
    inside = sum(v.count(":") for v in obj.values() if type(v) is str) + sum(k.count(":") for k in obj)
    inside += sum(k.count(":") for k in vec)
    return line.count(b":") == len(obj) + len(vec) + inside


def parse_chunk(data: bytes, lookup: Callable[[str], int | None], unknown: Unknown) -> ChunkResult:
    """Records of ``data`` (whole lines), fast when possible, else as the strict path reads them."""
    try:
        return _fast_chunk(data, lookup, unknown)
    except (_Fallback, InputError, orjson.JSONDecodeError, TypeError, OverflowError, ValueError, RecursionError):
        return _strict_chunk(data, lookup, unknown)


GZIP_ERRORS = (EOFError, gzip.BadGzipFile)
