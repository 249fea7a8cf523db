"""The top-k of each row of int64 ranking keys, sorted, by one CUDA block per row.

``torch.topk`` on a ``[256, 3024]`` row of keys takes ~0.1 ms in about ten launches (a radix
select, then a sort of the k kept); a row here is loaded into shared memory (its first
``count`` keys, padded with 0 to a power of two) and sorted by a bitonic network in one
launch. Keys are :func:`gpusparse.topk.encode_keys` values: non-negative, 0 for an empty
slot, distinct otherwise, so the order, and the result, are the same as ``torch.topk``'s.

The NCCL merge of the processes' ranked lists has its two kernels here too: one packs a
process's results into keys, one merges the gathered lists (:func:`pack_results_cuda`,
:func:`merge_gathered_cuda`). The kernels are ``cuda/rowsort.cu``.
"""

from __future__ import annotations

import numpy as np
import torch

from .cupy_launch import available, check_tensors, device_index, launch, load_kernel, pointer

__all__ = ["MAX_WIDTH", "SOURCE", "available", "merge_gathered_cuda", "pack_results_cuda", "top_keys_cuda"]

# Widest row sorted here (shared memory: 8 bytes a key); wider ones go to torch.topk.
MAX_WIDTH = 4096
THREADS = 1024

SOURCE = "rowsort.cu"  # in kernels/cuda/


def top_keys_cuda(keys: torch.Tensor, k: int, count: torch.Tensor | None = None) -> torch.Tensor:
    """The ``min(k, W)`` largest of each row of int64 ``keys`` ``[B, W]`` (``W`` at most
    :data:`MAX_WIDTH`), sorted descending: ``torch.topk(keys, min(k, W)).values`` for keys
    as in the module docstring. ``count`` (int32 ``[B]``, optional): only a row's first
    ``count`` keys are read, the rest taken as 0. Contiguous, on one CUDA device."""
    dev = keys.device
    expected = {"keys": (keys, torch.int64)}
    if count is not None:
        expected["count"] = (count, torch.int32)
    check_tensors(expected, dev)
    b, w = keys.shape
    if w > MAX_WIDTH:
        raise ValueError(f"rows of at most {MAX_WIDTH} keys, not {w}")
    if count is not None and count.shape != (b,):
        raise ValueError("count must hold one value per row")
    kk = min(k, w)
    out = torch.empty((b, kk), dtype=torch.int64, device=dev)
    if b == 0 or kk == 0:
        return out
    p = 1 << max(w - 1, 0).bit_length()
    kernel = load_kernel(SOURCE, "top_keys", device=device_index(dev))
    null = np.uint64(0)
    args = (pointer(keys), np.int32(w), pointer(count) if count is not None else null, np.int32(kk), pointer(out))
    launch(kernel, (b,), (min(THREADS, max(32, p // 2)),), args, device=dev, shared_mem=p * 8)
    return out


def pack_results_cuda(scores: torch.Tensor, ids: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
    """One process's results as the rows it sends to a merge: int64 ``[B, L + 1]``, the
    :func:`gpusparse.topk.result_keys` of float32 ``scores`` and int64 global ``ids``
    ``[B, L]``, then each row's flag (bool ``[B]``; 0 without). One launch."""
    dev = scores.device
    expected = {"scores": (scores, torch.float32), "ids": (ids, torch.int64)}
    if flags is not None:
        expected["flags"] = (flags, torch.bool)
    check_tensors(expected, dev)
    b, w = scores.shape
    if ids.shape != (b, w) or (flags is not None and flags.shape != (b,)):
        raise ValueError("scores and ids must be [B, L] and flags [B]")
    out = torch.empty((b, w + 1), dtype=torch.int64, device=dev)
    n = out.numel()
    if n == 0:
        return out
    kernel = load_kernel(SOURCE, "pack_results", device=device_index(dev))
    null = np.uint64(0)
    args = (pointer(scores), pointer(ids), pointer(flags) if flags is not None else null, np.int64(b), np.int32(w),
            pointer(out))  # fmt: skip
    launch(kernel, (-(-n // 256),), (256,), args, device=dev)
    return out


def merge_gathered_cuda(
    gathered: torch.Tensor, runs: int, k: int, *, flags: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The merge of ``runs`` processes' :func:`pack_results_cuda` rows gathered as int64
    ``[runs · B, L + 1]`` (an all-gather into one tensor): ``(scores, ids)`` ``[B, k]``, the
    top ``k`` of each row by score descending then id ascending, padded with 0 / -1 (as
    :func:`gpusparse.topk.merge_keys`), and with ``flags`` each row's flag on any process
    (bool ``[B]``; else ``None``). Each process's keys must be ranked (descending). One launch."""
    dev = gathered.device
    check_tensors({"gathered": (gathered, torch.int64)}, dev)
    rows, c = gathered.shape
    if runs < 1 or rows % runs or c < 1:
        raise ValueError(f"{rows} gathered rows are not {runs} processes' rows")
    b, w = rows // runs, c - 1
    out_s = torch.empty((b, k), dtype=torch.float32, device=dev)
    out_i = torch.empty((b, k), dtype=torch.int64, device=dev)
    out_f = torch.empty(b, dtype=torch.bool, device=dev) if flags else None
    if b == 0:
        return out_s, out_i, out_f
    kernel = load_kernel(SOURCE, "merge_gathered", device=device_index(dev))
    null = np.uint64(0)
    args = (pointer(gathered), np.int32(runs), np.int64(b), np.int32(w), np.int32(k), pointer(out_s),
            pointer(out_i), pointer(out_f) if out_f is not None else null)  # fmt: skip
    launch(kernel, (b,), (min(THREADS, max(32, -(-max(runs * w, k) // 32) * 32)),), args, device=dev)
    return out_s, out_i, out_f
