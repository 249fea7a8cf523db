"""Exact top-k with a deterministic tie-break: score descending, then document id ascending.

``torch.topk`` does not define which of several equal scores it returns. We rank by one
int64 key per (query, document) instead: the float32 score's bit pattern (monotonic for
scores ≥ 0) in the high bits and the complement of the document id in the low 31 bits,
so a larger key means a higher score or, at equal scores, a lower document id.
"""

from __future__ import annotations

import torch

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


def topk_with_ties(scores: torch.Tensor, k: int, *, base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``min(k, width)`` of each row of non-negative ``scores`` ``[B, width]``.

    Column ``j`` is document ``base + j``. Returns ``(scores, ids)`` sorted by score
    descending, then id ascending.
    """
    if scores.dtype != torch.float32:
        raise TypeError("scores must be float32")
    b, width = scores.shape
    kk = min(k, width)
    ids = torch.arange(base, base + width, device=scores.device, dtype=torch.int64)
    keys = encode_keys(scores, ids.expand(b, width))
    top = torch.topk(keys, kk, dim=1, largest=True, sorted=True).values
    return decode_keys(top)


def merge_topk(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two per-row top-k lists (disjoint ids) into one, same order rules."""
    keys = torch.cat([encode_keys(*a), encode_keys(*b)], dim=1)
    kk = min(k, keys.shape[1])
    return decode_keys(torch.topk(keys, kk, dim=1, largest=True, sorted=True).values)
