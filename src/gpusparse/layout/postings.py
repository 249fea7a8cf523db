"""The posting lists of an index, laid out as in the GPUSparse paper, and their one builder.

Layout (all posting lists concatenated, one flat array each):

* ``doc_ids`` int32 ``[P]``: internal document numbers, ascending inside each list;
* ``scores`` float32 ``[P]``: the document's weight for the list's term;
* per term ``t`` of the vocabulary: ``offsets[t]`` (int64, start of its list),
  ``lengths[t]`` (int32, real postings), ``padded_lengths[t]`` (int32, ``lengths``
  rounded up to a multiple of 32, the warp size; 0 for an empty list) and
  ``max_scores[t]`` (float32, the list's largest weight, 0 for an empty list);
* padding entries are ``doc_id = -1, score = 0``.

Internal document numbers are row numbers of the collection the lists were built from;
``ids`` maps them to the collection's string ids. :class:`PostingLists` is the data that
layouts, kernels and engines read; the public :class:`gpusparse.Index` adds building,
saving and searching on top of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from ..collection import SparseCollection
from ..vocab import Vocabulary
from .derived import DerivedState, same_device

if TYPE_CHECKING:
    from ..quantize import Quantization

PAD = 32
DEFAULT_BUILD_CHUNK = 1 << 25  # postings per build step: ~1.5 GB of temporaries at most
MAX_DOCS = 2**31 - 1  # doc ids are int32

ARRAYS = ("doc_ids", "scores", "offsets", "lengths", "padded_lengths", "max_scores")


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


def empty_lists(lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The padded lists' arrays for lists of ``lengths`` postings (int64 ``[V]``, on the device
    they go to), to be filled: ``(padded, offsets, doc_ids, scores, max_scores)``, each list
    padded to a multiple of :data:`PAD` with doc id -1 and score 0."""
    device, n_terms = lengths.device, lengths.numel()
    padded = (lengths + (PAD - 1)) // PAD * PAD
    offsets = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    doc_ids = torch.full((total,), -1, dtype=torch.int32, device=device)
    scores = torch.zeros(total, dtype=torch.float32, device=device)
    max_scores = torch.zeros(n_terms, dtype=torch.float32, device=device)
    return padded, offsets, doc_ids, scores, max_scores


def list_arrays(
    doc_ids: torch.Tensor,
    scores: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    padded: torch.Tensor,
    max_scores: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The padded lists' arrays by name, as :class:`PostingLists` takes them (lengths int32)."""
    return {
        "doc_ids": doc_ids,
        "scores": scores,
        "offsets": offsets,
        "lengths": lengths.to(torch.int32),
        "padded_lengths": padded.to(torch.int32),
        "max_scores": max_scores,
    }


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
    padded, offsets, doc_ids, scores, max_scores = empty_lists(lengths)
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
    return list_arrays(doc_ids, scores, offsets, lengths, padded, max_scores)


def _spans(n_rows: int, indptr: np.ndarray, chunk: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` holding about ``chunk`` postings each (a row is never split)."""
    if n_rows == 0:
        return []
    cuts = np.searchsorted(indptr, np.arange(chunk, int(indptr[-1]), chunk), side="left")
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, n_rows), [n_rows]]))
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


class PostingLists:
    """An inverted index's arrays (see the module docstring), its vocabulary and document ids.

    ``derived`` holds what is built from the arrays on demand (forward copy, tiled layouts,
    host statistics, CUDA graphs): see :class:`~gpusparse.layout.derived.DerivedState`.
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
        missing = [k for k in ARRAYS if k not in arrays]
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
        self.derived = DerivedState()

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

    @property
    def lists_resident(self) -> bool:
        """Whether the padded lists are on :attr:`device` (see
        :class:`~gpusparse.layout.resident.TiledResident`, a view whose lists are not)."""
        return True

    def arrays(self) -> dict[str, torch.Tensor]:
        """The index arrays by name."""
        return {k: getattr(self, k) for k in ARRAYS}

    def to(self, device: str | torch.device):  # -> Self
        """The lists on ``device``: ``self`` if already there (``"cuda"`` and ``"cuda:0"`` name
        the same device while 0 is the current one), else a copy of the same class that starts
        with no derived structures but the host statistics."""
        device = torch.device(device)
        if same_device(self.device, device):
            return self
        arrays = {k: getattr(self, k).to(device) for k in ARRAYS}
        out = type(self).__new__(type(self))
        PostingLists.__init__(
            out,
            arrays,
            ids=self._ids,
            vocab=self.vocab,
            n_docs=self._n_docs,
            n_empty_docs=self._n_empty_docs,
            quantization=self.quantization,
        )
        out.derived.share_host_statistics(self.derived)
        return out

    def resident_on(self, device: str | torch.device):  # -> Self
        """The lists on ``device`` for searching there: ``self`` if already there, else a copy
        (:meth:`to`) that is kept in :attr:`derived` (for the latest device only), so that
        repeated searches on another device copy the arrays, and build their layouts, once.
        The kept copy holds device memory until another device is asked for or this object
        is dropped; call :meth:`to` yourself to manage copies explicitly."""
        device = torch.device(device)
        if same_device(self.device, device):
            return self
        kept = self.derived.copy_on(device)
        if kept is None:
            kept = self.to(device)
            self.derived.keep_copy(device, kept)
        return kept

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

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_docs={self.n_docs}, n_postings={int(self.lengths.sum())}, device={self.device})"
        )


def real_postings(index: PostingLists, chunk: int = 1 << 23):
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


def posting_slabs(index: PostingLists, device: torch.device, chunk: int = 1 << 23):
    """``(term, doc, score, rank)`` of the real postings of ``index`` on ``device``, read from
    the padded arrays in contiguous slabs of ``chunk`` positions wherever they live (a host
    index's slabs are copied over one at a time): ``term``, ``doc`` and ``rank`` (the posting's
    place inside its list) int64, ``score`` float32, padding left out. Builders whose result
    does not depend on the order of the postings (the tiled layout) read them this way, so
    their temporaries on ``device`` stay bounded by ``chunk`` and a host index never has to be
    copied whole."""
    offsets = index.offsets.to(device, torch.int64)
    total = int(index.doc_ids.numel())
    for a in range(0, total, chunk):
        b = min(total, a + chunk)
        doc = index.doc_ids[a:b].to(device, non_blocking=True)
        score = index.scores[a:b].to(device, non_blocking=True)
        pos = torch.arange(a, b, device=device)
        term = torch.searchsorted(offsets, pos, right=True) - 1  # empty lists share the next one's offset
        real = doc >= 0
        term = term[real]
        yield term, doc[real].to(torch.int64), score[real], pos[real] - offsets[term]


def bisect_lists(doc_ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, value: int | torch.Tensor) -> torch.Tensor:
    """For each list slice ``doc_ids[lo:hi]`` (ascending), the first position with id ≥ ``value``.

    ``value`` is one document number or a tensor of them, one per slice. A vectorised
    binary search: all slices advance together for ``ceil(log2(longest slice + 1))``
    steps, with one device synchronisation in all (to learn the longest slice).
    """
    lo, hi = lo.clone(), hi.clone()
    if lo.numel() == 0:
        return lo
    steps = int((hi - lo).max()).bit_length()
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        below = doc_ids[torch.where(active, mid, torch.zeros_like(mid))].to(torch.int64) < value
        lo = torch.where(active & below, mid + 1, lo)
        hi = torch.where(active & ~below, mid, hi)
    return lo
