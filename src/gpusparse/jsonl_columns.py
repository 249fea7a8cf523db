"""JSONL vectors read a chunk at a time without a Python object per posting.

:func:`columns_of_chunk` reads the bytes of whole lines of JsonVectorCollection JSONL
(``{"id": ..., "contents": ..., "vector": {token: weight, ...}}``) with numpy over the
whole chunk: one pass finds the bytes that matter to JSON's structure (quotes, backslashes,
``:``, ``,``, braces, brackets, newlines), escapes and strings are resolved on those
positions only, and what is left is each line's object: its keys, the vector object, and
in it each token (a span of bytes) and each weight (a span of bytes). Tokens become term
ids through a hash table of the vocabulary's spellings (:class:`KeyTable`, looked up for
all tokens of the chunk at once); weights are parsed by an exact decimal parser on
16-byte windows (:func:`parse_numbers`). msgspec checks that each line is well-formed JSON
(and decodes its id) without building the vector.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

_PAD = 32  # bytes of padding each side of a chunk, so 32-byte windows never leave it
_KEY_BYTES = 24  # spellings up to this many bytes are in the table; longer ones are looked up one by one
_MAX_EXACT = 2**53  # a mantissa up to this is exact in float64 (Clinger's fast path)

# The bytes of the structural scan.
_QUOTE, _BACKSLASH, _COLON, _COMMA, _OPEN, _CLOSE, _NEWLINE = b'"\\:,{}\n'
_SPECIALS = b'"\\{}[]\n'  # not ':' and ',': found from the strings around them
_P10 = 10 ** np.arange(18, dtype=np.uint64)
_P10F = _P10.astype(np.float64)  # exact (10**k is, for k <= 22)
# (1 << 8k) times these has 7 - k (15 - k) in its top byte: the digits after a dot at byte k
# of the low (high) word.
_AFTER_LO = np.uint64(0x0706050403020100)
_AFTER_HI = np.uint64(0x0F0E0D0C0B0A0908)


_ONES = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)
_DOTS = np.uint64(0x2E2E2E2E2E2E2E2E)
_ZEROS = np.uint64(0x3030303030303030)
# _KEEP[k]: a mask of the top k bytes of a little-endian word (the last k characters).
_KEEP = np.array([0] + [((1 << (8 * k)) - 1) << (8 * (8 - k)) for k in range(1, 9)], np.uint64)
# _LOW[k]: a mask of the low k bytes (the first k characters).
_LOW = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [2**64 - 1], np.uint64)


def _word_view(raw: bytes) -> np.ndarray:
    """``w[i]``: bytes ``i .. i + 7`` of ``raw`` as a little-endian 64-bit word (an unaligned view)."""
    return np.ndarray(shape=(len(raw) - 7,), dtype="<u8", buffer=raw, strides=(1,))


def _hash(w0: np.ndarray, w1: np.ndarray, w2: np.ndarray, bits: int) -> np.ndarray:
    """Slots of ``bits`` bits for keys of three little-endian 64-bit words."""
    h = w0 * np.uint64(0x9E3779B97F4A7C15) + w1 * np.uint64(0xC2B2AE3D27D4EB4F) + w2 * np.uint64(0x165667B19E3779F9)
    return (h >> np.uint64(64 - bits)).astype(np.intp)


def _key_words(words: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, ...]:
    """The first 24 bytes of each key as three words, bytes past its end zeroed."""
    out = []
    for j in range(3):
        k = np.clip(sizes - 8 * j, 0, 8)
        out.append(words[starts + 8 * j] & np.take(_LOW, k))
    return tuple(out)


def _spellings(tokens: Sequence[str]) -> dict[bytes, int]:
    """Each token's spellings inside a JSON string (at most 24 bytes) -> its first term id.

    The vocabulary is written as one JSON array by ``json.dumps`` twice (with and without
    ``\\uXXXX`` escapes, the encoder in C) and split at the separators, which cannot occur
    inside a string (a quote there is escaped).
    """
    out: dict[bytes, int] = {}
    for ascii_only in (False, True):
        text = json.dumps(list(tokens), ensure_ascii=ascii_only)
        try:
            raw = text[2:-2].encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: tokens one by one
            raw = None
        if raw is None or not tokens:
            parts = []
            for tok in tokens:
                try:
                    parts.append(json.dumps(tok, ensure_ascii=ascii_only)[1:-1].encode("utf-8"))
                except UnicodeEncodeError:
                    parts.append(b"\xff" * (_KEY_BYTES + 1))  # never matched: looked up one by one
        else:
            parts = raw.split(b'", "')
        n = len(parts)
        first = dict(zip(reversed(parts), range(n - 1, -1, -1), strict=True))  # the first of repeated tokens
        out.update((k, v) for k, v in first.items() if len(k) <= _KEY_BYTES and k not in out)
    return out


class KeyTable:
    """The vocabulary's tokens as they are spelled inside JSON strings, in an open-addressing
    hash table of keys up to 24 bytes, looked up for many keys at once.

    Each token has up to two spellings (UTF-8, as ``json.dumps(ensure_ascii=False)`` and
    orjson write it, and with ``\\uXXXX`` escapes as ``json.dumps`` writes it); a token
    repeated in the vocabulary keeps its first term id, as :class:`~gpusparse.vocab.Vocabulary`
    does. Other spellings (``\\/``, other escapes) are not in the table: the caller looks
    them up one by one.
    """

    def __init__(self, tokens: Sequence[str]) -> None:
        seen = _spellings(tokens)
        self.bits = max(8, int(np.ceil(np.log2(max(len(seen), 1) * 4))))
        size = 1 << self.bits
        packed = np.array(list(seen) or [b""], dtype=f"S{_KEY_BYTES}").tobytes() + bytes(8)
        kw = _key_words(_word_view(packed), np.arange(len(seen)) * _KEY_BYTES, np.full(len(seen), _KEY_BYTES))
        ids = np.fromiter(seen.values(), np.int32, len(seen))
        # A slot: the key's three words and its term id + 1 (0: empty), one cache line a look-up.
        self.slots = np.zeros((size, 4), np.uint64)
        # Linear probing, built in rounds: in round r every key not yet placed tries slot
        # home + r; the first key of each free slot takes it. A key sits after all slots from
        # its home on were taken, so a look-up may stop at the first empty slot.
        home = _hash(*kw, self.bits)
        todo = np.arange(len(ids))
        self.probes = 0
        while todo.size:
            slot = (home[todo] + self.probes) & (size - 1)
            first = np.zeros(todo.size, bool)
            first[np.unique(slot, return_index=True)[1]] = True
            take = (self.slots[slot, 3] == 0) & first
            for j in range(3):
                self.slots[slot[take], j] = kw[j][todo[take]]
            self.slots[slot[take], 3] = ids[todo[take]].astype(np.uint64) + np.uint64(1)
            todo = todo[~take]
            self.probes += 1

    def find(self, w0: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
        """Term ids of keys given as three words each (zero past the key's end); -1 where the
        table has no such spelling."""
        mask = (1 << self.bits) - 1
        slot = _hash(w0, w1, w2, self.bits)
        out = np.full(len(w0), -1, np.int32)
        todo = np.arange(len(w0))
        for r in range(self.probes):
            s = np.take(self.slots, slot if r == 0 else (np.take(slot, todo) + r) & mask, axis=0)
            a, b, c = (w0, w1, w2) if r == 0 else (np.take(w0, todo), np.take(w1, todo), np.take(w2, todo))
            full = s[:, 3] != 0
            hit = (s[:, 0] == a) & (s[:, 1] == b) & (s[:, 2] == c) & full
            out[np.compress(hit, todo)] = (np.compress(hit, s[:, 3]) - np.uint64(1)).astype(np.int32)
            todo = np.compress(~hit & full, todo)  # an empty slot ends the search
            if not todo.size:
                break
        return out


def _eight_digits(w: np.ndarray) -> np.ndarray:
    """The value of eight ASCII digits read as a little-endian 64-bit word (first digit most
    significant), for many words at once (the SWAR steps of simdjson's parser)."""
    w = ((w & np.uint64(0x0F0F0F0F0F0F0F0F)) * np.uint64(2561)) >> np.uint64(8)
    w = ((w & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(6553601)) >> np.uint64(16)
    w = ((w & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)
    return w & np.uint64(0xFFFFFFFF)


def _non_digits(w: np.ndarray) -> np.ndarray:
    """The high bit of each byte of ``w`` (ASCII) that is not a digit."""
    at_least_0 = w + (_ONES * np.uint64(0x80 - 0x30))  # no carry: every byte is below 0x80
    above_9 = w + (_ONES * np.uint64(0x80 - 0x3A))
    return ~(at_least_0 & ~above_9) & _HIGH


def parse_numbers(
    words: np.ndarray, data: bytes, starts: np.ndarray, ends: np.ndarray, neg: np.ndarray
) -> np.ndarray | None:
    """float64 values of the JSON numbers at ``data[starts:ends]`` (positions shifted by the
    padding of ``words``, :func:`_word_view` of the padded chunk; ``neg``: those starting
    with ``-``) as Python reads them: ``float(text)``, with an integer's ``-0`` read as
    ``0.0`` (``json`` reads integers as ``int``); ``None`` if one is not finite.

    Numbers of at most 16 characters with at most a sign and a decimal point besides
    digits, and a mantissa up to 2**53, are read from the 16 bytes ending at the number:
    its digits as an integer ``X`` (the point read as a 0, bytes before the number as 0s),
    the mantissa ``m = X - 9 * (X // 10**(F+1)) * 10**F`` with ``F`` fraction digits, then
    ``m / 10**F``: both exact in float64, so one correctly rounded division, which is
    what ``float()`` gives. Others (exponents, longer mantissas) go through ``float()`` one
    by one.
    """
    length = ends - starts
    keep_hi = np.take(_KEEP, np.clip(length - 8, 0, 8))  # the number's bytes among characters -16 .. -9
    keep_lo = np.take(_KEEP, np.minimum(length, 8))  # and among the last 8
    hi = (words[ends - 16] & keep_hi) | (_ZEROS & ~keep_hi)
    lo = (words[ends - 8] & keep_lo) | (_ZEROS & ~keep_lo)
    nd_hi, nd_lo = _non_digits(hi), _non_digits(lo)
    dot_hi, dot_lo = _zero_bytes(hi ^ _DOTS), _zero_bytes(lo ^ _DOTS)  # at most one '.'
    has_dot = (dot_hi | dot_lo) != 0
    n_odd = _count_high(nd_hi) + _count_high(nd_lo)
    simple = (length <= 16) & (n_odd == neg.view(np.uint8) + has_dot.view(np.uint8))
    # fraction digits: those after the dot, read off its single high bit by a multiply
    frac = ((dot_lo >> np.uint64(7)) * _AFTER_LO + (dot_hi >> np.uint64(7)) * _AFTER_HI) >> np.uint64(56)
    frac = frac.view(np.int64)
    hi ^= (hi ^ _ZEROS) & _spread(nd_hi)  # the sign and the dot read as 0
    lo ^= (lo ^ _ZEROS) & _spread(nd_lo)
    x = _eight_digits(hi) * np.uint64(10**8) + _eight_digits(lo)
    p = np.take(_P10, frac, mode="clip")
    mant = x - np.uint64(9) * (x // (p * np.uint64(10))) * p * has_dot  # (no dot: p = 1, nothing taken)
    fast = simple & (mant <= _MAX_EXACT)
    values = mant.astype(np.float64) / np.take(_P10F, frac, mode="clip")
    np.negative(values, out=values, where=neg)
    np.add(values, 0.0, out=values, where=~has_dot)  # -0 as an integer is 0
    for i in np.flatnonzero(~fast).tolist():
        text = data[int(starts[i]) - _PAD : int(ends[i]) - _PAD]
        v = float(text)
        if not (b"." in text or b"e" in text or b"E" in text):
            v += 0.0
        values[i] = v
    if not np.isfinite(values).all():
        return None
    return values


def _count_high(bits: np.ndarray) -> np.ndarray:
    """How many bytes of each word have their high bit set, given only high bits (the bytes'
    0/1 summed into the top byte by one multiply)."""
    return ((bits >> np.uint64(7)) * _ONES) >> np.uint64(56)


def _space(b: np.ndarray) -> np.ndarray:
    """Whether each byte is JSON whitespace (newlines aside: lines are split at them)."""
    return (b == 32) | (b == 9) | (b == 13)


def _zero_bytes(x: np.ndarray) -> np.ndarray:
    """The high bit of each zero byte of ``x`` (exact for the lowest; here bytes are never 1)."""
    return (x - _ONES) & ~x & _HIGH


def _spread(high_bits: np.ndarray) -> np.ndarray:
    """Each byte's high bit spread to the whole byte."""
    return (high_bits >> np.uint64(7)) * np.uint64(0xFF)


@dataclass
class Columns:
    """Records of a chunk read by :func:`columns_of_chunk`: ids are decoded by the caller
    (``raw_ids``: msgspec's values of ``id``/``_id``), weights are float64."""

    raw_ids: list[object]
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


def _raw_ids(lines: list[bytes], which: list[int]) -> list[object] | None:
    """The id of each line as ``obj.get("id", obj.get("_id"))`` reads it, msgspec having
    checked that each line is a well-formed JSON object; ``None`` if one is not."""
    try:
        recs = [_DECODE(lines[i]) for i in which]
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    return [r.id if r.id is not _UNSET else None if r.alt_id is _UNSET else r.alt_id for r in recs]


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
        special = buf == _SPECIALS[0]  # comparisons: a table look-up would widen each byte to an index
        for byte in _SPECIALS[1:]:
            special |= buf == byte
        # (np.take and np.compress: many times faster than fancy and boolean indexing here)
        pos = np.flatnonzero(special)
        c = np.take(buf, pos)
        backslash = c == _BACKSLASH
        self.backslashes = np.compress(backslash, pos)
        if self.backslashes.size:  # drop backslashes and the quotes they escape
            b = self.backslashes
            idx = np.arange(b.size)
            run = np.ones(b.size, bool)
            run[1:] = b[1:] != b[:-1] + 1
            escaped = b[(idx - np.maximum.accumulate(np.where(run, idx, 0))) % 2 == 0] + 1
            quotes = np.flatnonzero(c == _QUOTE)
            j = np.minimum(np.searchsorted(escaped, pos[quotes]), escaped.size - 1)
            keep = ~backslash
            keep[quotes[escaped[j] == pos[quotes]]] = False
            pos, c = np.compress(keep, pos), np.compress(keep, c)
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
    t: _Tokens, buf: np.ndarray, words: np.ndarray, which: list[int], n_lines: int
) -> np.ndarray | None:
    """Token index of each line's vector object, if each non-blank line is one object whose
    ``"vector"`` key holds its only nested object, ``id``, ``_id`` and ``vector`` are not
    repeated and no key of the record has an escape; else ``None``."""
    vec = np.flatnonzero((t.cls == _OPEN) & (t.depth == 2))
    if vec.size != len(which) or vec.min(initial=1) < 1 or not np.array_equal(t.line(vec), which):
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
    head = words[lo] & np.take(_LOW, np.minimum(size, 8))
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
    t: _Tokens, keys: np.ndarray, words: np.ndarray, data: bytes, table: KeyTable, lookup: Callable[[str], int | None]
) -> tuple[np.ndarray, int] | None:
    """Term ids of the key tokens (-1: not in the vocabulary) and the number of bytes above
    0x7F in the keys found in the table; ``None`` if a key is not UTF-8."""
    lo, hi = t.span(keys)
    size = hi - lo
    kw = _key_words(words, lo, size)
    terms = table.find(*kw)
    terms[size > _KEY_BYTES] = -1
    # bytes above 0x7F in keys the table knows (valid UTF-8: they equal a token's spelling)
    high = ((kw[0] & _HIGH) >> np.uint64(7)) + ((kw[1] & _HIGH) >> np.uint64(7)) + ((kw[2] & _HIGH) >> np.uint64(7))
    key_high = int(((high * _ONES) >> np.uint64(56)).view(np.int64) @ (terms >= 0))
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
    lines = data.split(b"\n")
    which = [i for i, ln in enumerate(lines) if ln and not ln.isspace()]
    raw_ids = _raw_ids(lines, which) if which else None
    if raw_ids is None:
        return None
    padded = b" " * _PAD + data + b" " * _PAD
    buf = np.frombuffer(padded, np.uint8)
    words = _word_view(padded)
    t = _Tokens(buf)
    if not t.ok or t.brackets or t.depth.max() > 2 or t.newlines.size != len(lines) - 1:
        return None
    if (t.depth[t.newlines] != 0).any():
        return None  # an object across lines
    vec = _record_keys_ok(t, buf, words, which, len(lines))
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
    values = parse_numbers(words, data, starts, ends, neg)
    if values is None:
        return None
    # keys of each vector: the string tokens between its braces
    close = np.flatnonzero((t.cls == _CLOSE) & (t.depth == 1))
    if close.size != vec.size:
        return None
    lengths = (t.rank[close] - t.rank[vec]).astype(np.int64)
    found = _term_ids(t, keys, words, data, table, lookup)
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
    return Columns(raw_ids, np.array(which, np.int64), lengths, terms, values, skipped)
