"""The Common Index File Format (CIFF): hand an index to PISA, Anserini or JASS, and read theirs.

A CIFF file (https://github.com/osirrc/ciff) is a protobuf ``Header``, the postings lists
(``term``, then ``(docid gap, tf)`` pairs, documents ascending) and one ``DocRecord`` per
document (its collection id and length), each message prefixed by its varint length
(:mod:`._ciff_messages`). Files ending in ``.gz`` are gzipped; both functions stream.

**Impacts.** CIFF stores integer ``tf``. For learned sparse indexes PISA (``quantized``
scorer), Anserini (impact search) and JASS read ``tf`` as the document's *impact*: a
document's score is ``Σ query weight · tf``. :func:`export_ciff` therefore writes
``tf = level``: the 8-bit level of an index built with ``--quantize 8`` (``weight = level ·
step``) exactly, and for a float32 index the levels that ``--quantize BITS`` would store
(``tf = round(weight / step)``, ``step`` the smallest power of two with ``max weight / step ≤
2**BITS − 1``; weights below half a step vanish and are counted). The header's
``description`` records the step (``weight = tf * STEP (BITS-bit)``). :func:`read_ciff` reads
weights as ``tf · scale``: ``scale`` is that step for a file written here, 1 for other files
(a uniform scale changes no ranking), or what the caller gives. :func:`index_from_ciff`
builds an :class:`~gpusparse.Index`, quantized again with the same bits when the file says
it was written from a quantized index, so the round trip ranks exactly as the original.

``protobuf`` is optional (``pip install 'gpusparse[ciff]'``).
"""

from __future__ import annotations

import gzip
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .._version import __version__
from ..collection import SparseCollection
from ..errors import InputError
from ..index import Index
from ..quantize import check_bits, levels, power_of_two_step
from ..vocab import Vocabulary
from ._ciff_messages import messages

CIFF_VERSION = 1
_DESCRIPTION = re.compile(r"weight = tf \* ([0-9.eE+-]+) \((\d+)-bit")


@dataclass(frozen=True)
class CiffExport:
    """What :func:`export_ciff` wrote."""

    n_docs: int
    n_terms: int  # postings lists written
    n_postings: int
    n_dropped: int  # postings whose weight rounded to level 0
    step: float  # weight = tf · step
    bits: int


@dataclass(frozen=True)
class CiffHeader:
    """A CIFF file's header, and the scale a file written by GPUSparse declares."""

    version: int
    num_postings_lists: int
    num_doc_records: int
    total_postings_lists: int
    total_docs: int
    total_terms_in_collection: int
    average_doclength: float
    description: str
    step: float | None  # from a GPUSparse description: weight = tf · step
    bits: int | None


def export_ciff(
    index: Index | str | Path,
    path: str | Path,
    *,
    bits: int = 8,
    description: str | None = None,
    overwrite: bool = False,
) -> CiffExport:
    """Write ``index`` (an :class:`Index` or its folder) as CIFF, impacts as integer ``tf``.

    Args:
        index: the index; a quantized one keeps its levels and ``bits``.
        path: the file to write (``.gz``: gzipped); written beside, then renamed.
        bits: levels of a float32 index (see the module docstring); ignored when quantized.
        description: text for the header, after GPUSparse's own line with the step.
        overwrite: replace an existing ``path``.

    Terms are written in the byte order of their UTF-8 text (Lucene's order; PISA's
    lexicon searches it) and only terms with postings; documents keep the index's order.
    """
    msgs = messages()
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists (use overwrite=True / --overwrite to replace it)")
    if not isinstance(index, Index):
        index = Index.load(index)
    doc_ids = index.doc_ids.cpu().numpy()
    scores = index.scores.cpu()
    offsets, lengths = index.offsets.cpu().numpy(), index.lengths.cpu().numpy()
    if index.quantization is not None:
        bits, step = index.quantization.bits, index.quantization.step
    else:
        check_bits(bits)
        step = power_of_two_step(float(index.max_scores.max()) if index.n_docs else 0.0, bits)
    tf_all = levels(scores, step, bits).numpy()

    n_docs = int(index.n_docs)
    vocab = index.vocab
    terms = [t for t in np.flatnonzero(lengths > 0).tolist()]
    terms.sort(key=lambda t: vocab.token(t).encode("utf-8"))
    doc_len = np.zeros(n_docs, dtype=np.int64)
    lists: list[tuple[int, np.ndarray, np.ndarray]] = []
    n_postings = n_dropped = 0
    for t in terms:
        a = int(offsets[t])
        docs, tfs = doc_ids[a : a + int(lengths[t])], tf_all[a : a + int(lengths[t])]
        keep = tfs > 0
        n_dropped += int(np.count_nonzero(~keep))
        docs, tfs = docs[keep].astype(np.int64), tfs[keep]
        if docs.size:
            np.add.at(doc_len, docs, tfs)
            lists.append((t, docs, tfs))
            n_postings += int(docs.size)
    total = int(doc_len.sum())
    text = f"gpusparse {__version__} impacts: weight = tf * {step!r} ({bits}-bit)"
    header = msgs["Header"](
        version=CIFF_VERSION,
        num_postings_lists=len(lists),
        num_doc_records=n_docs,
        total_postings_lists=len(lists),
        total_docs=n_docs,
        total_terms_in_collection=total,
        average_doclength=total / n_docs if n_docs else 0.0,
        description=text if not description else f"{text}; {description}",
    )
    tmp = path.with_name(path.name + ".tmp")
    try:
        with _open(tmp, "wb") as out:
            _write(out, header)
            for t, docs, tfs in lists:
                pl = msgs["PostingsList"](term=vocab.token(t), df=int(docs.size), cf=int(tfs.sum()))
                gaps = np.diff(docs, prepend=0).tolist()
                add = pl.postings.add
                for g, f in zip(gaps, tfs.tolist(), strict=True):
                    add(docid=g, tf=f)
                _write(out, pl)
            record = msgs["DocRecord"]
            for d, (name, length) in enumerate(zip(index.ids, doc_len.tolist(), strict=True)):
                _write(out, record(docid=d, collection_docid=name, doclength=length))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return CiffExport(n_docs, len(lists), n_postings, n_dropped, step, bits)


def read_ciff_header(path: str | Path) -> CiffHeader:
    """The header of a CIFF file (reads only the first message)."""
    with _open(Path(path), "rb") as f:
        return _header(_read_message(f, messages()["Header"], path, 1, "Header"), path)


def read_ciff(
    path: str | Path,
    *,
    scale: float | None = None,
    vocab: Vocabulary | None = None,
    unknown: str = "error",
) -> SparseCollection:
    """The documents of a CIFF file as sparse vectors: weight = ``tf · scale``.

    Args:
        path: the file (gzipped or not, whatever its name).
        scale: weight of one ``tf`` unit; default the step a GPUSparse file declares, else 1.
        vocab: the vocabulary to read terms in; default BERT's when every term is a BERT
            token (so SPLADE queries work), else the file's terms in file order.
        unknown: with ``vocab``, ``"error"`` refuses terms outside it, ``"skip"`` drops them.

    Row ``i`` is CIFF document ``i`` (ids from the ``DocRecord`` s).

    Raises:
        InputError: a truncated or malformed file (record number and field named).
    """
    if unknown not in ("error", "skip"):
        raise ValueError(f"unknown must be 'error' or 'skip', not {unknown!r}")
    msgs = messages()
    with _open(Path(path), "rb") as f:
        head = _header(_read_message(f, msgs["Header"], path, 1, "Header"), path)
        if scale is None:
            scale = head.step if head.step is not None else 1.0
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number, not {scale!r}")
        terms: list[str] = []
        cols: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        tfs: list[np.ndarray] = []
        for i in range(head.num_postings_lists):
            pl = _read_message(f, msgs["PostingsList"], path, 2 + i, "PostingsList")
            gaps = np.fromiter((p.docid for p in pl.postings), dtype=np.int64, count=len(pl.postings))
            tf = np.fromiter((p.tf for p in pl.postings), dtype=np.int64, count=len(pl.postings))
            if (gaps < 0).any() or (gaps[1:] == 0).any():
                raise InputError(f"term {pl.term!r}: documents are not ascending", path=path, line=2 + i, record=True)
            if (tf < 0).any():
                raise InputError(f"term {pl.term!r}: negative tf", path=path, line=2 + i, record=True, field="tf")
            rows.append(np.cumsum(gaps))
            tfs.append(tf)
            cols.append(np.full(gaps.size, len(terms), dtype=np.int64))
            terms.append(pl.term)
        n = head.num_doc_records
        ids: list[str | None] = [None] * n
        first = 2 + head.num_postings_lists
        for j in range(n):
            rec = _read_message(f, msgs["DocRecord"], path, first + j, "DocRecord")
            if not 0 <= rec.docid < n or ids[rec.docid] is not None:
                raise InputError(
                    f"docid {rec.docid} is outside 0..{n - 1} or repeated", path=path, line=first + j, record=True
                )
            ids[rec.docid] = rec.collection_docid
    term_ids, vocab = _term_ids(terms, vocab, unknown, path)
    row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    if row.size and int(row.max()) >= n:
        raise InputError(f"a posting names document {int(row.max())} of {n} documents", path=path, field="docid")
    col = term_ids[np.concatenate(cols)] if cols else np.zeros(0, np.int64)
    tf = np.concatenate(tfs) if tfs else np.zeros(0, np.int64)
    keep = col >= 0
    row, col, values = row[keep], col[keep], tf[keep].astype(np.float64) * scale
    order = np.lexsort((col, row))
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=n), out=indptr[1:])
    return SparseCollection(indptr, col[order].astype(np.int32), values[order], ids=ids, vocab=vocab)  # type: ignore[arg-type]


def index_from_ciff(
    path: str | Path,
    *,
    quantize: int | str | None = "auto",
    scale: float | None = None,
    vocab: Vocabulary | None = None,
    unknown: str = "error",
    device: str | torch.device = "cpu",
) -> Index:
    """:func:`read_ciff`, then :meth:`Index.build`. ``quantize="auto"``: the bits of a file
    written here from a quantized index (queries are quantized alike), else a float32 index."""
    if quantize == "auto":
        head = read_ciff_header(path)
        quantize = head.bits if head.step is not None else None
    coll = read_ciff(path, scale=scale, vocab=vocab, unknown=unknown)
    return Index.build(coll, device=device, quantize=quantize)  # type: ignore[arg-type]


# -- internals ----------------------------------------------------------------------------


def _term_ids(
    terms: list[str], vocab: Vocabulary | None, unknown: str, path: str | Path
) -> tuple[np.ndarray, Vocabulary]:
    """Term id of each CIFF term in ``vocab`` (-1: skipped), and the vocabulary."""
    if vocab is None:
        bert = Vocabulary.bert()
        vocab = bert if all(bert.get(t) is not None for t in terms) else Vocabulary(terms or ["[empty]"])
    get = vocab.get
    ids = np.array([-1 if (i := get(t)) is None else i for t in terms], dtype=np.int64)
    if unknown == "error" and (ids < 0).any():
        bad = terms[int(np.argmax(ids < 0))]
        raise InputError(f"term {bad!r} is not in the vocabulary (unknown='skip' drops such terms)", path=path)
    return ids, vocab


def _header(h: Any, path: str | Path) -> CiffHeader:
    if h.num_postings_lists < 0 or h.num_doc_records < 0:
        raise InputError("negative counts in the header", path=path, line=1, record=True, field="Header")
    m = _DESCRIPTION.search(h.description) if h.description.startswith("gpusparse ") else None
    return CiffHeader(
        version=h.version,
        num_postings_lists=h.num_postings_lists,
        num_doc_records=h.num_doc_records,
        total_postings_lists=h.total_postings_lists,
        total_docs=h.total_docs,
        total_terms_in_collection=h.total_terms_in_collection,
        average_doclength=h.average_doclength,
        description=h.description,
        step=float(m.group(1)) if m else None,
        bits=int(m.group(2)) if m else None,
    )


def _open(path: Path, mode: str) -> IO[bytes]:
    """``path`` for binary reading or writing; gzipped when it ends in ``.gz`` (writing) or
    starts with gzip's magic bytes (reading)."""
    if "w" in mode:
        gz = path.name.removesuffix(".tmp").endswith(".gz")
        return gzip.open(path, "wb", compresslevel=6) if gz else path.open("wb")  # type: ignore[return-value]
    try:
        f = path.open("rb")
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=path) from None
    magic = f.read(2)
    f.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return f


def _write(out: IO[bytes], message: Any) -> None:
    data = message.SerializeToString()
    out.write(_varint(len(data)))
    out.write(data)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_message(f: IO[bytes], cls: Any, path: str | Path, record: int, what: str) -> Any:
    size = _read_varint(f, path, record, what)
    data = f.read(size)
    if len(data) != size:
        raise InputError(f"file ends inside a {what} message", path=path, line=record, record=True)
    try:
        return cls.FromString(data)
    except Exception as exc:  # protobuf's DecodeError, whose module differs between backends
        raise InputError(f"not a {what} message ({exc})", path=path, line=record, record=True) from None


def _read_varint(f: IO[bytes], path: str | Path, record: int, what: str) -> int:
    shift = result = 0
    while True:
        b = f.read(1)
        if not b:
            raise InputError(f"file ends before {what} message", path=path, line=record, record=True)
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise InputError(f"bad length prefix of a {what} message", path=path, line=record, record=True)


def iter_messages(path: str | Path) -> Iterator[Any]:
    """Every message of a CIFF file in order (header, postings lists, doc records): for inspection."""
    msgs = messages()
    with _open(Path(path), "rb") as f:
        head = _read_message(f, msgs["Header"], path, 1, "Header")
        yield head
        for i in range(head.num_postings_lists):
            yield _read_message(f, msgs["PostingsList"], path, 2 + i, "PostingsList")
        for j in range(head.num_doc_records):
            yield _read_message(f, msgs["DocRecord"], path, 2 + head.num_postings_lists + j, "DocRecord")
