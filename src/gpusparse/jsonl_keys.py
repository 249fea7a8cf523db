"""The vocabulary's tokens as they are spelled in JSON, found for many keys at once.

:class:`KeyTable` holds each token's spellings inside a JSON string (up to 24 bytes) in an
open-addressing hash table of numpy arrays; :func:`key_words` reads a chunk's keys as
three 64-bit words each, and :meth:`KeyTable.find` looks them all up in a few numpy calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from .jsonl_numbers import words_of

KEY_BYTES = 24  # spellings up to this many bytes are in the table; longer ones are looked up one by one
# _MASKS[k]: the first k bytes of a 24-byte key as three words.
_MASKS = np.array(
    [[(1 << (8 * max(0, min(8, k - 8 * j)))) - 1 for j in range(3)] for k in range(KEY_BYTES + 1)], np.uint64
)


def key_words(rows24: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The first 24 bytes of each key (``rows24``: a ``rows_view(..., 24)``) as three words,
    the bytes past its end zeroed: ``(n, 3)``."""
    return words_of(rows24, starts) & np.take(_MASKS, np.minimum(sizes, KEY_BYTES), axis=0)


def _hash(words: np.ndarray, bits: int) -> np.ndarray:
    """Slots of ``bits`` bits for keys of three little-endian 64-bit words (``(n, 3)``)."""
    h = words[:, 0] * np.uint64(0x9E3779B97F4A7C15) + words[:, 1] * np.uint64(0xC2B2AE3D27D4EB4F)
    h += words[:, 2] * np.uint64(0x165667B19E3779F9)
    return (h >> np.uint64(64 - bits)).astype(np.intp)


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
                    parts.append(b"\xff" * (KEY_BYTES + 1))  # never matched: looked up one by one
        else:
            parts = raw.split(b'", "')
        n = len(parts)
        first = dict(zip(reversed(parts), range(n - 1, -1, -1), strict=True))  # the first of repeated tokens
        out.update((k, v) for k, v in first.items() if len(k) <= KEY_BYTES and k not in out)
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
        kw = np.frombuffer(np.array(list(seen) or [b""], dtype=f"S{KEY_BYTES}").tobytes(), "<u8").reshape(-1, 3)
        kw = kw[: len(seen)]
        ids = np.fromiter(seen.values(), np.int32, len(seen))
        # Four arrays of slots: the key's three words and its term id + 1 (0: empty).
        self.w0, self.w1, self.w2 = (np.zeros(size, np.uint64) for _ in range(3))
        self.tid = np.zeros(size, np.int64)
        # Linear probing, built in rounds: in round r every key not yet placed tries slot
        # home + r; the first key of each free slot takes it. A key sits after all slots from
        # its home on were taken, so a look-up may stop at the first empty slot.
        home = _hash(kw, self.bits)
        todo = np.arange(len(ids))
        self.probes = 0
        while todo.size:
            slot = (home[todo] + self.probes) & (size - 1)
            first = np.zeros(todo.size, bool)
            first[np.unique(slot, return_index=True)[1]] = True
            take = (self.tid[slot] == 0) & first
            for j, table in enumerate((self.w0, self.w1, self.w2)):
                table[slot[take]] = kw[todo[take], j]
            self.tid[slot[take]] = ids[todo[take]].astype(np.int64) + 1
            todo = todo[~take]
            self.probes += 1

    def find(self, words: np.ndarray) -> np.ndarray:
        """Term ids of keys given as three words each (:func:`key_words`); -1 where the
        table has no such spelling."""
        mask = (1 << self.bits) - 1
        slot = _hash(words, self.bits)
        w = [np.ascontiguousarray(words[:, j]) for j in range(3)]
        out = np.full(len(words), -1, np.int32)
        todo = np.arange(len(words))
        for r in range(self.probes):  # (np.take and np.compress: much faster than [] here)
            s = slot if r == 0 else (np.take(slot, todo) + r) & mask
            tid = np.take(self.tid, s)
            hit = tid != 0
            for table, col in zip((self.w0, self.w1, self.w2), w, strict=True):
                hit &= np.take(table, s) == (col if r == 0 else np.take(col, todo))
            out[np.compress(hit, todo)] = np.compress(hit, tid) - 1
            todo = np.compress(~hit & (tid != 0), todo)  # an empty slot ends the search
            if not todo.size:
                break
        return out
