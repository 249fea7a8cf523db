"""An exact reference that reads the collection chunk by chunk: for checking a search of a
collection that is never held whole (:mod:`gpusparse.synthetic_stream`,
:func:`gpusparse.layout.chunked.build_tiled_chunks`).

Each chunk (canonical CSR, documents numbered from the chunk's first) is scored against
every query in float64: a document's matching postings are added in its row's order, which
is ascending term order, so each sum is the canonical one of the search contract
(:mod:`gpusparse.exact`) — the additions of one step go to distinct documents, so their
order does not matter — then rounded once to float32. A running top-k (score descending,
document ascending) is merged chunk after chunk. Memory: one chunk, plus a few bytes a
posting of one query's matches in it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..exact import pad_results
from ..quantize import Quantization, quantize_csr
from ..queries import QueryBatch
from ..topk import merge_topk, topk_by_key

CSR = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def canonical_chunk_scores(csr: CSR, terms: torch.Tensor, weights: torch.Tensor, n_terms: int) -> torch.Tensor:
    """float64 ``[n_rows]``: each row's canonical score against one query (``terms``
    ascending, ``weights`` float32, on the chunk's device)."""
    indptr, d_terms, d_weights = csr
    dev = d_terms.device
    q = torch.zeros(n_terms, dtype=torch.float64, device=dev)
    q[terms.to(dev, torch.int64)] = weights.to(dev, torch.float64)
    n = indptr.numel() - 1
    acc = torch.zeros(n, dtype=torch.float64, device=dev)
    ends = indptr.to(dev)
    # slabs of postings bound the temporaries; a row cut by a slab's end gets its later
    # matches in the next slab, after its earlier ones: the order is kept
    step = 1 << 26
    for a in range(0, d_terms.numel(), step):
        wq = q[d_terms[a : a + step].to(torch.int64)]
        pos = wq.nonzero().squeeze(1)
        if pos.numel() == 0:
            continue
        prod = wq[pos] * d_weights[a : a + step][pos].to(torch.float64)  # exact: float32 × float32
        row = torch.searchsorted(ends, pos + a, right=True) - 1
        rank = torch.arange(pos.numel(), device=dev) - torch.searchsorted(row, row)  # match number in its row
        for j in range(int(rank.max()) + 1):
            sel = rank == j
            acc.index_add_(0, row[sel], prod[sel])
    return acc


def chunk_reference_search(
    chunks: Iterable[CSR],
    batch: QueryBatch,
    k: int,
    n_terms: int,
    *,
    quantization: Quantization | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` ``(scores float32, ids int64)`` ``[B, k]`` of the queries of ``batch``
    over the documents that ``chunks`` yields in order (numbered on from chunk to chunk),
    quantized with ``quantization`` first when given (as a quantized index's documents; the
    queries must be quantized already, as a quantized index's search does). On the chunks'
    device."""
    terms, weights, lengths = batch.host_arrays()
    b = len(lengths)
    best = None
    doc0 = 0
    dev = None
    for csr in chunks:
        if quantization is not None:
            csr, _ = quantize_csr(*csr, quantization.bits, quantization.step)
        dev = csr[1].device
        n = csr[0].numel() - 1
        scores = torch.zeros((b, n), dtype=torch.float32, device=dev)
        for r in range(b):
            t, w = torch.from_numpy(terms[r, : lengths[r]]), torch.from_numpy(weights[r, : lengths[r]])
            scores[r] = canonical_chunk_scores(csr, t, w, n_terms).to(torch.float32)
        ids = torch.arange(doc0, doc0 + n, dtype=torch.int64, device=dev).expand(b, n)
        top = topk_by_key(scores, ids, k)
        best = top if best is None else merge_topk(best, top, k)
        doc0 += n
    return pad_results(best, k, b, dev if dev is not None else torch.device("cpu"))
