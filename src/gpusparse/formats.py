"""Readers and writers for the formats users already have.

Sparse vectors:
    * Anserini/Pyserini JsonVectorCollection JSONL: ``{"id", "contents", "vector": {token: w}}``;
    * Seismic JSONL: ``{"id", "content", "vector"}`` (read by the same reader);
    * Seismic binary: u32 count, then per vector u32 length, int32 term ids, float32 weights
      (little-endian; vectors get ids ``"0"``, ``"1"``, ... in file order).

Runs and judgments (TREC runs, TREC or BEIR qrels) are :mod:`gpusparse.trec`'s.

Files ending in ``.gz`` are (de)compressed transparently. Readers stream: a file is read
line by line (or mapped, for binary files) straight into growing arrays, and is never
held in memory as text. Every problem raises :class:`~gpusparse.errors.InputError` naming
the file, the line (or record) and the field.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import zlib
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from tqdm.auto import tqdm

from .collection import SparseCollection, _short, check_id, json_type_name
from .errors import InputError
from .vocab import Vocabulary

Unknown = Literal["error", "skip"]
VECTOR_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".bin")
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass
class ReadStats:
    """What a read saw, for reports: counts that would otherwise be silent."""

    files: list[str] = field(default_factory=list)
    records: int = 0
    empty_vectors: int = 0
    unknown_tokens_skipped: int = 0
    zero_weights_dropped: int = 0

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


class _Builder:
    """Growing CSR arrays shared by all files of one read, with the source of every record."""

    def __init__(self) -> None:
        self.indptr = array("q", [0])
        self.terms = array("i")
        self.weights = array("d")
        self.ids: list[str] = []
        self.seen: dict[str, int] = {}  # id -> row
        self.rec_file: list[str] = []
        self.rec_line = array("q")
        self.rec_binary = array("b")

    def add_id(self, doc_id: str, path: str, line: int, record: bool = False) -> None:
        row = self.seen.setdefault(doc_id, len(self.ids))
        if row != len(self.ids):
            where = _where(self.rec_file[row], self.rec_line[row], bool(self.rec_binary[row]))
            raise InputError(
                f"duplicate id {doc_id!r} (first seen at {where})", path=path, line=line, field="id", record=record
            )
        self.ids.append(doc_id)
        self.rec_file.append(path)
        self.rec_line.append(line)
        self.rec_binary.append(record)

    def row_of(self, entry: int) -> int:
        """The record holding flat entry ``entry``."""
        return int(np.searchsorted(np.frombuffer(self.indptr, dtype=np.int64), entry, side="right")) - 1

    def error(self, row: int, reason: str, field: str | None = "vector") -> InputError:
        """An error located at record ``row``."""
        return InputError(
            reason, path=self.rec_file[row], line=self.rec_line[row], field=field, record=bool(self.rec_binary[row])
        )

    def finish(self, vocab: Vocabulary, stats: ReadStats) -> SparseCollection:
        values = np.frombuffer(self.weights, dtype=np.float64) if len(self.weights) else np.zeros(0)
        _check_values(values, self)
        indptr = np.frombuffer(self.indptr, dtype=np.int64)
        terms = np.frombuffer(self.terms, dtype=np.int32) if len(self.terms) else np.zeros(0, np.int32)
        values32 = values.astype(np.float32)
        # Counted after the conversion: a weight below float32's range (1e-50) is dropped too.
        stats.zero_weights_dropped += int(np.count_nonzero(values32 == 0))
        self.weights = array("d")  # free the float64 copy before canonicalisation copies
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


def _where(path: str, line: int, record: bool) -> str:
    return f"{path} record {line}" if record else f"{path}:{line}"


def _check_values(values: np.ndarray, b: _Builder) -> None:
    checks = (
        (~np.isfinite(values), "is not finite"),
        (values < 0, "is negative"),
        (np.abs(values) > _F32_MAX, "overflows float32"),
    )
    for bad, what in checks:
        if bad.any():
            i = int(np.argmax(bad))
            raise b.error(b.row_of(i), f"weight {float(values[i])!r} {what}")


# -- opening files ------------------------------------------------------------------------


@contextmanager
def _open_binary(path: Path, progress: bool, unit_desc: str) -> Iterator[tuple[IO[bytes], tqdm]]:
    try:
        raw = path.open("rb")
    except OSError as exc:
        raise InputError(f"cannot open: {exc.strerror}", path=path) from None
    size = os.fstat(raw.fileno()).st_size
    if size == 0 and path.name.endswith(".gz"):
        # GzipFile reads a 0-byte file as empty data: say what it is instead of reading nothing.
        raw.close()
        raise InputError("empty file (0 bytes), not gzip data", path=path)
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=unit_desc, disable=not progress or None, leave=False)
    try:
        if path.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz, _RawProgress(raw, bar)
        else:
            yield raw, _RawProgress(raw, bar)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"truncated or corrupt gzip data ({exc})", path=path) from None
    finally:
        bar.close()
        raw.close()


class _RawProgress:
    """Progress in bytes of the underlying (compressed) file, updated cheaply."""

    def __init__(self, raw: IO[bytes], bar: tqdm) -> None:
        self.raw, self.bar = raw, bar

    def update(self) -> None:
        self.bar.update(self.raw.tell() - self.bar.n)


# -- JSONL vectors ------------------------------------------------------------------------


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | tuple[tuple[str, Any], ...]:
    """A decoded JSON object: a dict, or its pairs as a tuple when a key repeats.

    json's default keeps the last of repeated keys; a vector naming one token twice must
    have it summed (like any duplicate term), so such an object keeps all its pairs. JSON
    makes tuples of nothing else: a tuple is always an object with a repeated key.
    """
    d = dict(pairs)
    return d if len(d) == len(pairs) else tuple(pairs)


_DECODER = json.JSONDecoder(object_pairs_hook=_json_object)


def decode_json_line(
    text: bytes | str, *, path: str | os.PathLike[str] | None = None, line: int | None = None
) -> object:
    """Decode one JSONL line as the readers do, or raise a one-line :class:`InputError`.

    Bytes must be UTF-8 (a leading byte-order mark is allowed). JSON objects come back as
    dicts, except an object with a repeated key: a tuple of all its ``(key, value)`` pairs
    (``dict(pairs)`` keeps the last, as ``json.loads`` would). Malformed JSON, nesting too
    deep for the decoder and integers beyond Python's digit limit are errors naming
    ``path:line``.
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if text.startswith("\ufeff"):
            text = text[1:]
        return _DECODER.decode(text)
    except UnicodeDecodeError:
        raise InputError("not UTF-8 text", path=path, line=line) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"malformed JSON: {exc.msg} at column {exc.colno}", path=path, line=line) from None
    except RecursionError:
        raise InputError("malformed JSON: nested too deeply", path=path, line=line) from None
    except ValueError as exc:  # int("...") beyond sys.get_int_max_str_digits()
        reason = (
            f"a number with more than {sys.get_int_max_str_digits():,} digits"
            if "integer string conversion" in str(exc)
            else str(exc).split("\n")[0]
        )
        raise InputError(f"malformed JSON: {reason}", path=path, line=line) from None


VECTOR_RECORD_KEYS = ("id", "_id", "vector")


def record_dict(
    pairs: tuple[tuple[str, Any], ...],
    keys: Sequence[str] = VECTOR_RECORD_KEYS,
    *,
    path: str | os.PathLike[str] | None = None,
    line: int | None = None,
) -> dict[str, Any]:
    """The record of a JSON line whose object repeats a key (:func:`decode_json_line` gave its pairs).

    A repeated key among ``keys``, those the caller reads, is refused: which of two ids or
    vectors is meant? Other repeated keys keep the last value, as ``json.loads`` does.
    """
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen and key in keys:
            raise InputError("key repeated in one record", path=path, line=line, field=key)
        seen.add(key)
    return dict(pairs)


def _read_jsonl_into(
    path: Path, b: _Builder, vocab: Vocabulary, unknown: Unknown, stats: ReadStats, progress: bool
) -> None:
    spath = str(path)
    lookup = vocab.lookup
    terms, weights, indptr = b.terms, b.weights, b.indptr
    lineno = 0
    with _open_binary(path, progress, path.name) as (f, prog):
        lines = enumerate(f, 1)
        while True:
            try:
                lineno, line = next(lines)
            except StopIteration:
                break
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                raise InputError(f"truncated or corrupt gzip data ({exc})", path=spath, line=lineno + 1) from None
            if lineno % 4096 == 0:
                prog.update()
            if not line.strip():
                continue
            obj = decode_json_line(line, path=spath, line=lineno)
            if type(obj) is not dict:
                if type(obj) is not tuple:
                    raise InputError(f"expected a JSON object, got {json_type_name(obj)}", path=spath, line=lineno)
                obj = record_dict(obj, path=spath, line=lineno)
            doc_id = check_id(obj.get("id", obj.get("_id")), path=spath, line=lineno)
            vec = obj.get("vector")
            if vec is None:
                raise InputError("missing", path=spath, line=lineno, field="vector")
            if type(vec) is dict:
                toks, vals = vec.keys(), vec.values()
            elif type(vec) is tuple:  # a repeated token: keep both, they are summed with other duplicates
                toks, vals = zip(*vec, strict=True)
            else:
                raise InputError(
                    f"expected a {{token: weight}} object, got {json_type_name(vec)}",
                    path=spath,
                    line=lineno,
                    field="vector",
                )
            b.add_id(doc_id, spath, lineno)
            tids = list(map(lookup, toks))
            if None in tids:
                if unknown == "error":
                    tok = list(toks)[tids.index(None)]
                    raise InputError(
                        f"unknown token {tok!r} (use --unknown-tokens skip to drop such tokens)",
                        path=spath,
                        line=lineno,
                        field="vector",
                    )
                keep = [i is not None for i in tids]
                stats.unknown_tokens_skipped += keep.count(False)
                tids = [i for i, k in zip(tids, keep, strict=True) if k]
                vals = [w for w, k in zip(vals, keep, strict=True) if k]
            # JSON true/false would pass as 1.0/0.0: look for them only when the line could hold one.
            bad_bool = (b"true" in line or b"false" in line) and any(type(w) is bool for w in vals)
            try:
                if bad_bool:
                    raise TypeError
                weights.extend(vals)
            except (TypeError, OverflowError):
                bad = next(w for w in vals if type(w) not in (int, float) or abs(w) > _F32_MAX)
                what = "is not a number" if type(bad) not in (int, float) else "overflows float32"
                raise InputError(f"weight {_short(bad)} {what}", path=spath, line=lineno, field="vector") from None
            terms.extend(tids)
            indptr.append(len(terms))
        prog.update()


def read_vectors(
    paths: str | Path | Sequence[str | Path],
    vocab: Vocabulary | None = None,
    *,
    unknown: Unknown = "error",
    progress: bool = True,
    stats: ReadStats | None = None,
) -> SparseCollection:
    """Read sparse vectors from JSONL(.gz) and Seismic ``.bin`` files, or folders of them.

    Args:
        paths: one path or several; a folder stands for the vector files inside it
            (``*.jsonl``, ``*.jsonl.gz``, ``*.json``, ``*.json.gz``, ``*.bin``), in name order.
        vocab: the vocabulary tokens are looked up in (default: BERT WordPiece).
        unknown: ``"error"`` (default) refuses a token missing from ``vocab``; ``"skip"``
            drops it and counts it in ``stats.unknown_tokens_skipped``.
        progress: show a progress bar on a terminal.
        stats: filled with counts (records, empty vectors, skipped tokens ...).

    Returns:
        One collection with the vectors of all files in order. Ids must be unique across
        all files, non-empty, printable and without whitespace (see
        :func:`~gpusparse.collection.id_problem`). Input without any vector is an error.
    """
    if unknown not in ("error", "skip"):
        raise ValueError(f"unknown must be 'error' or 'skip', not {unknown!r}")
    vocab = Vocabulary.bert() if vocab is None else vocab
    stats = ReadStats() if stats is None else stats
    files = expand_vector_paths(paths)
    b = _Builder()
    for path in files:
        stats.files.append(str(path))
        if path.name.endswith(".bin"):
            _read_seismic_bin_into(path, b, vocab, progress)
        else:
            _read_jsonl_into(path, b, vocab, unknown, stats, progress)
    if not b.ids:
        # An empty input is a mistake (a failed export, the wrong file): a 0-document index
        # or an empty run would hide it.
        where = paths if isinstance(paths, str | Path) else paths[0] if len(paths) == 1 else None
        what = "the file" if len(files) == 1 else f"any of its {len(files)} files"
        raise InputError(f"empty collection: no vectors in {what} (empty or only blank lines)", path=where)
    return b.finish(vocab, stats)


def expand_vector_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Files named by ``paths``, folders expanded to the vector files inside them."""
    if isinstance(paths, str | Path):
        paths = [paths]
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            _refuse_other_folders(p)
            found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(VECTOR_SUFFIXES))
            if not found:
                raise InputError(f"no vector files ({', '.join(VECTOR_SUFFIXES)}) in this folder", path=p)
            out.extend(found)
        elif p.is_file():
            if not p.name.endswith(VECTOR_SUFFIXES):
                raise InputError(f"unknown file type: expected one of {', '.join(VECTOR_SUFFIXES)}", path=p)
            out.append(p)
        else:
            raise InputError("no such file or folder", path=p)
    if not out:
        raise InputError("no input files given")
    return out


def _refuse_other_folders(folder: Path) -> None:
    """Refuse folders that hold something other than vectors, which their ``.json``/``.jsonl``
    files would otherwise be mistaken for (an index's ``manifest.json``: "malformed JSON")."""
    manifest = folder / "manifest.json"
    if manifest.is_file():
        try:
            fmt = json.loads(manifest.read_bytes()).get("format", "")
        except (OSError, ValueError, RecursionError, AttributeError):
            fmt = ""
        if isinstance(fmt, str) and fmt.startswith("gpusparse-"):
            raise InputError("this is a GPUSparse index folder, not vectors (JSONL or .bin files)", path=folder)
    names = {q.name for q in folder.iterdir()}
    if names & {"corpus.jsonl", "corpus.jsonl.gz"} and names & {"queries.jsonl", "queries.jsonl.gz"}:
        raise InputError(
            "this folder holds both a corpus and queries (a BEIR or encoded folder): name the file to read",
            path=folder,
        )


# -- Seismic binary -----------------------------------------------------------------------


def _read_seismic_bin_into(path: Path, b: _Builder, vocab: Vocabulary, progress: bool) -> None:
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
        b.terms.frombytes(term_ids.astype(np.int32).tobytes())
        b.weights.frombytes(weights.astype(np.float64).tobytes())
    base = b.indptr[-1]
    b.indptr.frombytes((base + np.cumsum(lengths)).astype(np.int64).tobytes())
