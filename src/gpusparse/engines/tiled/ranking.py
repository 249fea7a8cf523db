"""From the tiled engine's candidates to the exact top-k: canonical scores where the
fixed-point value does not settle them, then the tie-broken ranking (:func:`rank_candidates`).

Canonical scores come from the padded lists (:func:`gpusparse.exact.exact_scores`), or, for
an index whose lists are not on the device (:class:`~gpusparse.layout.resident.TiledResident`),
from the tiled layout itself (:func:`tiled_exact_scores`): the same float32 weights, added in
the same order, so the same bits."""

from __future__ import annotations

import torch

from ...exact import exact_scores, pad_results
from ...kernels import rescore
from ...layout.postings import PostingLists
from ...layout.tiled import TiledIndex
from ...queries import QueryBatch
from ...topk import decode_keys, top_keys, topk_by_key
from .fixed_point import FixedPoint


def rank_candidates(
    index: PostingLists,
    batch: QueryBatch,
    fp: FixedPoint,
    docs: torch.Tensor,
    vals: torch.Tensor,
    k: int,
    layout: TiledIndex | None = None,
    *,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical float32 scores of the candidates, then the tie-broken top-k (padded to ``k``).
    ``floor`` (float32 ``[B]``): candidates whose score is surely below it are left out.

    On a GPU one kernel turns the candidates into ranking keys (rescoring the uncertain ones
    from ``layout.forward``, or by binary searches narrowed by ``layout.list_pos``); the PyTorch
    steps below are its reference.
    """
    b = docs.shape[0]
    dev = docs.device
    from_tiles = not index.lists_resident
    if from_tiles and layout is None:
        raise ValueError("rescoring without the lists on the device needs the tiled layout")
    if docs.is_cuda and rescore.available():  # one launch over all slots, no host sync
        lists = (None,) * 4 if from_tiles else (index.doc_ids, index.scores, index.offsets, index.lengths)
        keys = rescore.candidate_keys_cuda(
            *lists,
            batch.padded_terms.contiguous(), batch.padded_weights.contiguous(),
            docs.to(torch.int32), vals.contiguous(), fp.delta, fp.scale,
            list_pos=layout.list_pos if layout is not None and not from_tiles else None,
            tile_bits=layout.tile_bits if layout is not None else 0,
            floor=floor, forward=layout.forward if layout is not None else None,
            tiled=layout if from_tiles else None,
        )  # fmt: skip
        return pad_results(decode_keys(top_keys(keys, k)) if docs.shape[1] else None, k, b, dev)
    present = docs >= 0
    v = vals.to(torch.float64)
    margin = fp.delta[:, None].to(torch.float64) + v * 2.0**-50
    scale = fp.scale[:, None]
    low = ((v - margin).clamp_min(0) / scale).to(torch.float32)
    high = ((v + margin) / scale).to(torch.float32)
    if floor is not None:  # surely below the merged k-th: not a result here
        present = present & (high >= floor[:, None])
    scores = torch.where(present, low, torch.zeros_like(low))
    unsure = present & (low != high)
    if bool(unsure.any()):
        r, c = unsure.nonzero(as_tuple=True)
        if from_tiles:
            scores[r, c] = tiled_exact_scores(layout, batch, r, docs[r, c])  # type: ignore[arg-type]
        else:
            scores[r, c] = exact_scores(index, batch, r, docs[r, c])
    ids = torch.where(present, docs, torch.full_like(docs, (1 << 31) - 1))
    scores = torch.where(present, scores, torch.zeros_like(scores))
    best = topk_by_key(scores, ids, k) if docs.shape[1] else None
    return pad_results(best, k, b, dev)


def tiled_exact_scores(
    layout: TiledIndex, batch: QueryBatch, rows: torch.Tensor, docs: torch.Tensor, *, max_cells: int = 1 << 22
) -> torch.Tensor:
    """Canonical scores of the pairs (query ``rows[i]``, document ``docs[i]``) read from the
    tiled layout: float32 ``[M]``, the bits of :func:`gpusparse.exact.exact_scores`.

    Document ``d`` lies (at position ``d``, or ``pos_of[d]`` in a layout of its own order) in
    tile ``d >> tile_bits`` at offset ``o = d & mask``; its weight for
    a query term is in the dense row of the (tile, term) segment when it has one (0: absent),
    else found by binary search for ``o`` among the segment's ascending offsets. Weights are
    the stored ones (float32, packed or not, or 8-bit levels times the step, exact); the products are added
    in float64 in the query's term order and rounded once. The PyTorch reference of
    ``canonical_tiled`` in ``rescore.cu``.
    """
    if layout.wts.dtype == torch.int32:
        raise ValueError("this layout stores fixed-point integers (stored_fixed): rescoring needs its float32 weights")
    m = docs.numel()
    out = torch.zeros(m, dtype=torch.float32, device=docs.device)
    width = batch.padded_terms.shape[1]
    if m == 0 or width == 0:
        return out
    bits, v, n_sparse = layout.tile_bits, layout.n_terms, layout.n_sparse
    qw = batch.padded_weights.to(torch.float64)
    step = max(1, max_cells // width)

    def weight(w: torch.Tensor) -> torch.Tensor:
        return (w.to(torch.float32) * layout.step).to(torch.float64) if layout.quantized else w.to(torch.float64)

    for a in range(0, m, step):
        r, d = rows[a : a + step], docs[a : a + step, None].to(torch.int64)
        if layout.pos_of is not None:  # a layout in an order of its own: the document's position
            d = layout.pos_of[d].to(torch.int64)
        terms = batch.padded_terms[r]  # [M, T]
        valid = terms >= 0
        key = (d >> bits) * v + terms.clamp_min(0)
        o = d & ((1 << bits) - 1)
        row = layout.dense_rows(key)
        in_dense = valid & (row >= 0)
        w = torch.zeros(terms.shape, dtype=torch.float64, device=docs.device)
        if layout.n_dense:
            w = torch.where(in_dense, weight(layout.dense.reshape(-1)[(row.clamp_min(0) << bits) + o]), w)
        lo, hi = layout.segments(key)
        lo = torch.where(valid & ~in_dense, lo, hi)  # empty range: nothing to find
        end = hi
        for _ in range(int((hi - lo).max()).bit_length() if lo.numel() else 0):
            active = lo < hi
            mid = torch.where(active, (lo + hi) // 2, torch.zeros_like(lo))
            below = layout.offsets_at(mid) < o if n_sparse else torch.zeros_like(active)
            lo = torch.where(active & below, mid + 1, lo)
            hi = torch.where(active & ~below, mid, hi)
        at = lo.clamp_max(max(n_sparse - 1, 0))
        found = (lo < end) & (layout.offsets_at(at) == o) if n_sparse else torch.zeros_like(valid)
        if n_sparse:
            w = torch.where(found, weight(layout.weights_at(at)), w)
        prod = w * qw[r]  # absent terms: weight 0, product +0, the sum unchanged
        acc = torch.zeros(r.numel(), dtype=torch.float64, device=docs.device)
        for j in range(width):  # sequential: the canonical summation order
            acc += prod[:, j]
        out[a : a + step] = acc.to(torch.float32)
    return out
