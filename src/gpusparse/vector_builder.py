"""The arrays a read of vector files grows (:class:`VectorBuilder`) and its counts (:class:`ReadStats`).

Every reader of :mod:`gpusparse.formats` and :mod:`gpusparse.vectors_binary` appends its
records here: ids with the file and line each came from (for errors that name them),
CSR arrays of int32 terms and float32 weights, and the first weight that failed each check,
reported once the whole read is done.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .collection import SparseCollection
from .errors import InputError
from .jsonl_chunks import WEIGHT_CHECKS
from .vocab import Vocabulary

__all__ = ["ReadStats", "VectorBuilder", "record_place"]


@dataclass
class ReadStats:
    """What a read saw, for reports: counts that would otherwise be silent."""

    files: list[str] = field(default_factory=list)
    records: int = 0
    empty_vectors: int = 0
    unknown_tokens_skipped: int = 0
    zero_weights_dropped: int = 0
    # JSONL chunks by the path that read them (native, columnar, orjson, strict): how a read went
    chunks_by_parser: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for the CLI."""
        parts = [f"{self.records:,} vectors from {len(self.files)} file(s)"]
        if self.empty_vectors:
            parts.append(f"{self.empty_vectors:,} empty")
        if self.unknown_tokens_skipped:
            parts.append(f"{self.unknown_tokens_skipped:,} unknown tokens skipped")
        if self.zero_weights_dropped:
            parts.append(f"{self.zero_weights_dropped:,} zero weights dropped")
        return ", ".join(parts)


class VectorBuilder:
    """Growing CSR arrays shared by all files of one read, with the source of every record."""

    def __init__(self) -> None:
        self.indptr = array("q", [0])
        self.terms = array("i")
        self.weights = array("f")  # float32: each chunk checked its float64 values first
        # The first weight failing each of WEIGHT_CHECKS, as (row, value): reported when the
        # whole read is done, as a check over all values would.
        self.bad_weights: list[tuple[int, float] | None] = [None] * len(WEIGHT_CHECKS)
        self.zero_weights = 0
        self.ids: list[str] = []
        self.seen: dict[str, int] = {}  # id -> row
        self.rec_file: list[str] = []
        self.rec_line = array("q")
        self.rec_binary = array("b")

    def add_id(self, doc_id: str, path: str, line: int, record: bool = False) -> None:
        row = self.seen.setdefault(doc_id, len(self.ids))
        if row != len(self.ids):
            where = record_place(self.rec_file[row], self.rec_line[row], bool(self.rec_binary[row]))
            raise InputError(
                f"duplicate id {doc_id!r} (first seen at {where})", path=path, line=line, field="id", record=record
            )
        self.ids.append(doc_id)
        self.rec_file.append(path)
        self.rec_line.append(line)
        self.rec_binary.append(record)

    def error(self, row: int, reason: str, field: str | None = "vector") -> InputError:
        """An error located at record ``row``."""
        return InputError(
            reason, path=self.rec_file[row], line=self.rec_line[row], field=field, record=bool(self.rec_binary[row])
        )

    def add_postings(
        self, first: int, terms: np.ndarray, weights: np.ndarray, bad_weights: Sequence[tuple[int, float] | None]
    ) -> None:
        """Append the postings (float32 ``weights``) of the records from row ``first`` on, and
        the first weights of theirs that failed :data:`WEIGHT_CHECKS` (``weight_problems``)."""
        for k, bad in enumerate(bad_weights):
            if bad is not None and self.bad_weights[k] is None:
                self.bad_weights[k] = (first + bad[0], bad[1])
        self.zero_weights += int(weights.size - np.count_nonzero(weights))
        self.terms.frombytes(memoryview(np.ascontiguousarray(terms, np.int32)).cast("B"))
        self.weights.frombytes(memoryview(np.ascontiguousarray(weights, np.float32)).cast("B"))

    def finish(self, vocab: Vocabulary, stats: ReadStats) -> SparseCollection:
        for what, bad in zip(WEIGHT_CHECKS, self.bad_weights, strict=True):
            if bad is not None:
                raise self.error(bad[0], f"weight {bad[1]!r} {what}")
        indptr = np.frombuffer(self.indptr, dtype=np.int64)
        terms = np.frombuffer(self.terms, dtype=np.int32) if len(self.terms) else np.zeros(0, np.int32)
        values32 = np.frombuffer(self.weights, dtype=np.float32) if len(self.weights) else np.zeros(0, np.float32)
        stats.zero_weights_dropped += self.zero_weights
        try:
            coll = SparseCollection(indptr, terms, values32, ids=self.ids, vocab=vocab, check_ids=False, copy=False)
        except InputError:
            # Summing a vector's duplicate terms overflowed: find the vector.
            rows = np.repeat(np.arange(len(self.ids), dtype=np.int64), np.diff(indptr))
            keys, inverse = np.unique(rows * len(vocab) + terms, return_inverse=True)
            sums = np.zeros(keys.size)
            np.add.at(sums, inverse, values32.astype(np.float64))
            row = int(keys[np.argmax(sums)] // len(vocab))
            raise self.error(row, "duplicate terms sum to a weight that overflows float32") from None
        stats.records += len(coll)
        stats.empty_vectors += int(np.count_nonzero(coll.row_lengths == 0))
        return coll


def record_place(path: str, line: int, record: bool) -> str:
    """Where a record is, as errors say it: ``file:line``, or ``file record N`` in a binary file."""
    return f"{path} record {line}" if record else f"{path}:{line}"
