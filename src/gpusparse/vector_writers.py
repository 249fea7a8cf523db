"""Writers of sparse vectors: Pyserini JsonVectorCollection JSONL (``.gz`` compressed when the
name says so), Seismic's binary format and GPUSparse's ``.npz`` (:func:`write_vectors` picks
by the file name); :mod:`gpusparse.formats` reads all three back."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Literal

import numpy as np

from .collection import SparseCollection
from .vectors_npz import write_npz

VECTOR_FORMATS = ("jsonl", "npz", "bin")  # what write_vectors writes, by file suffix


def write_jsonl(
    collection: SparseCollection,
    path: str | Path,
    *,
    flavor: Literal["anserini", "seismic"] = "anserini",
    contents: Sequence[str] | None = None,
    decimals: int | None = None,
) -> None:
    """Write a collection as JsonVectorCollection JSONL (``.gz`` compresses).

    ``flavor="seismic"`` names the text field ``content`` instead of ``contents``.
    Weights are written as the exact decimal of their float32 value, so reading back
    gives identical arrays; ``decimals=n`` rounds them to ``n`` places instead (smaller
    files) and leaves out weights that round to zero. Gzipped output has no timestamp,
    so equal collections give equal bytes.
    """
    if decimals is not None and decimals < 0:
        raise ValueError("decimals must be non-negative")
    path = Path(path)
    text_field = "contents" if flavor == "anserini" else "content"
    tokens = collection.vocab.tokens()
    with _open_text_writer(path) as f:
        for i, doc_id in enumerate(collection.ids):
            a, b = int(collection.indptr[i]), int(collection.indptr[i + 1])
            pairs = zip(collection.indices[a:b].tolist(), collection.values[a:b].tolist(), strict=True)
            if decimals is None:
                vec = {tokens[t]: w for t, w in pairs}
            else:
                vec = {tokens[t]: r for t, w in pairs if (r := round(w, decimals)) != 0}
            rec = {"id": doc_id, text_field: "" if contents is None else contents[i], "vector": vec}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


@contextmanager
def _open_text_writer(path: Path) -> Iterator[IO[str]]:
    """A UTF-8 text file, gzipped (without a timestamp) when ``path`` ends in ``.gz``."""
    if not path.name.endswith(".gz"):
        with path.open("w", encoding="utf-8") as f:
            yield f
        return
    with (
        path.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
        io.TextIOWrapper(gz, encoding="utf-8") as f,
    ):
        yield f


def write_seismic_bin(collection: SparseCollection, path: str | Path, *, chunk_postings: int = 1 << 24) -> None:
    """Write a collection in Seismic's binary format (ids are not stored: record order is).

    Little-endian: u32 number of vectors, then per vector a u32 length, the term ids (u32,
    ascending) and the weights (f32), as Seismic's ``convert_json_to_inner_format.py`` writes
    them. Written ``chunk_postings`` postings at a time, without a loop over vectors.
    """
    indptr = collection.indptr.astype(np.int64, copy=False)
    n = len(collection)
    with Path(path).open("wb") as f:
        f.write(np.array([n], dtype="<u4").tobytes())
        r0 = 0
        while r0 < n:
            r1 = max(r0 + 1, int(np.searchsorted(indptr, indptr[r0] + chunk_postings, side="right")) - 1)
            r1 = min(r1, n)
            f.write(_seismic_records(indptr[r0 : r1 + 1], collection.indices, collection.values))
            r0 = r1


def _seismic_records(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray) -> bytes:
    """The records of rows ``indptr[:-1]`` as bytes: per row its length, term ids, weights."""
    lengths = np.diff(indptr)
    rows = lengths.size
    base = indptr[0]
    words = np.empty(rows + 2 * int(lengths.sum()), dtype="<u4")
    # Row i starts at word i + 2·(indptr[i] - base): one length word and two words per posting before it.
    starts = np.arange(rows, dtype=np.int64) + 2 * (indptr[:-1] - base)
    words[starts] = lengths
    local = np.arange(indptr[-1] - base, dtype=np.int64) - np.repeat(indptr[:-1] - base, lengths)
    term_pos = np.repeat(starts + 1, lengths) + local
    words[term_pos] = indices[indptr[0] : indptr[-1]].astype("<u4")
    words[term_pos + np.repeat(lengths, lengths)] = values[indptr[0] : indptr[-1]].astype("<f4").view("<u4")
    return words.tobytes()


def write_vectors(
    collection: SparseCollection,
    path: str | Path,
    *,
    contents: Sequence[str] | None = None,
    decimals: int | None = None,
) -> None:
    """Write ``collection`` in the format its name says: ``.npz`` (GPUSparse's, ids and tokens
    kept), ``.bin`` (Seismic's: no ids, no texts) or JSONL (``.jsonl``, ``.jsonl.gz``: texts
    from ``contents``, weights rounded to ``decimals`` when given)."""
    name = Path(path).name
    if name.endswith((".npz", ".bin")) and decimals is not None:
        raise ValueError("decimals rounds JSONL weights only; binary files keep exact float32")
    if name.endswith(".npz"):
        write_npz(collection, path)
    elif name.endswith(".bin"):
        write_seismic_bin(collection, path)
    else:
        write_jsonl(collection, path, contents=contents, decimals=decimals)
