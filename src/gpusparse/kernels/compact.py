"""The one-launch compaction of a tiled wave's candidates (``cuda/compact.cu``), a block per query.

The block finds the k-th largest candidate value's leading 16 bits (a lower bound of it), raises
the query's threshold ``theta`` to them, and drops in place the candidates below theta's margin;
the rule is
:func:`gpusparse.engines.tiled.waves.compact_torch`'s, which is its reference.
"""

from __future__ import annotations

import numpy as np
import torch

from .cupy_launch import available, check_tensors, device_index, launch, load_kernel, pointer

__all__ = ["SOURCE", "available", "compact_candidates"]

SOURCE = "compact.cu"  # in kernels/cuda/
THREADS = 512  # the kernel's NT
# Batches of at most this many queries keep each row's first CACHE_VALUES candidate values in
# shared memory during the selection (128 KiB a block: few blocks fit an SM, which a small
# batch does not need; a larger batch's many blocks are better served by the cache-less build).
CACHE_MAX_BATCH = 8
CACHE_VALUES = 1 << 14


def compact_candidates(
    theta: torch.Tensor,
    count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    delta: torch.Tensor,
    k: int,
    most: int,
    *,
    cache: int | None = None,
    overflow: torch.Tensor | None = None,
) -> None:
    """:func:`gpusparse.engines.tiled.waves.compact_torch` in one launch (a block per query), in place.

    ``theta`` int64 ``[B]``, ``count`` int32 ``[B]``, ``cand_doc`` int32 and ``cand_val``
    int64 ``[B, cap]``, ``delta`` int64 ``[B]``, contiguous on one CUDA device; ``most`` is the
    largest count (every count is at most ``cap``). ``cache``: candidate values of a row held
    in shared memory during the selection (default: :data:`CACHE_VALUES` for batches of at most
    :data:`CACHE_MAX_BATCH` queries, else none); the result does not depend on it.
    ``overflow`` (bool ``[B]``, optional): set, in place, on each row whose count exceeds ``cap``
    (candidates counted but not stored), as read before the compaction rewrites the count
    (``overflow |= count > cap`` without its two launches).
    """
    dev = theta.device
    check_tensors(
        {
            "theta": (theta, torch.int64),
            "count": (count, torch.int32),
            "cand_doc": (cand_doc, torch.int32),
            "cand_val": (cand_val, torch.int64),
            "delta": (delta, torch.int64),
            **({} if overflow is None else {"overflow": (overflow, torch.bool)}),
        },
        dev,
    )
    b, cap = cand_val.shape
    if overflow is not None and overflow.shape != (b,):
        raise ValueError("overflow must be bool [B]")
    if b == 0 or most == 0:
        if overflow is not None:  # nothing to compact (rare): the check alone
            overflow |= count > cap
        return
    if cache is None:
        cache = CACHE_VALUES if b <= CACHE_MAX_BATCH else 0
    cache = max(0, min(cache, cap, most, CACHE_VALUES))
    kernel = load_kernel(SOURCE, "compact_candidates", device=device_index(dev), max_dynamic_shared=CACHE_VALUES * 8)
    args = [pointer(x) for x in (theta, count, cand_doc, cand_val, delta)]
    ints = (np.int32(k), np.int32(cap), np.int32(most), np.int32(cache))
    flags = pointer(overflow) if overflow is not None else np.uint64(0)
    launch(kernel, (b,), (THREADS,), (*args, *ints, flags), device=dev, shared_mem=cache * 8)
