"""Many JSON numbers parsed at once, exactly as Python's ``float()`` reads them.

The numbers of a chunk are spans of its bytes; each is read from the 16 bytes that end it,
as two little-endian 64-bit words, by SWAR steps (bytes of a word handled together by
integer arithmetic, as simdjson does), over all numbers at once in numpy. See
:func:`parse_numbers`.
"""

from __future__ import annotations

import numpy as np

MAX_EXACT = 2**53  # a mantissa up to this is exact in float64 (Clinger's fast path)
_P10 = 10 ** np.arange(18, dtype=np.uint64)
_P10F = _P10.astype(np.float64)  # exact (10**k is, for k <= 22)
# (1 << 8k) times these has 7 - k (15 - k) in its top byte: the digits after a dot at byte k
# of the low (high) word.
_AFTER_LO = np.uint64(0x0706050403020100)
_AFTER_HI = np.uint64(0x0F0E0D0C0B0A0908)
ONES = np.uint64(0x0101010101010101)
HIGH = np.uint64(0x8080808080808080)
_DOTS = np.uint64(0x2E2E2E2E2E2E2E2E)
_ZEROS = np.uint64(0x3030303030303030)
# _KEEP[k]: a mask of the top k bytes of a little-endian word (the last k characters).
_KEEP = np.array([0] + [((1 << (8 * k)) - 1) << (8 * (8 - k)) for k in range(1, 9)], np.uint64)


def rows_view(raw: bytes, width: int) -> np.ndarray:
    """``v[i]``: bytes ``i .. i + width - 1`` of ``raw`` (an unaligned view, no copy). Fancy
    indexing it gathers many spans in one call; ``.view("<u8")`` reads them as words."""
    return np.ndarray(shape=(len(raw) - width + 1,), dtype=f"V{width}", buffer=raw, strides=(1,))


def words_of(rows: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The rows of a :func:`rows_view` at ``at`` as ``(len(at), width // 8)`` little-endian words."""
    return rows[at].view("<u8").reshape(len(at), rows.dtype.itemsize // 8)


def _eight_digits(w: np.ndarray) -> np.ndarray:
    """The value of eight ASCII digits read as a little-endian 64-bit word (first digit most
    significant), for many words at once (the SWAR steps of simdjson's parser)."""
    w = ((w & np.uint64(0x0F0F0F0F0F0F0F0F)) * np.uint64(2561)) >> np.uint64(8)
    w = ((w & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(6553601)) >> np.uint64(16)
    w = ((w & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)
    return w & np.uint64(0xFFFFFFFF)


def _non_digits(w: np.ndarray) -> np.ndarray:
    """The high bit of each byte of ``w`` (ASCII) that is not a digit."""
    at_least_0 = w + (ONES * np.uint64(0x80 - 0x30))  # no carry: every byte is below 0x80
    above_9 = w + (ONES * np.uint64(0x80 - 0x3A))
    return ~(at_least_0 & ~above_9) & HIGH


def parse_numbers(padded: bytes, starts: np.ndarray, ends: np.ndarray, neg: np.ndarray) -> np.ndarray | None:
    """float64 values of the JSON numbers at ``padded[starts:ends]`` (``padded``: bytes with
    at least 24 more before and after the numbers; ``neg``: the numbers that start with
    ``-``) as Python reads them: ``float(text)``, with an integer's ``-0`` read as ``0.0``
    (``json`` reads integers as ``int``); ``None`` if one is not finite.

    Numbers of at most 16 characters with at most a sign and a decimal point besides
    digits, and a mantissa up to 2**53, are read from the 16 bytes ending at the number:
    its digits as an integer ``X`` (the point read as a 0, bytes before the number as 0s),
    the mantissa ``m = X - 9 * (X // 10**(F+1)) * 10**F`` with ``F`` fraction digits, then
    ``m / 10**F``: both exact in float64, so one correctly rounded division, which is
    what ``float()`` gives. The others (exponents, 17 significant digits as ``json.dumps``
    writes float64 values) are gathered into a fixed-width bytes array and converted by
    numpy's string-to-float cast, correctly rounded like ``float()``; longer than 24
    characters, one by one by ``float()``.
    """
    length = ends - starts
    keep_hi = np.take(_KEEP, np.clip(length - 8, 0, 8))  # the number's bytes among characters -16 .. -9
    keep_lo = np.take(_KEEP, np.minimum(length, 8))  # and among the last 8
    both = words_of(rows_view(padded, 16), ends - 16)
    hi = (both[:, 0] & keep_hi) | (_ZEROS & ~keep_hi)
    lo = (both[:, 1] & keep_lo) | (_ZEROS & ~keep_lo)
    nd_hi, nd_lo = _non_digits(hi), _non_digits(lo)
    dot_hi, dot_lo = _zero_bytes(hi ^ _DOTS), _zero_bytes(lo ^ _DOTS)  # at most one '.'
    has_dot = (dot_hi | dot_lo) != 0
    n_odd = count_high(nd_hi) + count_high(nd_lo)
    simple = (length <= 16) & (n_odd == neg.view(np.uint8) + has_dot.view(np.uint8))
    # fraction digits: those after the dot, read off its single high bit by a multiply
    frac = ((dot_lo >> np.uint64(7)) * _AFTER_LO + (dot_hi >> np.uint64(7)) * _AFTER_HI) >> np.uint64(56)
    frac = frac.view(np.int64)
    hi ^= (hi ^ _ZEROS) & _spread(nd_hi)  # the sign and the dot read as 0
    lo ^= (lo ^ _ZEROS) & _spread(nd_lo)
    x = _eight_digits(hi) * np.uint64(10**8) + _eight_digits(lo)
    p = np.take(_P10, frac, mode="clip")
    mant = x - np.uint64(9) * (x // (p * np.uint64(10))) * p * has_dot  # (no dot: p = 1, nothing taken)
    fast = simple & (mant <= MAX_EXACT)
    values = mant.astype(np.float64) / np.take(_P10F, frac, mode="clip")
    np.negative(values, out=values, where=neg)
    np.add(values, 0.0, out=values, where=~has_dot)  # -0 as an integer is 0
    slow = np.flatnonzero(~fast)
    if slow.size:
        values[slow] = _parse_slow(padded, np.take(starts, slow), np.take(length, slow))
    if not np.isfinite(values).all():
        return None
    return values


def _parse_slow(padded: bytes, starts: np.ndarray, length: np.ndarray) -> np.ndarray:
    """:func:`parse_numbers` for the numbers its integer arithmetic leaves."""
    out = np.empty(starts.size)
    short = np.flatnonzero(length <= 24)
    rows = rows_view(padded, 24)[np.take(starts, short)].view(np.uint8).reshape(short.size, 24)
    rows = np.where(np.arange(24) < np.take(length, short)[:, None], rows, np.uint8(0))  # NUL: padding of "S24"
    with np.errstate(over="ignore", invalid="ignore"):
        got = rows.view("S24").reshape(-1).astype(np.float64)
    integer = ~((rows == 46) | (rows == 101) | (rows == 69)).any(axis=1)  # no '.', 'e', 'E'
    np.add(got, 0.0, out=got, where=integer)
    out[short] = got
    for i in np.flatnonzero(length > 24).tolist():
        text = padded[int(starts[i]) : int(starts[i]) + int(length[i])]
        v = float(text)
        out[i] = v if b"." in text or b"e" in text or b"E" in text else v + 0.0
    return out


def count_high(bits: np.ndarray) -> np.ndarray:
    """How many bytes of each word have their high bit set, given only high bits (the bytes'
    0/1 summed into the top byte by one multiply)."""
    return ((bits >> np.uint64(7)) * ONES) >> np.uint64(56)


def _zero_bytes(x: np.ndarray) -> np.ndarray:
    """The high bit of each zero byte of ``x`` (exact for the lowest; here bytes are never 1)."""
    return (x - ONES) & ~x & HIGH


def _spread(high_bits: np.ndarray) -> np.ndarray:
    """Each byte's high bit spread to the whole byte."""
    return (high_bits >> np.uint64(7)) * np.uint64(0xFF)
