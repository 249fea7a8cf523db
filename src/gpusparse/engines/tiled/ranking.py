"""From the tiled engine's candidates to the exact top-k: canonical scores where the
fixed-point value does not settle them, then the tie-broken ranking (:func:`rank_candidates`)."""

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
    if docs.is_cuda and rescore.available():  # one launch over all slots, no host sync
        keys = rescore.candidate_keys_cuda(
            index.doc_ids, index.scores, index.offsets, index.lengths,
            batch.padded_terms.contiguous(), batch.padded_weights.contiguous(),
            docs.to(torch.int32), vals.contiguous(), fp.delta, fp.scale,
            list_pos=layout.list_pos if layout is not None else None,
            tile_bits=layout.tile_bits if layout is not None else 0,
            floor=floor, forward=layout.forward if layout is not None else None,
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
        scores[r, c] = exact_scores(index, batch, r, docs[r, c])
    ids = torch.where(present, docs, torch.full_like(docs, (1 << 31) - 1))
    scores = torch.where(present, scores, torch.zeros_like(scores))
    best = topk_by_key(scores, ids, k) if docs.shape[1] else None
    return pad_results(best, k, b, dev)
