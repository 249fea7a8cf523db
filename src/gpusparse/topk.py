"""Exact top-k with a deterministic tie-break: score descending, then document id ascending.

``torch.topk`` does not define which of several equal scores it returns. We rank by one
int64 key per (query, document) instead: the float32 score's bit pattern (monotonic for
scores ≥ 0) in the high bits and the complement of the document id in the low 31 bits,
so a larger key means a higher score or, at equal scores, a lower document id.
"""

from __future__ import annotations

import torch

from .kernels import rowsort

_ID_BITS = 31
_ID_MASK = (1 << _ID_BITS) - 1


def encode_keys(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 ranking keys of non-negative float32 ``scores`` with int ``ids`` < 2**31."""
    bits = scores.contiguous().view(torch.int32).to(torch.int64)
    return (bits << _ID_BITS) | (_ID_MASK - ids.to(torch.int64))


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_keys`: ``(float32 scores, int64 ids)``."""
    scores = (keys >> _ID_BITS).to(torch.int32).view(torch.float32)
    ids = _ID_MASK - (keys & _ID_MASK)
    return scores, ids


def top_keys(keys: torch.Tensor, k: int, count: torch.Tensor | None = None) -> torch.Tensor:
    """The ``min(k, W)`` largest of each row of ranking keys ``[B, W]`` (non-negative, 0 for
    an empty slot, distinct otherwise), sorted descending: ``torch.topk``'s values. On a GPU
    rows of at most :data:`gpusparse.kernels.rowsort.MAX_WIDTH` keys take one kernel instead
    of ``torch.topk``'s ten or so launches. ``count`` (int32 ``[B]``, optional): keys past a
    row's first ``count`` are 0, and the kernel need not read them."""
    if keys.is_cuda and keys.shape[1] <= rowsort.MAX_WIDTH and rowsort.available():
        return rowsort.top_keys_cuda(keys.contiguous(), k, count)
    return torch.topk(keys, min(k, keys.shape[1]), dim=1, largest=True, sorted=True).values


def topk_by_key(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``min(k, C)`` of each row of ``scores`` ``[B, C]`` whose documents are ``ids`` ``[B, C]``."""
    keys = encode_keys(scores, ids)
    return decode_keys(torch.topk(keys, min(k, keys.shape[1]), dim=1, largest=True, sorted=True).values)


def certified_candidates(approx: torch.Tensor, k: int, n_terms: torch.Tensor) -> torch.Tensor:
    """Columns of ``approx`` ``[B, W]`` that may hold a row's exact top-k: ``[B, C]`` indices.

    ``approx`` are sums of ``n_terms[b]`` non-negative products computed in float32 or
    float64 in any order, so each is within a relative error ``γ = (n + 1)·u / (1 − (n + 1)·u)``
    of the exact score (``u`` the unit roundoff; the ``+1`` covers rounding the products).
    With ``T`` the k-th largest approximate score, k documents have exact score ≥ ``T/(1+γ)``,
    hence every document of the exact top-k has approximate score ≥ ``T·(1−γ)/(1+γ)``; one
    more float32 ulp of slack admits documents whose float32 score ties with the k-th.
    The returned columns include all of those (and possibly a few more), ordered by
    approximate score; rows with fewer candidates are filled with other columns.
    """
    b, width = approx.shape
    kk = min(k, width)
    if kk == 0 or b == 0:
        return torch.zeros((b, 0), dtype=torch.int64, device=approx.device)
    u = 2.0**-53 if approx.dtype == torch.float64 else 2.0**-24
    g = (n_terms.to(torch.float64) + 1) * u
    g = g / (1 - g)
    kth = torch.topk(approx, kk, dim=1, sorted=True).values[:, -1].to(torch.float64)
    # Results are ranked by the float32 rounding of the canonical score, so a document up to
    # one float32 ulp below the k-th can still tie with it (and win on a lower id).
    thr = (kth * (1 - g) / (1 + g) * (1 - 2.0**-22)).to(approx.dtype)
    thr = torch.nextafter(thr, torch.zeros_like(thr))  # round the bound down, never up
    n_cand = ((approx >= thr[:, None]) & (approx > 0)).sum(1)
    c = max(int(n_cand.max()), kk)
    return torch.topk(approx, c, dim=1, sorted=True).indices


def merge_topk(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two per-row top-k lists (disjoint ids) into one, same order rules."""
    keys = torch.cat([encode_keys(*a), encode_keys(*b)], dim=1)
    kk = min(k, keys.shape[1])
    return decode_keys(torch.topk(keys, kk, dim=1, largest=True, sorted=True).values)


def merge_results(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of padded result lists laid side by side: ``[B, C]`` float32 ``scores`` and int
    ``ids`` (distinct in a row), where id ``-1`` or score ``0`` marks an empty slot.

    Returns ``(scores, ids)`` ``[B, k]`` ranked by score descending, then id ascending, padded
    with ``0`` / ``-1`` (the contract of :func:`gpusparse.search.search`), on the input's device.
    Merging shards' or segments' top-k lists with their global ids this way gives the top-k
    of one index over all their documents.
    """
    return merge_keys(result_keys(scores, ids), k)


def result_keys(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One int64 ranking key per slot of padded result lists (see :func:`merge_results`):
    empty slots (id ``-1`` or score ``0``) get key 0, below every real result's."""
    ok = (ids >= 0) & (scores > 0)
    keys = encode_keys(torch.where(ok, scores, torch.zeros_like(scores)), ids.clamp_min(0))
    return torch.where(ok, keys, torch.zeros_like(keys))


def merge_keys(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` results of :func:`result_keys` keys ``[B, C]``, padded as :func:`merge_results`'s."""
    b, c = keys.shape
    out_s = torch.zeros((b, k), dtype=torch.float32, device=keys.device)
    out_i = torch.full((b, k), -1, dtype=torch.int64, device=keys.device)
    if c == 0:
        return out_s, out_i
    top = top_keys(keys, k)
    s, i = decode_keys(top)
    hit = top > 0
    kk = top.shape[1]
    out_s[:, :kk] = torch.where(hit, s, torch.zeros_like(s))
    out_i[:, :kk] = torch.where(hit, i, torch.full_like(i, -1))
    return out_s, out_i
