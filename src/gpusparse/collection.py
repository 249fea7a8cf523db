"""A batch of sparse vectors in memory: CSR arrays, string ids and a vocabulary."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
import torch

from .errors import InputError
from .vocab import Vocabulary


@dataclass(frozen=True)
class CollectionStats:
    """Shape of a collection: what ``gpusparse info`` and the readers report."""

    n_vectors: int
    n_terms: int
    nnz: int
    n_empty: int
    mean_nnz: float
    max_nnz: int


class SparseCollection:
    """Sparse vectors (documents or queries) as CSR arrays plus ids and a vocabulary.

    Row ``i`` holds the vector with string id ``ids[i]``; its terms are
    ``indices[indptr[i]:indptr[i+1]]`` (term ids of ``vocab``) with weights ``values[...]``.

    The constructor puts the arrays in canonical form: duplicate terms inside one vector
    are **summed**, terms are sorted inside each vector, and explicit zero weights are
    dropped (they contribute nothing to any score). Weights must be finite and ≥ 0 —
    learned sparse models produce ``log(1 + relu(x))`` — and ids must be unique and pass
    :func:`id_problem`: non-empty, printable, no whitespace (a TREC run could not hold
    them otherwise).

    Args:
        indptr: int64 ``[n + 1]`` row pointers.
        indices: int32 ``[nnz]`` term ids, each ``< len(vocab)``.
        values: float32 ``[nnz]`` weights.
        ids: string ids, one per row; default ``"0"``, ``"1"``, ...
        vocab: the vocabulary term ids refer to; default BERT's WordPiece vocabulary.
        check_ids: check ids for uniqueness and :func:`id_problem` (readers do it as they read).
        copy: copy the arrays before canonicalising them; ``False`` hands them over.
    """

    def __init__(
        self,
        indptr: np.ndarray | Sequence[int],
        indices: np.ndarray | Sequence[int],
        values: np.ndarray | Sequence[float],
        ids: Sequence[str] | None = None,
        vocab: Vocabulary | None = None,
        *,
        check_ids: bool = True,
        copy: bool = True,
    ) -> None:
        vocab = Vocabulary.bert() if vocab is None else vocab
        indptr = np.asarray(indptr)
        indices = np.asarray(indices)
        values = np.asarray(values)
        if indices.size == 0:  # an empty list has no dtype to speak of
            indices = indices.astype(np.int32)
        if indptr.ndim != 1 or indptr.size == 0:
            raise ValueError("indptr must be a non-empty 1-D array")
        if indices.ndim != 1 or values.ndim != 1 or indices.shape != values.shape:
            raise ValueError("indices and values must be 1-D arrays of the same length")
        if not np.issubdtype(indptr.dtype, np.integer) or not np.issubdtype(indices.dtype, np.integer):
            raise TypeError("indptr and indices must be integer arrays")
        n = indptr.size - 1
        if indptr[0] != 0 or indptr[-1] != indices.size or np.any(np.diff(indptr) < 0):
            raise ValueError("indptr must start at 0, be non-decreasing and end at len(indices)")
        if indices.size and (indices.min() < 0 or indices.max() >= len(vocab)):
            bad = int(indices.max() if indices.max() >= len(vocab) else indices.min())
            raise InputError(f"term id {bad} is outside the vocabulary of {len(vocab)} terms", field="vector")
        _check_weights(values)

        # scipy canonicalises in place: work on copies unless the caller hands the arrays over
        # (readers do), so a user's arrays are never changed behind their back.
        csr = sp.csr_matrix((values.astype(np.float32, copy=copy), indices, indptr), shape=(n, len(vocab)), copy=copy)
        # Canonical form: sorted, duplicates summed (in float32, as they will be scored),
        # explicit zeros dropped. scipy does all three in place on the arrays it owns.
        if not csr.has_canonical_format:
            csr.sum_duplicates()
        csr.eliminate_zeros()
        self.indptr = csr.indptr.astype(np.int64, copy=False)
        self.indices = csr.indices.astype(np.int32, copy=False)
        self.values = csr.data.astype(np.float32, copy=False)
        if not np.all(np.isfinite(self.values)):
            raise InputError("summing duplicate terms overflowed float32", field="vector")
        self.vocab = vocab
        ids = [str(i) for i in range(n)] if ids is None else list(ids)
        if len(ids) != n:
            raise ValueError(f"{len(ids)} ids for {n} vectors")
        # Readers check ids as they go, with file and line; they skip this second pass.
        self.ids = _check_ids(ids) if check_ids else ids

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_scipy(
        cls,
        matrix: sp.spmatrix | sp.sparray,
        ids: Sequence[str] | None = None,
        vocab: Vocabulary | None = None,
    ) -> SparseCollection:
        """From a scipy sparse matrix with one vector per row.

        Without ``vocab`` the columns are anonymous term ids: an integer vocabulary of
        ``matrix.shape[1]`` terms, which can query any index with at least that many.
        """
        csr = sp.csr_matrix(matrix)
        vocab = Vocabulary.integer(csr.shape[1]) if vocab is None else vocab
        if csr.shape[1] > len(vocab):
            raise ValueError(f"matrix has {csr.shape[1]} columns but the vocabulary {len(vocab)} terms")
        return cls(csr.indptr, csr.indices, csr.data, ids=ids, vocab=vocab)

    @classmethod
    def from_torch_sparse(
        cls,
        tensor: torch.Tensor,
        ids: Sequence[str] | None = None,
        vocab: Vocabulary | None = None,
    ) -> SparseCollection:
        """From a 2-D torch sparse tensor, COO or CSR, on any device (one vector per row).

        What sentence-transformers' ``SparseEncoder.encode`` returns (a COO tensor, not
        coalesced: repeated entries are summed, as in any collection). Without ``vocab`` the
        columns are anonymous term ids, as in :meth:`from_scipy`.
        """
        if not is_torch_sparse(tensor):
            raise TypeError(f"expected a torch sparse COO or CSR tensor, got {_describe(tensor)}")
        if tensor.dim() != 2:
            raise ValueError(f"expected a 2-D sparse tensor [vectors, terms], got {tensor.dim()} dimensions")
        with torch.inference_mode():  # also reads tensors made under inference mode, as SparseEncoder's are
            t = tensor.detach().cpu()
            if t.layout == torch.sparse_coo:
                t = t.coalesce().to_sparse_csr()
        n_terms = int(t.shape[1])
        vocab = Vocabulary.integer(n_terms) if vocab is None else vocab
        if n_terms > len(vocab):
            raise ValueError(f"tensor has {n_terms} columns but the vocabulary {len(vocab)} terms")
        values = t.values()
        if values.is_floating_point() and values.dtype != torch.float64:
            values = values.float()
        return cls(
            t.crow_indices().numpy().astype(np.int64),
            t.col_indices().numpy().astype(np.int32),
            values.numpy(),
            ids=ids,
            vocab=vocab,  # copied: the values may share the caller's tensor memory
        )

    @classmethod
    def from_dense(
        cls, array: np.ndarray, ids: Sequence[str] | None = None, vocab: Vocabulary | None = None
    ) -> SparseCollection:
        """From a dense ``[n, V]`` array (zeros are absent terms)."""
        array = np.asarray(array)
        if array.ndim != 2:
            raise ValueError("expected a 2-D array")
        return cls.from_scipy(sp.csr_matrix(array), ids=ids, vocab=vocab)

    @classmethod
    def from_dicts(
        cls,
        vectors: Iterable[Mapping[str, float]],
        ids: Sequence[str] | None = None,
        vocab: Vocabulary | None = None,
        *,
        unknown: str = "error",
    ) -> SparseCollection:
        """From ``{"token": weight}`` mappings, e.g. ``[{"capital": 2.79, "france": 2.36}]``.

        ``unknown="error"`` refuses tokens missing from the vocabulary; ``"skip"`` drops them.
        Each vector is checked by :func:`parse_vector`, as the file readers check theirs:
        weights must be numbers (not booleans or strings), finite, ≥ 0 and within float32.
        """
        if unknown not in ("error", "skip"):
            raise ValueError(f"unknown must be 'error' or 'skip', not {unknown!r}")
        vocab = Vocabulary.bert() if vocab is None else vocab
        indptr = [0]
        indices: list[np.ndarray] = []
        values: list[np.ndarray] = []
        nnz = 0
        for row, vec in enumerate(vectors):
            parsed = parse_vector(vec, vocab, unknown=unknown, line=row + 1, record=True)  # type: ignore[arg-type]
            indices.append(parsed.terms)
            values.append(parsed.weights)
            nnz += parsed.terms.size
            indptr.append(nnz)
        return cls(
            np.asarray(indptr, dtype=np.int64),
            np.concatenate(indices) if indices else np.zeros(0, np.int32),
            np.concatenate(values) if values else np.zeros(0, np.float64),
            ids=ids,
            vocab=vocab,
        )

    @classmethod
    def concat(cls, parts: Sequence[SparseCollection]) -> SparseCollection:
        """Rows of ``parts`` one after the other (all must share one vocabulary)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        vocab = parts[0].vocab
        for p in parts[1:]:
            if p.vocab != vocab:
                raise ValueError("cannot concatenate collections with different vocabularies")
        offsets = np.cumsum([0] + [p.nnz for p in parts[:-1]])
        indptr = np.concatenate([parts[0].indptr[:1]] + [p.indptr[1:] + o for p, o in zip(parts, offsets, strict=True)])
        ids = [i for p in parts for i in p.ids]
        return cls(
            indptr,
            np.concatenate([p.indices for p in parts]),
            np.concatenate([p.values for p in parts]),
            ids=ids,
            vocab=vocab,
        )

    # -- access -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.indptr.size - 1

    @property
    def nnz(self) -> int:
        """Number of stored (term, weight) entries."""
        return int(self.indices.size)

    @property
    def row_lengths(self) -> np.ndarray:
        """Non-zeros of each vector."""
        return np.diff(self.indptr)

    def __getitem__(self, key: slice) -> SparseCollection:
        if not isinstance(key, slice):
            raise TypeError("index a collection with a slice; use row() for one vector")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("only contiguous slices are supported")
        a, b = int(self.indptr[start]), int(self.indptr[max(start, stop)])
        # A slice of a canonical collection is canonical: copy it without checking it again
        # (searches slice their queries into batches; the checks cost more than the search).
        return SparseCollection.from_canonical(
            self.indptr[start : max(start, stop) + 1] - a,
            self.indices[a:b].copy(),
            self.values[a:b].copy(),
            self.ids[start:stop],
            self.vocab,
        )

    @classmethod
    def from_canonical(
        cls, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, ids: list[str], vocab: Vocabulary
    ) -> SparseCollection:
        """A collection of arrays already in canonical form, taken as they are (not copied,
        not checked): int64 ``indptr``, int32 ``indices`` sorted and unique in each row and
        within ``vocab``, float32 ``values`` finite and > 0, ``ids`` checked. For arrays made
        from a collection's own (a slice, quantized queries): the constructor's checks cost more
        than a small batch's search."""
        out = object.__new__(cls)
        out.indptr, out.indices, out.values, out.ids, out.vocab = indptr, indices, values, ids, vocab
        return out

    def row(self, i: int) -> dict[str, float]:
        """Vector ``i`` as a ``{token: weight}`` dict."""
        a, b = int(self.indptr[i]), int(self.indptr[i + 1])
        return {self.vocab.token(int(t)): float(w) for t, w in zip(self.indices[a:b], self.values[a:b], strict=True)}

    def to_scipy(self) -> sp.csr_matrix:
        """A ``[n, len(vocab)]`` scipy CSR matrix (arrays shared, not copied)."""
        return sp.csr_matrix((self.values, self.indices, self.indptr), shape=(len(self), len(self.vocab)))

    def stats(self) -> CollectionStats:
        """Counts: vectors, nnz, empty vectors, mean and max nnz per vector."""
        lengths = self.row_lengths
        return CollectionStats(
            n_vectors=len(self),
            n_terms=len(self.vocab),
            nnz=self.nnz,
            n_empty=int(np.count_nonzero(lengths == 0)),
            mean_nnz=float(lengths.mean()) if lengths.size else 0.0,
            max_nnz=int(lengths.max()) if lengths.size else 0,
        )

    def __repr__(self) -> str:
        return f"SparseCollection(n={len(self)}, nnz={self.nnz}, vocab={self.vocab!r})"


def is_torch_sparse(value: object) -> bool:
    """Whether ``value`` is a torch sparse COO or CSR tensor (what :meth:`SparseCollection.from_torch_sparse` reads)."""
    return isinstance(value, torch.Tensor) and value.layout in (torch.sparse_coo, torch.sparse_csr)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.layout).removeprefix('torch.')} tensor"
    return type(value).__name__


_F32_MAX = float(np.finfo(np.float32).max)
# The Python types a weight may have: JSON numbers (int, float) and numpy scalars. Not
# bool (a JSON true would pass as 1.0) and not str (numpy would parse "1.0" silently).
_NUMBER_TYPES = (int, float, np.integer, np.floating)


def check_weights(
    values: np.ndarray,
    *,
    path: str | PathLike[str] | None = None,
    line: int | None = None,
    field: str | None = "vector",
    record: bool = False,
) -> None:
    """Refuse weights that are not finite, negative, or beyond float32's range.

    ``values`` is a numeric array (float64 keeps values that float32 cannot hold, so that
    they are refused rather than turned into ``inf``). The error names ``path``/``line``
    when given. Every reader and :func:`parse_vector` apply exactly these rules.
    """
    if values.size == 0:
        return
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise TypeError(f"weights must be numeric, not {values.dtype}")
    where = {"path": path, "line": line, "field": field, "record": record}
    # The words of the JSONL reader's own checks (formats._check_values), so that both say the same.
    if np.issubdtype(values.dtype, np.floating):
        bad = ~np.isfinite(values)
        if bad.any():
            raise InputError(f"weight {float(values[np.argmax(bad)])!r} is not finite", **where)
    if (values < 0).any():
        raise InputError(f"weight {float(values[np.argmax(values < 0)])!r} is negative", **where)
    if np.issubdtype(values.dtype, np.floating) and values.dtype.itemsize <= 4:
        return  # a finite float32 (or narrower) is within float32's range
    # Two comparisons, no float64 copy of the weights (a reader's float32 array can be 1e9 long).
    big = (values > _F32_MAX) | (values < -_F32_MAX)
    if big.any():
        raise InputError(f"weight {float(values[np.argmax(big)])!r} overflows float32", **where)


def _check_weights(values: np.ndarray) -> None:
    """:func:`check_weights` without a location (the server's per-request path)."""
    check_weights(values)


class ParsedVector(NamedTuple):
    """One ``{token: weight}`` vector after :func:`parse_vector`."""

    terms: np.ndarray  # int32 term ids, in the order given; a term may repeat (summed later)
    weights: np.ndarray  # float64, checked by check_weights
    skipped: int  # unknown tokens dropped (unknown="skip")


def parse_vector(
    vector: Mapping[str, object] | tuple[tuple[str, object], ...],
    vocab: Vocabulary,
    *,
    unknown: str = "error",
    path: str | PathLike[str] | None = None,
    line: int | None = None,
    field: str = "vector",
    record: bool = False,
) -> ParsedVector:
    """Check one decoded ``{token: weight}`` vector exactly as the file readers do.

    ``vector`` is a mapping, or the tuple of ``(token, weight)`` pairs that
    :func:`gpusparse.formats.decode_json_line` returns for an object with a repeated key
    (kept: they name one term twice and are summed like any duplicate term). Checks, in this order: it is
    an object; every token is in ``vocab`` (``unknown="skip"`` drops those that are not,
    unchecked); every weight is a number (int or float, not a boolean or a string); the
    weights pass :func:`check_weights`. Errors are :class:`InputError` naming ``path``,
    ``line`` and ``field`` when given.
    """
    where = {"path": path, "line": line, "field": field, "record": record}
    if isinstance(vector, Mapping):
        pairs: Sequence[tuple[str, object]] = list(vector.items())
    elif isinstance(vector, tuple) and all(type(p) is tuple and len(p) == 2 for p in vector):
        pairs = vector
    else:
        raise InputError(f"expected a {{token: weight}} object, got {json_type_name(vector)}", **where)
    get = vocab.get
    tids = [get(t) if type(t) is str else None for t, _ in pairs]
    skipped = 0
    if None in tids:
        if unknown != "skip":
            tok = next(t for (t, _), i in zip(pairs, tids, strict=True) if i is None)
            raise InputError(f"unknown token {tok!r}", **where)
        keep = [i is not None for i in tids]
        skipped = keep.count(False)
        pairs = [p for p, k in zip(pairs, keep, strict=True) if k]
        tids = [i for i in tids if i is not None]
    vals = [w for _, w in pairs]
    for w in vals:
        if not isinstance(w, _NUMBER_TYPES) or isinstance(w, bool):
            raise InputError(f"weight {_short(w)} is not a number", **where)
    try:
        weights = np.array(vals, dtype=np.float64)
    except OverflowError:  # an integer beyond float64
        big = next(w for w in vals if isinstance(w, int) and abs(w) > _F32_MAX)
        raise InputError(f"weight {_short(big)} overflows float32", **where) from None
    check_weights(weights, **where)
    return ParsedVector(np.array(tids, dtype=np.int32), weights, skipped)


def json_type_name(value: object) -> str:
    """The name of a decoded JSON value's type, in Python's words (``dict`` for an object,
    also when it was decoded as ``(key, value)`` pairs)."""
    return "dict" if isinstance(value, tuple) else type(value).__name__


def _short(value: object) -> str:
    """``repr(value)``, cut to 40 characters (a weight can be a 5,000-digit integer)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<integer of about {int(value.bit_length() * 0.30103):,} digits>"  # repr would hit int's digit limit
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def id_problem(doc_id: str) -> str | None:
    """Why ``doc_id`` cannot be a document or query id, or ``None`` if it can.

    An id goes into TREC runs and qrels, which are whitespace-separated text: it must be
    non-empty and printable in Python's sense (``str.isprintable``) without spaces. That
    refuses whitespace, control characters (NUL, tab, newline ...), invisible format
    characters (zero-width space, BOM), lone surrogates (not encodable as UTF-8),
    private-use and unassigned code points.
    """
    if doc_id and doc_id.isprintable() and " " not in doc_id:  # the common case, two C calls
        return None
    if not doc_id:
        return "is empty"
    for ch in doc_id:
        if ch.isspace():
            return "contains whitespace"
        if not ch.isprintable():
            cat = unicodedata.category(ch)
            kind = _CATEGORY_WORDS.get(cat, "a non-printable character")
            return f"contains {kind} U+{ord(ch):04X}"
    raise AssertionError("unreachable: a printable id without spaces has no problem")


_CATEGORY_WORDS = {
    "Cc": "a control character",
    "Cf": "an invisible format character",
    "Cs": "a lone surrogate (not valid Unicode text)",
    "Co": "a private-use character",
    "Cn": "an unassigned code point",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def check_id(
    raw: object,
    *,
    path: str | PathLike[str] | None = None,
    line: int | None = None,
    field: str = "id",
    record: bool = False,
) -> str:
    """A document or query id as every reader accepts it: a string, or an integer (JSON ids
    like ``17`` become ``"17"``), passing :func:`id_problem`. Anything else (``None``,
    floats, booleans, objects) raises :class:`InputError` naming ``path``/``line``/``field``.
    """
    if type(raw) is not str:
        if raw is None:
            raise InputError("missing", path=path, line=line, field=field, record=record)
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise InputError(
                f"expected a string or integer, got {json_type_name(raw)}",
                path=path,
                line=line,
                field=field,
                record=record,
            )
        raw = str(raw)
    problem = id_problem(raw)
    if problem is not None:
        raise InputError(f"id {raw!r} {problem}", path=path, line=line, field=field, record=record)
    return raw


def _check_ids(ids: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    for i, s in enumerate(ids):
        if not isinstance(s, str):
            raise TypeError(f"id at row {i} is {type(s).__name__}, not str")
        check_id(s, line=i + 1, record=True)
        j = seen.setdefault(s, i)
        if j != i:
            raise InputError(f"duplicate id {s!r} (first at record {j + 1})", line=i + 1, field="id", record=True)
    return ids
