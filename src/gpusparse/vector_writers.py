"""Writers of sparse vectors: Pyserini JsonVectorCollection JSONL (``.gz`` compressed when the
name says so) and Seismic's binary format; :mod:`gpusparse.formats` reads both back."""

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


def write_seismic_bin(collection: SparseCollection, path: str | Path) -> None:
    """Write a collection in Seismic's binary format (ids are not stored: record order is)."""
    with Path(path).open("wb") as f:
        f.write(np.uint32(len(collection)).tobytes())
        for i in range(len(collection)):
            a, b = int(collection.indptr[i]), int(collection.indptr[i + 1])
            f.write(np.uint32(b - a).tobytes())
            f.write(collection.indices[a:b].astype("<i4").tobytes())
            f.write(collection.values[a:b].astype("<f4").tobytes())
