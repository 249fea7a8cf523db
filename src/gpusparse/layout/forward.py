"""The collection in document-major form, built from the inverted lists (the forward copy).

The doc-parallel kernel walks it, and the tiled engine's rescoring reads a candidate's ~120
postings from it in order instead of binary-searching each query term's list (8 bytes a
posting more on the device).
"""

from __future__ import annotations

import torch

from .postings import PostingLists, real_postings


def forward_index(index: PostingLists, *, chunk: int = 1 << 23) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The collection in document-major CSR form, built from the inverted index.

    Real postings (padding skipped) are visited in list order, ``chunk`` at a time: each
    piece is stably sorted by document and written after the postings its documents already
    have, so terms stay ascending inside each document. Built on the index's device;
    nothing is cached. Temporaries: about 60 bytes per posting of a piece (2**23: ~0.5 GB)
    plus two int64 ``[N]`` counters.

    Returns:
        ``(indptr, terms, weights)``: int64 ``[N + 1]``, int32 ``[nnz]``, float32 ``[nnz]``;
        document ``d``'s terms are ``terms[indptr[d]:indptr[d + 1]]``.
    """
    if not isinstance(index, PostingLists):
        raise TypeError(f"index must be a gpusparse.Index, not {type(index).__name__}")
    dev, n = index.device, index.n_docs
    counts = torch.zeros(n, dtype=torch.int64, device=dev)
    for _, _, _, pos in real_postings(index, chunk):
        counts += torch.bincount(index.doc_ids[pos].to(torch.int64), minlength=n)
    indptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=indptr[1:])
    nnz = int(indptr[-1])
    terms = torch.empty(nnz, dtype=torch.int32, device=dev)
    weights = torch.empty(nnz, dtype=torch.float32, device=dev)
    filled = indptr[:-1].clone()  # next free slot of each document
    for _, _, term, pos in real_postings(index, chunk):
        doc = index.doc_ids[pos].to(torch.int64)
        order = torch.sort(doc, stable=True).indices  # by document, terms ascending inside
        doc = doc[order]
        rank = torch.arange(doc.numel(), device=dev) - torch.searchsorted(doc, doc)  # inside its document
        dest = filled[doc] + rank
        terms[dest] = term[order].to(torch.int32)
        weights[dest] = index.scores[pos[order]]
        filled += torch.bincount(doc, minlength=n)
    return indptr, terms, weights


def forward_copy(index: PostingLists) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward_index` of ``index``, built once per index object (kept in its
    :attr:`~gpusparse.layout.postings.PostingLists.derived` state)."""
    if index.derived.forward is None:
        index.derived.forward = forward_index(index)
    return index.derived.forward
