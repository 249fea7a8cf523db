"""Binary vector files read into a :class:`~gpusparse.vector_builder.VectorBuilder`: Seismic's
``.bin`` (u32 count, then per vector u32 length, int32 term ids, float32 weights; records get
ids ``"0"``, ``"1"``, ... in file order) and GPUSparse's ``.npz`` (:mod:`gpusparse.vectors_npz`).
Both are memory-mapped or read whole, never parsed record by record in Python beyond their
lengths; errors name the file and the record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from tqdm.auto import tqdm

from .collection import check_id
from .errors import InputError
from .jsonl_chunks import weight_problems
from .vector_builder import ReadStats, VectorBuilder
from .vectors_npz import read_npz
from .vocab import Vocabulary

Unknown = Literal["error", "skip"]
__all__ = ["read_npz_into", "read_seismic_bin_into"]


# -- Seismic binary -----------------------------------------------------------------------


def read_seismic_bin_into(path: Path, b: VectorBuilder, vocab: Vocabulary, progress: bool) -> None:
    spath = str(path)
    if path.name.endswith(".gz"):
        raise InputError("compressed Seismic binary files are not supported; gunzip it first", path=spath)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    except OSError as exc:
        raise InputError(f"cannot open: {exc.strerror}", path=spath) from None
    if data.size < 4:
        raise InputError("too short for a Seismic binary file (no vector count)", path=spath)
    words = data[: data.size // 4 * 4].view("<u4")
    n = int(words[0])
    n_words = words.size
    if n > n_words - 1:  # every record takes at least one word: refuse before allocating
        raise InputError(
            f"the header announces {n:,} records but the file holds at most {n_words - 1:,} "
            "(truncated or not Seismic?)",
            path=spath,
            field="count",
        )
    lengths = np.empty(n, dtype=np.int64)
    starts = np.empty(n, dtype=np.int64)
    pos = 1  # in 4-byte words
    for rec in tqdm(range(n), desc=path.name, unit="vec", disable=not progress or None, leave=False):
        if pos >= n_words:
            raise InputError(
                f"file ends inside record {rec + 1} of {n} (truncated?)", path=spath, line=rec + 1, record=True
            )
        ln = int(words[pos])
        if pos + 1 + 2 * ln > n_words:
            raise InputError(
                f"record {rec + 1} of {n} claims {ln} entries past the end of the file (truncated?)",
                path=spath,
                line=rec + 1,
                record=True,
            )
        lengths[rec], starts[rec] = ln, pos + 1
        pos += 1 + 2 * ln
    if pos * 4 != data.size:
        raise InputError(f"{data.size - pos * 4} bytes after the last of {n} records", path=spath)
    first = len(b.ids)
    for rec in range(n):
        b.add_id(str(first + rec), spath, rec + 1, record=True)
    nnz = int(lengths.sum())
    if nnz:
        local = np.arange(nnz, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tpos = np.repeat(starts, lengths) + local
        term_ids = words[tpos].view("<i4").astype(np.int64)
        weights = words[tpos + np.repeat(lengths, lengths)].view("<f4")
        bad = (term_ids < 0) | (term_ids >= len(vocab))
        if bad.any():
            i = int(np.argmax(bad))
            rec = int(np.searchsorted(np.cumsum(lengths), i, side="right"))
            raise InputError(
                f"term id {term_ids[i]} is outside the vocabulary of {len(vocab)} terms",
                path=spath,
                line=rec + 1,
                field="components",
                record=True,
            )
    base = b.indptr[-1]
    b.indptr.frombytes((base + np.cumsum(lengths)).astype(np.int64).tobytes())
    if nnz:
        b.add_postings(first, term_ids, weights, weight_problems(weights.astype(np.float64), lengths))


# -- GPUSparse .npz -------------------------------------------------------------------------


def read_npz_into(path: Path, b: VectorBuilder, vocab: Vocabulary, unknown: Unknown, stats: ReadStats) -> None:
    spath = str(path)
    f = read_npz(path)
    first = len(b.ids)
    for rec, doc_id in enumerate(f.ids):
        check_id(doc_id, path=spath, line=rec + 1, record=True)
    if len(set(f.ids)) == len(f.ids) and b.seen.keys().isdisjoint(f.ids):
        b.seen.update(zip(f.ids, range(first, first + len(f.ids)), strict=True))
        b.ids.extend(f.ids)
        b.rec_file.extend([spath] * len(f.ids))
        b.rec_line.frombytes(np.arange(1, len(f.ids) + 1, dtype=np.int64).tobytes())
        b.rec_binary.frombytes(bytes([1]) * len(f.ids))
    else:  # a repeated id: one by one, for the error
        for rec, doc_id in enumerate(f.ids):
            b.add_id(doc_id, spath, rec + 1, record=True)
    terms, weights, lengths, skipped = f.in_vocabulary(vocab, unknown)
    stats.unknown_tokens_skipped += skipped
    w64 = np.asarray(weights, dtype=np.float64)
    b.add_postings(first, terms, w64.astype(np.float32), weight_problems(w64, lengths))
    b.indptr.frombytes((b.indptr[-1] + np.cumsum(lengths)).astype(np.int64).tobytes())
