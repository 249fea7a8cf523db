"""Host ↔ device copies of a search: query arrays in, results out, each in as few copies as
possible (a copy costs more host time than a small batch's bytes).

To a GPU, numpy arrays travel through one page-locked buffer (:func:`to_device`); results
come back through page-locked memory on a side stream (:func:`start_to_host`), so the
copies overlap the next batch's kernels. Whether results use page-locked memory is
:attr:`~gpusparse.config.EngineConfig.pinned_results`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from .config import engine_config


def results_to_host(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Device tensors (a batch's scores, ids, and any flags) on the host, after one sync
    (from a GPU through page-locked memory); ``None`` stays ``None``."""
    out, done = start_to_host(*tensors)
    if done is not None:
        done.synchronize()
    return out


def start_to_host(
    *tensors: torch.Tensor | None, into: Sequence[torch.Tensor | None] = ()
) -> tuple[tuple[torch.Tensor | None, ...], torch.cuda.Event | None]:
    """:func:`results_to_host` without the wait: host tensors that hold the values once the
    returned CUDA event has completed (``None``: already done, off a GPU). ``into``: page-locked
    host tensors to copy the first tensors into (as :func:`output_buffers` gives)."""
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type != "cuda" or not engine_config().pinned_results:
        host = [None if t is None else t.cpu() for t in tensors]
        for i, target in enumerate(into):
            if target is not None and host[i] is not None:
                host[i] = target.copy_(host[i])
        return tuple(host), None
    targets = list(into) + [None] * (len(tensors) - len(into))
    dev = present[0].device
    # On a side stream (a copy engine), after the work queued so far: the copies overlap the
    # next batch's kernels instead of holding up the compute stream.
    side = _copy_stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        out = tuple(
            None
            if t is None
            else (target if target is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)).copy_(
                t, non_blocking=True
            )
            for t, target in zip(tensors, targets, strict=True)
        )
    for t in present:
        t.record_stream(side)  # not reused by the compute stream before the copy has read it
    done = torch.cuda.Event()
    done.record(side)
    return out, done


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def output_buffers(n_queries: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Host ``(scores, ids)`` ``[n_queries, k]`` for a search's results (every row is written),
    page-locked when the search runs on a GPU and they are small enough (then the third
    value is ``True``: batches may copy into them directly)."""
    config = engine_config()
    pinned = device.type == "cuda" and config.pinned_results and n_queries * k * 12 <= config.pinned_output_max
    scores = torch.empty((n_queries, k), dtype=torch.float32, pin_memory=pinned)
    return scores, torch.empty((n_queries, k), dtype=torch.int64, pin_memory=pinned), pinned


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """numpy ``arrays`` as tensors on ``device`` (same dtypes and shapes) in one copy: to a GPU
    through one page-locked buffer, without waiting for the copy (the allocator keeps the
    buffer until the copy is done). A copy costs more host time than a small batch's bytes."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    starts, total = [], 0
    for a in arrays:
        starts.append(total)
        total += -(-a.nbytes // 8) * 8  # every array 8-byte aligned, so each view is legal
    host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for a, start in zip(arrays, starts, strict=True):
        staging[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    moved = host.to(device, non_blocking=True)
    return [
        moved[start : start + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
        for a, start in zip(arrays, starts, strict=True)
    ]
