"""GPUSparse's binary vector file: a collection's CSR arrays, ids and vocabulary in one ``.npz``.

The fast way to keep encoded vectors (``gpusparse encode --vectors-format npz``): writing and
reading move whole arrays, with no text formatting or parsing. Unlike Seismic's ``.bin`` it
keeps the ids and names the terms by token, so it reads back into any vocabulary holding its
tokens, as JSONL does. An uncompressed NumPy ``.npz`` (a zip of ``.npy`` files, no pickled
objects) with these members:

* ``format``: uint8, the ASCII text ``gpusparse-vectors/1``;
* ``indptr`` int64 ``[n + 1]``, ``indices`` int32 ``[nnz]`` (term ids, ascending inside each
  vector), ``values`` float32 ``[nnz]`` (weights > 0): the vectors, as CSR;
* ``ids`` uint8 (UTF-8 bytes of all ids, concatenated) and ``id_offsets`` int64 ``[n + 1]``;
* ``tokens`` uint8 and ``token_offsets`` int64 ``[V + 1]``: the vocabulary the term ids
  refer to, the same way.

:func:`gpusparse.formats.read_vectors` reads it (and ``gpusparse index`` with it).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from .collection import SparseCollection
from .errors import InputError
from .vocab import Vocabulary

FORMAT = "gpusparse-vectors/1"
_MEMBERS = ("format", "indptr", "indices", "values", "ids", "id_offsets", "tokens", "token_offsets")


def _packed(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    data = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    return np.frombuffer(b"".join(data), dtype=np.uint8), offsets


def _unpacked(blob: np.ndarray, offsets: np.ndarray) -> list[str]:
    raw = blob.tobytes()
    return [raw[a:b].decode("utf-8") for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]


def write_npz(collection: SparseCollection, path: str | Path) -> None:
    """Write ``collection`` as a GPUSparse ``.npz`` vector file (see the module docstring)."""
    ids, id_offsets = _packed(list(collection.ids))
    tokens, token_offsets = _packed(collection.vocab.tokens())
    with Path(path).open("wb") as f:  # a file object: numpy adds no suffix
        np.savez(
            f,
            format=np.frombuffer(FORMAT.encode("ascii"), dtype=np.uint8),
            indptr=collection.indptr.astype(np.int64, copy=False),
            indices=collection.indices.astype(np.int32, copy=False),
            values=collection.values.astype(np.float32, copy=False),
            ids=ids,
            id_offsets=id_offsets,
            tokens=tokens,
            token_offsets=token_offsets,
        )


@dataclass
class NpzVectors:
    """What a ``.npz`` vector file holds, checked for shape and type (weights are the reader's to check)."""

    path: str
    ids: list[str]
    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    tokens: list[str]

    def in_vocabulary(
        self, vocab: Vocabulary, unknown: Literal["error", "skip"] = "error"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``(terms int32, weights float32, row lengths int64, tokens skipped)``: the vectors with
        their tokens looked up in ``vocab`` (unknown ones refused, or dropped with ``"skip"``)."""
        terms, weights, lengths = self.indices, self.values, np.diff(self.indptr)
        if len(vocab) == len(self.tokens) and self.tokens == vocab.tokens():
            return terms, weights, lengths, 0
        lookup = vocab.lookup
        mapped = np.array([-1 if (i := lookup(t)) is None else i for t in self.tokens], dtype=np.int64)
        terms64 = mapped[terms]
        bad = terms64 < 0
        if not bad.any():
            return terms64.astype(np.int32), weights, lengths, 0
        if unknown == "error":
            j = int(np.argmax(bad))
            rec = int(np.searchsorted(self.indptr, j, side="right")) - 1
            raise InputError(
                f"token {self.tokens[terms[j]]!r} is not in the vocabulary ({len(vocab)} terms)",
                path=self.path,
                line=rec + 1,
                field="tokens",
                record=True,
            )
        rows = np.repeat(np.arange(lengths.size), lengths)
        kept = np.bincount(rows[~bad], minlength=lengths.size).astype(np.int64)
        return terms64[~bad].astype(np.int32), weights[~bad], kept, int(bad.sum())


def read_npz(path: str | Path) -> NpzVectors:
    """Read a ``.npz`` vector file.

    Raises:
        InputError: not such a file, or arrays of the wrong type or shape (naming the member).
    """
    spath = str(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [m for m in _MEMBERS if m not in z.files]
            if missing:
                raise InputError(
                    f"not a GPUSparse vector file (no {', '.join(missing)}); write it with gpusparse encode "
                    "--vectors-format npz or gpusparse.vectors_npz.write_npz",
                    path=spath,
                )
            arrays = {m: z[m] for m in _MEMBERS}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InputError(f"cannot read as .npz: {exc}", path=spath) from None
    fmt = arrays["format"].tobytes().decode("ascii", "replace")
    if fmt != FORMAT:
        raise InputError(f"format {fmt!r} is not {FORMAT!r} (written by another version?)", path=spath, field="format")
    for name, kinds in (
        ("indptr", "i"),
        ("indices", "i"),
        ("values", "f"),
        ("ids", "u"),
        ("id_offsets", "i"),
        ("tokens", "u"),
        ("token_offsets", "i"),
    ):
        a = arrays[name]
        if a.ndim != 1 or a.dtype.kind not in kinds:
            raise InputError(f"expected a 1-D array of kind {kinds!r}, got {a.dtype} {a.shape}", path=spath, field=name)
    indptr, indices, values = arrays["indptr"].astype(np.int64), arrays["indices"], arrays["values"]
    for name, offsets, size in (
        ("indptr", indptr, indices.size),
        ("id_offsets", arrays["id_offsets"], arrays["ids"].size),
        ("token_offsets", arrays["token_offsets"], arrays["tokens"].size),
    ):
        if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != size or np.any(np.diff(offsets) < 0):
            raise InputError(f"offsets must start at 0, not decrease and end at {size}", path=spath, field=name)
    n = indptr.size - 1
    if arrays["id_offsets"].size != n + 1:
        raise InputError(f"{arrays['id_offsets'].size - 1} ids for {n} vectors", path=spath, field="ids")
    if values.size != indices.size:
        raise InputError(f"{values.size} values for {indices.size} indices", path=spath, field="values")
    try:
        ids = _unpacked(arrays["ids"], arrays["id_offsets"])
        tokens = _unpacked(arrays["tokens"], arrays["token_offsets"])
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8: {exc.reason}", path=spath, field="ids or tokens") from None
    if indices.size and (indices.min() < 0 or indices.max() >= len(tokens)):
        raise InputError(f"term ids must be in [0, {len(tokens)}) (the file's vocabulary)", path=spath, field="indices")
    return NpzVectors(spath, ids, indptr, indices.astype(np.int32), values.astype(np.float32), tokens)
