"""The GPU inverted index, laid out as in the GPUSparse paper, and its one builder.

Layout (all posting lists concatenated, one flat array each):

* ``doc_ids`` int32 ``[P]``: internal document numbers, ascending inside each list;
* ``scores`` float32 ``[P]``: the document's weight for the list's term;
* per term ``t`` of the vocabulary: ``offsets[t]`` (int64, start of its list),
  ``lengths[t]`` (int32, real postings), ``padded_lengths[t]`` (int32, ``lengths``
  rounded up to a multiple of 32, the warp size; 0 for an empty list) and
  ``max_scores[t]`` (float32, the list's largest weight, 0 for an empty list);
* padding entries are ``doc_id = -1, score = 0``.

Internal document numbers are row numbers of the collection the index was built from;
``ids`` maps them to the collection's string ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from .collection import SparseCollection
from .vocab import Vocabulary

if TYPE_CHECKING:
    from pathlib import Path

    from .quantize import Quantization
    from .search import SearchResults

PAD = 32
DEFAULT_BUILD_CHUNK = 1 << 25  # postings per build step: ~1.5 GB of temporaries at most
MAX_DOCS = 2**31 - 1  # doc ids are int32

_ARRAYS = ("doc_ids", "scores", "offsets", "lengths", "padded_lengths", "max_scores")


def real_postings(index: Index, chunk: int = 1 << 23):
    """``(a, b, term, position)`` for real postings ``a .. b-1`` of ``index``, in pieces of at
    most ``chunk``: postings numbered in list order (ascending term, then document) with
    padding skipped; ``term`` and ``position`` (in the flat arrays) are int64 ``[b - a]``.
    Builders that regroup the postings (tiled layout, document-major copy) walk them this way,
    so their temporaries stay bounded by ``chunk``."""
    dev = index.device
    lengths = index.lengths.to(torch.int64)
    ends = torch.cumsum(lengths, 0)
    list_start = ends - lengths
    total = int(ends[-1]) if ends.numel() else 0
    for a in range(0, total, chunk):
        b = min(total, a + chunk)
        flat = torch.arange(a, b, device=dev)
        term = torch.searchsorted(ends, flat, right=True)
        yield a, b, term, index.offsets[term] + (flat - list_start[term])


@dataclass(frozen=True)
class IndexStats:
    """Counts and sizes, as ``gpusparse info`` prints them."""

    n_docs: int
    n_terms: int
    n_nonempty_terms: int
    n_postings: int
    n_padded: int
    n_empty_docs: int
    bytes: int

    @property
    def padding_overhead(self) -> float:
        """Padding entries per real posting."""
        return (self.n_padded - self.n_postings) / self.n_postings if self.n_postings else 0.0


def build_inverted_index(
    collection: SparseCollection
    | tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray, torch.Tensor | np.ndarray, int],
    *,
    device: str | torch.device = "cpu",
    chunk_postings: int = DEFAULT_BUILD_CHUNK,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Build the paper's padded inverted-index arrays from a document collection.

    Postings are placed term-major with one stable sort per chunk of documents: documents
    are visited in order, so doc ids stay ascending inside every list. Peak memory is the
    output (the index itself) plus temporaries for ``chunk_postings`` postings, whatever
    the collection's size, so a collection that fits in memory once can be indexed.

    Args:
        collection: documents (row ``i`` becomes internal document ``i``), or canonical CSR
            arrays ``(indptr, indices, values, n_terms)`` as numpy arrays or tensors on any
            device (terms sorted and unique inside each row, weights > 0).
        device: where to build (and leave) the arrays: ``"cpu"`` or a CUDA device.
        chunk_postings: postings sorted per step; bounds the temporaries.
        progress: show a progress bar.

    Returns:
        The arrays named in this module's docstring, on ``device``.
    """
    if isinstance(collection, SparseCollection):
        indptr_any, terms_any, weights_any = collection.indptr, collection.indices, collection.values
        n_terms = len(collection.vocab)
    else:
        indptr_any, terms_any, weights_any, n_terms = collection
    indptr = np.asarray(indptr_any.cpu() if isinstance(indptr_any, torch.Tensor) else indptr_any, dtype=np.int64)
    terms_all = torch.as_tensor(terms_any)
    weights_all = torch.as_tensor(weights_any)
    n_docs = indptr.size - 1
    if n_docs > MAX_DOCS:
        raise ValueError(f"{n_docs} documents exceed the int32 doc-id limit of {MAX_DOCS}")
    if chunk_postings <= 0:
        raise ValueError("chunk_postings must be positive")
    device = torch.device(device)
    spans = _spans(n_docs, indptr, chunk_postings)

    # Pass 1: list lengths, in chunks so no temporary is as large as the collection.
    lengths = torch.zeros(n_terms, dtype=torch.int64, device=device)
    for a, b in spans:
        t = terms_all[indptr[a] : indptr[b]].to(device, torch.int64)
        lengths += torch.bincount(t, minlength=n_terms)
    padded = (lengths + (PAD - 1)) // PAD * PAD
    offsets = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())

    doc_ids = torch.full((total,), -1, dtype=torch.int32, device=device)
    scores = torch.zeros(total, dtype=torch.float32, device=device)
    max_scores = torch.zeros(n_terms, dtype=torch.float32, device=device)
    fill = offsets.clone()  # next free slot of each list

    # Pass 2: place postings.
    bar = tqdm(
        total=int(indptr[-1]), unit="post", unit_scale=True, desc="indexing", disable=not progress or None, leave=False
    )
    for a, b in spans:
        lo, hi = int(indptr[a]), int(indptr[b])
        if hi == lo:
            continue
        t = terms_all[lo:hi].to(device, torch.int64)
        w = weights_all[lo:hi].to(device, torch.float32)
        row_len = torch.from_numpy(np.diff(indptr[a : b + 1])).to(device)
        d = torch.repeat_interleave(torch.arange(a, b, device=device, dtype=torch.int32), row_len)
        order = torch.sort(t, stable=True).indices
        ts = t[order]
        counts = torch.bincount(ts, minlength=n_terms)
        first = torch.cumsum(counts, 0) - counts
        pos = fill[ts] + (torch.arange(ts.numel(), device=device) - first[ts])
        doc_ids[pos] = d[order]
        scores[pos] = w[order]
        fill += counts
        max_scores.scatter_reduce_(0, t, w, reduce="amax")
        bar.update(hi - lo)
    bar.close()
    return {
        "doc_ids": doc_ids,
        "scores": scores,
        "offsets": offsets,
        "lengths": lengths.to(torch.int32),
        "padded_lengths": padded.to(torch.int32),
        "max_scores": max_scores,
    }


def _spans(n_rows: int, indptr: np.ndarray, chunk: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` holding about ``chunk`` postings each (a row is never split)."""
    if n_rows == 0:
        return []
    cuts = np.searchsorted(indptr, np.arange(chunk, int(indptr[-1]), chunk), side="left")
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, n_rows), [n_rows]]))
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


class Index:
    """An exact inverted index over sparse document vectors.

    Build with :meth:`build`, persist with :meth:`save` / :meth:`load`, query with
    :meth:`search`. The arrays are public (see the module docstring for the layout).
    """

    def __init__(
        self,
        arrays: dict[str, torch.Tensor],
        *,
        ids: list[str] | None,
        vocab: Vocabulary,
        n_docs: int | None = None,
        n_empty_docs: int | None = None,
        quantization: Quantization | None = None,
    ) -> None:
        missing = [k for k in _ARRAYS if k not in arrays]
        if missing:
            raise ValueError(f"missing index arrays: {missing}")
        self.doc_ids: torch.Tensor = arrays["doc_ids"]
        self.scores: torch.Tensor = arrays["scores"]
        self.offsets: torch.Tensor = arrays["offsets"]
        self.lengths: torch.Tensor = arrays["lengths"]
        self.padded_lengths: torch.Tensor = arrays["padded_lengths"]
        self.max_scores: torch.Tensor = arrays["max_scores"]
        if ids is None and n_docs is None:
            raise ValueError("give the documents' ids or their number")
        self._ids = ids
        self._n_docs = len(ids) if ids is not None else int(n_docs)  # type: ignore[arg-type]
        self.vocab = vocab
        if len(self.offsets) != len(vocab):
            raise ValueError(f"index has {len(self.offsets)} terms but the vocabulary {len(vocab)}")
        self._n_empty_docs = n_empty_docs
        # Set when document weights are quantized levels (queries are then quantized too).
        self.quantization = quantization
        # Derived structures built on demand (e.g. the doc-parallel kernel's forward index).
        self.cache: dict[str, object] = {}

    # -- construction -------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        collection: SparseCollection,
        *,
        device: str | torch.device = "cpu",
        progress: bool = False,
        chunk_postings: int = DEFAULT_BUILD_CHUNK,
        quantize: int | None = None,
    ) -> Index:
        """Index ``collection`` (row ``i`` becomes internal document ``i``).

        Also accepts a scipy sparse matrix (columns are term ids). ``quantize=8`` stores
        8-bit impacts (see :mod:`gpusparse.quantize`): weights become ``level · step``
        (weights below half a step are dropped) and queries are quantized the same way at
        search time; the result is exact for the quantized vectors.
        """
        if not isinstance(collection, SparseCollection):
            collection = SparseCollection.from_scipy(collection)
        quantization = None
        if quantize is not None:
            from .quantize import quantize_collection

            collection, report = quantize_collection(collection, quantize)
            quantization = report.quantization
        arrays = build_inverted_index(collection, device=device, progress=progress, chunk_postings=chunk_postings)
        n_empty = int(np.count_nonzero(collection.row_lengths == 0))
        return cls(
            arrays, ids=list(collection.ids), vocab=collection.vocab, n_empty_docs=n_empty, quantization=quantization
        )

    @classmethod
    def from_csr(
        cls,
        indptr: torch.Tensor | np.ndarray,
        indices: torch.Tensor | np.ndarray,
        values: torch.Tensor | np.ndarray,
        vocab: Vocabulary,
        *,
        ids: list[str] | None = None,
        device: str | torch.device = "cpu",
        chunk_postings: int = DEFAULT_BUILD_CHUNK,
        quantize: int | None = None,
    ) -> Index:
        """Index canonical CSR arrays directly (e.g. a collection generated on the GPU).

        Rows must have sorted, unique term ids ``< len(vocab)`` and positive weights; they
        are not copied into a :class:`SparseCollection` first. Without ``ids`` documents are
        named ``"0"``, ``"1"``, ... ``quantize``: as in :meth:`build`.
        """
        n = int(indptr.shape[0]) - 1
        quantization = None
        if quantize is not None:
            from .quantize import quantize_csr

            (indptr, indices, values), report = quantize_csr(
                torch.as_tensor(indptr), torch.as_tensor(indices), torch.as_tensor(values), quantize
            )
            quantization = report.quantization
        arrays = build_inverted_index(
            (indptr, indices, values, len(vocab)), device=device, chunk_postings=chunk_postings
        )
        return cls(arrays, ids=ids, vocab=vocab, n_docs=n, quantization=quantization)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        mmap: bool = True,
        verify: bool = True,
    ) -> Index:
        """Load an index folder written by :meth:`save`.

        Args:
            path: the folder.
            device: where to put the arrays.
            mmap: map the files instead of reading them (CPU only; they are copied to a
                GPU anyway).
            verify: check every file's SHA-256 against the manifest (reads all bytes).

        A sharded folder (``gpusparse index --shards N``) loads whole: its shards joined into
        one index, the same as one build of all their documents
        (:func:`gpusparse.shards.load_sharded` loads some shards only).

        Raises:
            IndexFormatError: missing, truncated, corrupted, or written by a newer version.
        """
        from .shards import is_sharded, load_sharded
        from .storage import load_index

        if is_sharded(path):
            return load_sharded(path, device=device, mmap=mmap, verify=verify)[0]
        return load_index(cls, path, device=device, mmap=mmap, verify=verify)

    def save(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the index to folder ``path`` atomically (temporary folder, then rename).

        Refuses an existing ``path`` unless ``overwrite``; even then a failure leaves the
        old index in place.
        """
        from .storage import save_index

        save_index(self, path, overwrite=overwrite)

    def to(self, device: str | torch.device) -> Index:
        """A copy of the index with its arrays on ``device`` (``self`` if already there)."""
        device = torch.device(device)
        if self.doc_ids.device == device:
            return self
        arrays = {k: getattr(self, k).to(device) for k in _ARRAYS}
        return Index(
            arrays,
            ids=self._ids,
            vocab=self.vocab,
            n_docs=self._n_docs,
            n_empty_docs=self._n_empty_docs,
            quantization=self.quantization,
        )

    # -- queries ------------------------------------------------------------------------

    @property
    def n_docs(self) -> int:
        """Number of documents (internal ids ``0 .. n_docs - 1``)."""
        return self._n_docs

    @property
    def ids(self) -> list[str]:
        """The documents' string ids, by internal document number."""
        if self._ids is None:
            self._ids = [str(i) for i in range(self._n_docs)]
        return self._ids

    @property
    def device(self) -> torch.device:
        """Where the arrays live."""
        return self.doc_ids.device

    def arrays(self) -> dict[str, torch.Tensor]:
        """The index arrays by name."""
        return {k: getattr(self, k) for k in _ARRAYS}

    def stats(self) -> IndexStats:
        """Documents, terms, postings, padding and bytes."""
        n_empty = self._n_empty_docs
        if n_empty is None:
            real = self.doc_ids[self.doc_ids >= 0]
            n_empty = self.n_docs - int(torch.unique(real).numel())
            self._n_empty_docs = n_empty
        return IndexStats(
            n_docs=self.n_docs,
            n_terms=len(self.vocab),
            n_nonempty_terms=int((self.lengths > 0).sum()),
            n_postings=int(self.lengths.sum()),
            n_padded=int(self.doc_ids.numel()),
            n_empty_docs=n_empty,
            bytes=sum(t.numel() * t.element_size() for t in self.arrays().values()),
        )

    def search(
        self,
        queries: SparseCollection | object,
        k: int = 1000,
        *,
        batch_size: int | None = None,
        device: str | torch.device | None = None,
        kernel: str = "auto",
        memory_budget: int | None = None,
        progress: bool = False,
    ) -> SearchResults:
        """Exact top-``k`` documents for each query.

        Args:
            queries: a :class:`SparseCollection`, a scipy sparse matrix (columns are term
                ids) or a list of ``{token: weight}`` dicts.
            k: results per query (``k > n_docs`` is allowed; see below).
            batch_size: queries scored together (default: chosen from the memory budget).
            device: where to compute (default: where the index is).
            kernel: ``"auto"`` or a kernel name (see :func:`gpusparse.search.available_kernels`).
            memory_budget: bytes of temporaries allowed (default 1 GiB).
            progress: show a progress bar over query batches.

        Returns:
            :class:`~gpusparse.search.SearchResults` ``(scores, ids)``, both ``[n_queries, k]``
            CPU tensors: float32 scores, descending, and int64 internal document numbers,
            ties broken by the lower document number. Only documents sharing a term with
            the query (score > 0) are results; the remaining slots hold id ``-1`` and
            score ``0``.
        """
        from .search import search

        return search(
            self,
            queries,
            k,
            batch_size=batch_size,
            device=device,
            kernel=kernel,
            memory_budget=memory_budget,
            progress=progress,
        )

    def retrieve(
        self, queries: SparseCollection, k: int = 1000, **kwargs: object
    ) -> dict[str, list[tuple[str, float]]]:
        """Like :meth:`search`, but ``{query id: [(document id, score), ...]}`` with string ids."""
        from .search import as_queries

        queries = as_queries(queries, self.vocab)
        res = self.search(queries, k, **kwargs)  # type: ignore[arg-type]
        out: dict[str, list[tuple[str, float]]] = {}
        for qi, qid in enumerate(queries.ids):
            row = [
                (self.ids[d], float(s))
                for d, s in zip(res.ids[qi].tolist(), res.scores[qi].tolist(), strict=True)
                if d >= 0
            ]
            out[qid] = row
        return out

    def __repr__(self) -> str:
        return f"Index(n_docs={self.n_docs}, n_postings={int(self.lengths.sum())}, device={self.device})"
