"""Host statistics of an index read before each search, computed once per index object."""

from __future__ import annotations

import numpy as np
import torch

from .derived import same_device
from .postings import PostingLists


def max_scores_host(index: PostingLists) -> np.ndarray:
    """The lists' largest weights (float64, on the host)."""
    d = index.derived
    if d.max_scores_host is None:
        d.max_scores_host = index.max_scores.cpu().numpy().astype(np.float64)
        d.max_score = float(d.max_scores_host.max()) if d.max_scores_host.size else 0.0
    return d.max_scores_host


def max_scores_on(index: PostingLists, device: torch.device) -> torch.Tensor:
    """The lists' largest weights (float32) on ``device``: the index's own tensor there, or a
    copy kept with the index."""
    if same_device(index.max_scores.device, device):
        return index.max_scores
    d = index.derived
    if d.max_scores_device is None or not same_device(d.max_scores_device.device, device):
        d.max_scores_device = index.max_scores.to(device)
    return d.max_scores_device


def max_score(index: PostingLists) -> float:
    """The index's largest weight (0 for an empty index)."""
    max_scores_host(index)
    return index.derived.max_score  # type: ignore[return-value]


def min_weight(index: PostingLists) -> float:
    """The index's smallest document weight (+inf for an empty index)."""
    d = index.derived
    if d.min_weight is None:
        best = float("inf")
        for a in range(0, index.doc_ids.numel(), 1 << 26):  # padding (doc -1) left out
            real = index.doc_ids[a : a + (1 << 26)] >= 0
            if bool(real.any()):
                best = min(best, float(index.scores[a : a + (1 << 26)][real].min()))
        d.min_weight = best
    return d.min_weight
