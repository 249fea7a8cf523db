"""The tiled engine's last device step in one launch (``cuda/finish.cu``): ranked keys to padded
results, and each row's fixed-point certainty check.

On the synchronisation-free path these were some 25-30 small PyTorch operations after the final
top-k (decoding the keys, padding to ``k``, the row check of
:func:`gpusparse.engines.tiled.fixed_point.uncertain_rows`): ~1 µs of device time each, about
a fifth of a batch-1 search's device time at 8.8M documents, and the host's launches of them
where no CUDA graph replays the search. Those operations are the kernel's reference.
"""

from __future__ import annotations

import numpy as np
import torch

from .cupy_launch import available, check_tensors, device_index, launch, load_kernel, pointer

__all__ = ["SOURCE", "available", "finish_rows"]

SOURCE = "finish.cu"  # in kernels/cuda/
THREADS = 128  # the kernel's NT


def finish_rows(
    top: torch.Tensor | None,
    k: int,
    delta: torch.Tensor,
    scale: torch.Tensor,
    lb: torch.Tensor,
    floor: torch.Tensor | None,
    redo: torch.Tensor,
    *,
    count: torch.Tensor | None = None,
    width: int = 0,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, ids, flags)``: ``[B, k]`` results from ranked keys ``top`` int64 ``[B, kk]``
    (``kk <= k``; ``None``: no candidates), padded with 0 / -1 as :func:`gpusparse.exact.pad_results`
    pads :func:`gpusparse.topk.decode_keys`'s; and the rows to search again (bool ``[B]``):
    ``redo`` (read, not written), each row that
    :func:`~gpusparse.engines.tiled.fixed_point.uncertain_rows` flags from the fixed-point
    ``delta`` (int64), ``scale`` and match floor ``lb`` (float64) and, if given, the cutoff's
    ``floor`` (float32 or float64), and, with ``count`` (int32), each row whose count exceeds
    ``width`` (its keys did not hold every candidate); each ``[B]``. Contiguous, on one CUDA
    device. ``packed``: the three are views of one device buffer (ids, scores, flags, in that
    order), which a CUDA graph copies to the host in one copy (:mod:`gpusparse.engines.tiled.graphs`)."""
    dev = delta.device
    b = delta.shape[0]
    if floor is not None:  # a float32 bound is exact in float64: its max with the k-th is the same
        floor = floor.to(torch.float64).contiguous()
    if top is None:
        top = torch.zeros((b, 0), dtype=torch.int64, device=dev)
    expected = {"top": (top, torch.int64), "delta": (delta, torch.int64), "scale": (scale, torch.float64),
                "lb": (lb, torch.float64), "redo": (redo, torch.bool)}  # fmt: skip
    if floor is not None:
        expected["floor"] = (floor, torch.float64)
    if count is not None:
        expected["count"] = (count, torch.int32)
    check_tensors(expected, dev)
    kk = top.shape[1]
    rows = [x for x in (scale, lb, redo, floor, count) if x is not None]
    if top.shape[0] != b or kk > k or any(x.shape != (b,) for x in rows):
        raise ValueError("top must be [B, kk <= k] and delta, scale, lb, redo, count [B]")
    scores, ids, flags = _outputs(b, k, dev, packed)
    if b == 0:
        return scores, ids, flags
    if k == 0:  # uncertain_rows flags nothing then
        flags.copy_(redo if count is None else redo | (count > width))
        return scores, ids, flags
    kernel = load_kernel(SOURCE, "finish_rows", device=device_index(dev))
    null = np.uint64(0)
    args = (pointer(top), np.int32(kk), np.int32(k), pointer(delta), pointer(scale), pointer(lb),
            pointer(floor) if floor is not None else null, pointer(count) if count is not None else null,
            np.int32(width), pointer(redo), pointer(scores), pointer(ids), pointer(flags))  # fmt: skip
    launch(kernel, (b,), (THREADS,), args, device=dev)
    return scores, ids, flags


def _outputs(b: int, k: int, dev: torch.device, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``scores`` float32 ``[b, k]``, ``ids`` int64 ``[b, k]`` and ``flags`` bool ``[b]``;
    ``packed``: views of one uint8 buffer (ids first: every view starts aligned)."""
    if not packed:
        scores = torch.empty((b, k), dtype=torch.float32, device=dev)
        return scores, torch.empty((b, k), dtype=torch.int64, device=dev), torch.empty(b, dtype=torch.bool, device=dev)
    n_ids, n_scores = 8 * b * k, 4 * b * k
    buf = torch.empty(n_ids + n_scores + b, dtype=torch.uint8, device=dev)
    ids = buf[:n_ids].view(torch.int64).view(b, k)
    scores = buf[n_ids : n_ids + n_scores].view(torch.float32).view(b, k)
    return scores, ids, buf[n_ids + n_scores :].view(torch.bool)
