"""JSONL vectors read a chunk at a time without a Python object per posting.

:func:`columns_of_chunk` reads the bytes of whole lines of JsonVectorCollection JSONL
(``{"id": ..., "contents": ..., "vector": {token: weight, ...}}``) with numpy over the
whole chunk: one pass finds the bytes that matter to JSON's structure (quotes, backslashes,
braces, brackets, newlines), escapes and strings are resolved on those positions only, and
what is left is each line's object: its keys, the vector object, and in it each token (a
span of bytes) and each weight (the bytes between the token's ``:`` and the next ``,`` or
``}``). Tokens become term ids through a hash table of the vocabulary's spellings
(:class:`~gpusparse.jsonl_keys.KeyTable`, all tokens of the chunk at once); weights are
parsed by an exact decimal parser on 16-byte windows
(:func:`~gpusparse.jsonl_numbers.parse_numbers`). msgspec checks that each line is
well-formed JSON (and decodes its id) without building the vector: what msgspec accepts
that ``json`` does not (repeated keys, bytes that are not UTF-8 in strings it skips) is
checked here.

This path only reads what it is sure of. It returns ``None`` (the caller then parses the
chunk with its strict path, which gives the exact error message) for anything else: a line
that is not JSON or not an object, a missing, repeated or non-object ``vector``, a
repeated ``id``/``_id``, a key of the record spelled with an escape, arrays or deeper
objects, a weight that is not a number or not finite, a token the vocabulary lacks while
unknown tokens are errors, text that is not UTF-8. So it never accepts what the strict
path refuses, and what it accepts it reads as the strict path does: the same records,
term ids in order (repeated tokens kept), float64 weights equal to Python's ``float()``.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from .jsonl_keys import KEY_BYTES, KeyTable, key_words
from .jsonl_numbers import HIGH, ONES, parse_numbers, rows_view

_PAD = 32  # bytes of padding each side of a chunk, so 32-byte windows never leave it
# The bytes of the structural scan.
_QUOTE, _BACKSLASH, _COLON, _COMMA, _OPEN, _CLOSE, _NEWLINE = b'"\\:,{}\n'


# Weights of 17 characters or more (json.dumps of float64 values: 0.8394725322723389) are parsed
# one by one (~150 ns each): orjson reads such chunks faster, so they go to it.
_NUMBER = re.compile(rb":\s*-?[0-9]")
_LONG_NUMBER = re.compile(rb":\s*-?[0-9][0-9.eE+-]{16}")


def _long_numbers(data: bytes) -> bool:
    """Whether most weights of the chunk's first line are 17 characters or more."""
    end = data.find(b"\n", 0, 1 << 16)
    first = data[: end if end >= 0 else 1 << 16]
    n = len(_NUMBER.findall(first))
    return n > 0 and 2 * len(_LONG_NUMBER.findall(first)) > n


def _space(b: np.ndarray) -> np.ndarray:
    """Whether each byte is JSON whitespace (newlines aside: lines are split at them)."""
    return (b == 32) | (b == 9) | (b == 13)


@dataclass
class Columns:
    """Records of a chunk read by :func:`columns_of_chunk`: ids are decoded by the caller
    (``raw_ids``: msgspec's values of ``id``/``_id``), weights are float64."""

    raw_ids: list[object]
    newlines: int  # newline characters in the chunk
    lines: np.ndarray  # int64: line of each record in the chunk
    lengths: np.ndarray  # int64: postings of each record
    terms: np.ndarray  # int32
    values: np.ndarray  # float64
    unknown_skipped: int


class _Record(msgspec.Struct):
    """What msgspec decodes of a line: its ids (the vector is checked, not built)."""

    id: object = msgspec.UNSET
    alt_id: object = msgspec.field(name="_id", default=msgspec.UNSET)


_UNSET = msgspec.UNSET
_NAMES = {name: int.from_bytes(name.ljust(8, b"\0"), "little") for name in (b"id", b"_id", b"vector")}


_DECODE = msgspec.json.Decoder(_Record).decode
_GET_ID = operator.attrgetter("id")


def _raw_ids(lines: list[bytes], which: list[int] | range) -> list[object] | None:
    """The id of each line as ``obj.get("id", obj.get("_id"))`` reads it, msgspec having
    checked that each line is a well-formed JSON object; ``None`` if one is not."""
    try:
        if isinstance(which, range):  # every line (map: no Python code a line)
            recs = list(map(_DECODE, lines[which.start : which.stop]))
        else:
            recs = [_DECODE(lines[i]) for i in which]
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    ids = list(map(_GET_ID, recs))
    if _UNSET in ids:  # no "id": "_id", or None
        ids = [r.id if r.id is not _UNSET else None if r.alt_id is _UNSET else r.alt_id for r in recs]
    return ids


def _non_blank(data: bytes, lines: list[bytes]) -> list[int] | range:
    """Indices of the lines that are not blank (``not line.strip()``, as the strict path)."""
    n = len(lines) - (lines[-1] == b"")
    if data.count(b"\n{") + data.startswith(b"{") == n:  # every line starts with "{"
        return range(n)
    return [i for i, ln in enumerate(lines) if ln and not ln.isspace()]


def _unescape(raw: bytes) -> str | None:
    """A JSON string's text from the bytes between its quotes (``None`` if not UTF-8)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if "\\" not in text else json.loads(f'"{text}"')


class _Tokens:
    """The structural bytes of a chunk outside strings, in order: positions ``pos`` (in the
    padded buffer), classes ``cls``, object ``depth`` (after the byte), and for each string
    token the span of its bytes (``opens`` / ``closes`` by ``rank``)."""

    def __init__(self, buf: np.ndarray) -> None:
        # Candidates by 7 byte operations, not 13: with bit 0x20 set, '[' '\\' ']' '{' '|' '}' are
        # 0x7B-0x7D, '"' (and 0x02) is 0x22, '\n' (and '*') is 0x2A. The extra bytes do nothing.
        low = buf | np.uint8(0x20)
        special = (low - np.uint8(0x7B)) <= 2
        special |= low == 0x22
        special |= low == 0x2A
        # (np.take and np.compress: many times faster than fancy and boolean indexing here)
        pos = np.flatnonzero(special)
        c = np.take(buf, pos)
        backslash = c == _BACKSLASH
        self.backslashes = np.compress(backslash, pos)
        if self.backslashes.size:  # backslashes and the quotes they escape: inside strings, no tokens
            b = self.backslashes
            idx = np.arange(b.size)
            run = np.ones(b.size, bool)
            run[1:] = b[1:] != b[:-1] + 1
            escaped = b[(idx - np.maximum.accumulate(np.where(run, idx, 0))) % 2 == 0] + 1
            at = np.minimum(np.searchsorted(pos, escaped), pos.size - 1)
            c[np.compress(np.take(pos, at) == escaped, at)] = 0
            c[np.flatnonzero(backslash)] = 0
        quote = c == _QUOTE
        count = np.cumsum(quote, dtype=np.int32)
        self.ok = count.size > 0 and count[-1] % 2 == 0
        outside = (count & 1).astype(bool) == quote  # opening quotes, and the rest outside strings
        qpos = np.compress(quote, pos)
        self.opens, self.closes = qpos[0::2] + 1, qpos[1::2]  # spans of the strings' bytes
        self.pos, self.cls = np.compress(outside, pos), np.compress(outside, c)
        self.rank = np.compress(outside, count) >> 1
        tc = self.cls
        self.depth = np.cumsum((tc == _OPEN).view(np.int8) - (tc == _CLOSE).view(np.int8), dtype=np.int32)
        self.newlines = np.flatnonzero(tc == _NEWLINE)  # token index of each newline
        self.brackets = bool(((tc == 91) | (tc == 93)).any())

    def line(self, tokens: np.ndarray) -> np.ndarray:
        """The line (in the chunk) of each token."""
        return np.searchsorted(self.newlines, tokens)

    def span(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start and end (exclusive) of the bytes of string tokens."""
        r = np.take(self.rank, tokens)
        return np.take(self.opens, r), np.take(self.closes, r)


def _record_keys_ok(
    t: _Tokens, buf: np.ndarray, rows24: np.ndarray, which: list[int] | range, n_lines: int
) -> np.ndarray | None:
    """Token index of each line's vector object, if each non-blank line is one object whose
    ``"vector"`` key holds its only nested object, ``id``, ``_id`` and ``vector`` are not
    repeated and no key of the record has an escape; else ``None``."""
    vec = np.flatnonzero((t.cls == _OPEN) & (t.depth == 2))
    if vec.size != len(which) or vec.min(initial=1) < 1 or not np.array_equal(t.line(vec), np.asarray(which)):
        return None
    if not (np.take(t.cls, vec - 1) == _QUOTE).all():
        return None  # (a string just before an object is its key: the JSON is well-formed)
    strings = np.flatnonzero((t.cls == _QUOTE) & (t.depth == 1))
    lo, hi = t.span(strings)
    keys = _followed_by(buf, hi + 1, _COLON)  # a key is followed by ':', a value is not
    strings, lo, hi = np.compress(keys, strings), np.compress(keys, lo), np.compress(keys, hi)
    if t.backslashes.size and (np.searchsorted(t.backslashes, hi) > np.searchsorted(t.backslashes, lo)).any():
        return None
    size = hi - lo
    head = key_words(rows24, lo, np.minimum(size, 8))[:, 0]
    named = {name: (size == len(name)) & (head == code) for name, code in _NAMES.items()}
    for name in (b"id", b"_id"):
        if (np.bincount(t.line(np.compress(named[name], strings)), minlength=n_lines) > 1).any():
            return None
    is_vector = np.zeros(t.cls.size, bool)
    is_vector[np.compress(named[b"vector"], strings)] = True
    if int(named[b"vector"].sum()) != len(which) or not is_vector[vec - 1].all():
        return None
    return vec


def _followed_by(buf: np.ndarray, at: np.ndarray, byte: int) -> np.ndarray:
    """Whether the first byte from ``at`` on that is not whitespace is ``byte``."""
    first = np.take(buf, at)
    while (space := _space(first)).any():
        at = at + space
        first = np.take(buf, at)
    return first == byte


def _skip(buf: np.ndarray, at: np.ndarray, step: int, byte: int | None = None) -> np.ndarray:
    """``at`` moved by ``step`` past whitespace (reading ``buf[at]``, or ``buf[at - 1]`` going
    back), then past one ``byte`` where it is there and past whitespace again."""
    off = 0 if step > 0 else -1
    while (space := _space(np.take(buf, at + off))).any():
        at = at + step * space
    if byte is not None:
        at = at + step * (np.take(buf, at + off) == byte)
        at = _skip(buf, at, step)
    return at


def _term_ids(
    t: _Tokens, keys: np.ndarray, rows24: np.ndarray, data: bytes, table: KeyTable, lookup: Callable[[str], int | None]
) -> tuple[np.ndarray, int] | None:
    """Term ids of the key tokens (-1: not in the vocabulary) and the number of bytes above
    0x7F in the keys found in the table; ``None`` if a key is not UTF-8."""
    lo, hi = t.span(keys)
    size = hi - lo
    kw = key_words(rows24, lo, size)
    terms = table.find(kw)
    np.putmask(terms, size > KEY_BYTES, -1)
    # bytes above 0x7F in keys the table knows (valid UTF-8: they equal a token's spelling)
    high = (kw[:, 0] & HIGH) >> np.uint64(7)  # per byte: at most 3 once summed, no carry
    high += (kw[:, 1] & HIGH) >> np.uint64(7)
    high += (kw[:, 2] & HIGH) >> np.uint64(7)
    key_high = int(((high * ONES) >> np.uint64(56)).view(np.int64) @ (terms >= 0))
    missed: dict[bytes, int] = {}
    for i in np.flatnonzero(terms < 0).tolist():
        raw = data[int(lo[i]) - _PAD : int(hi[i]) - _PAD]
        if raw not in missed:
            tok = _unescape(raw)
            if tok is None:
                return None
            tid = lookup(tok)
            missed[raw] = -1 if tid is None else tid
        terms[i] = missed[raw]
    return terms, key_high


def _utf8_ok(t: _Tokens, buf: np.ndarray, data: bytes, lines: list[bytes], key_high: int) -> bool:
    """Whether the lines are UTF-8, as the strict path decodes each line. Bytes above 0x7F
    inside the vectors' keys were checked (equal to a spelling of a token, or decoded); if
    the chunk has others (``key_high`` counts those in keys), the lines holding them are decoded."""
    if data.isascii():
        return True
    high = buf >= 128
    if np.count_nonzero(high) == key_high:
        return True
    newline_pos = np.take(t.pos, t.newlines)
    for ln in np.unique(np.searchsorted(newline_pos, np.flatnonzero(high))).tolist():
        try:
            lines[ln].decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def columns_of_chunk(data: bytes, table: KeyTable, lookup: Callable[[str], int | None], unknown: str) -> Columns | None:
    """The records of ``data`` (whole JSONL lines), or ``None`` where the strict path must decide."""
    if _long_numbers(data):
        return None
    lines = data.split(b"\n")
    which = _non_blank(data, lines)
    raw_ids = _raw_ids(lines, which) if which else None
    if raw_ids is None:
        return None
    padded = b" " * _PAD + data + b" " * _PAD
    buf = np.frombuffer(padded, np.uint8)
    rows24 = rows_view(padded, 24)
    t = _Tokens(buf)
    # (each line is one well-formed object, so no string or object runs across a newline)
    if not t.ok or t.brackets or t.depth.max() > 2:
        return None
    vec = _record_keys_ok(t, buf, rows24, which, len(lines))
    if vec is None:
        return None
    # Inside the vectors (depth 2, no deeper) the strings are keys, each followed by
    # ': number' and ',' or the closing brace; a string weight would leave no number
    # between a key and the next token (itself).
    keys = np.flatnonzero((t.cls == _QUOTE) & (t.depth == 2))
    close_quotes = np.take(t.closes, np.take(t.rank, keys))
    nxt = np.take(t.pos, keys + 1)  # the next key's quote or the closing brace
    starts = _skip(buf, close_quotes + 1, 1, _COLON)
    ends = _skip(buf, nxt, -1, _COMMA)
    if not (ends > starts).all():
        return None
    first = np.take(buf, starts)
    neg = first == 45
    if not (neg | ((first - np.uint8(48)) < 10)).all():
        return None  # true, false, null
    values = parse_numbers(padded, starts, ends, neg)
    if values is None:
        return None
    # keys of each vector: the string tokens between its braces
    close = np.flatnonzero((t.cls == _CLOSE) & (t.depth == 1))
    if close.size != vec.size:
        return None
    lengths = (t.rank[close] - t.rank[vec]).astype(np.int64)
    found = _term_ids(t, keys, rows24, data, table, lookup)
    if found is None:
        return None
    terms, key_high = found
    if not _utf8_ok(t, buf, data, lines, key_high):
        return None
    skipped = 0
    if (terms < 0).any():
        if unknown == "error":
            return None  # the strict path names the token and its line
        keep = terms >= 0
        skipped = int(keep.size - np.count_nonzero(keep))
        rec = np.repeat(np.arange(len(which)), lengths)
        lengths = np.bincount(np.compress(keep, rec), minlength=len(which)).astype(np.int64)
        terms, values = np.compress(keep, terms), np.compress(keep, values)
    return Columns(raw_ids, len(lines) - 1, np.asarray(which, np.int64), lengths, terms, values, skipped)
