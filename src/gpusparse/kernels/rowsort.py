"""The top-k of each row of int64 ranking keys, sorted, by one CUDA block per row.

``torch.topk`` on a ``[256, 3024]`` row of keys takes ~0.1 ms in about ten launches (a radix
select, then a sort of the k kept); a row here is loaded into shared memory (its first
``count`` keys, padded with 0 to a power of two) and sorted by a bitonic network in one
launch. Keys are :func:`gpusparse.topk.encode_keys` values: non-negative, 0 for an empty
slot, distinct otherwise, so the order, and the result, are the same as ``torch.topk``'s.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .tiled import available  # same requirements: CUDA and CuPy

__all__ = ["MAX_WIDTH", "available", "top_keys_cuda"]

# Widest row sorted here (shared memory: 8 bytes a key); wider ones go to torch.topk.
MAX_WIDTH = 4096
THREADS = 1024

CUDA_SOURCE = r"""
typedef long long i64;
// Row r: its first n = min(count[r], W) keys (all W without count), padded with 0 to the
// next power of two P, sorted descending by a bitonic network in shared memory; the first
// kk written to out[r] (0 past P). A row's P is its own: short rows cost less.
extern "C" __global__ void __launch_bounds__(1024) top_keys(
    const i64* __restrict__ keys, const int W, const int* __restrict__ count,
    const int kk, i64* __restrict__ out)
{
    extern __shared__ i64 s[];
    const i64 r = blockIdx.x;
    const int n = count != nullptr ? min(max(count[r], 0), W) : W;
    int P = 1;
    while (P < n) P <<= 1;
    for (int i = threadIdx.x; i < P; i += blockDim.x) s[i] = i < n ? keys[r * W + i] : 0;
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < P / 2; i += blockDim.x) {
                const int lo = 2 * stride * (i / stride) + (i % stride), hi = lo + stride;
                const bool down = (lo & size) == 0;  // this run's direction (all down at size P)
                const i64 a = s[lo], b = s[hi];
                if ((a < b) == down) { s[lo] = b; s[hi] = a; }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < kk; i += blockDim.x) out[r * kk + i] = i < P ? s[i] : 0;
}
"""


@functools.cache
def _kernel(device_index: int):  # -> cupy.RawKernel
    import cupy as cp

    with cp.cuda.Device(device_index):
        return cp.RawModule(code=CUDA_SOURCE).get_function("top_keys")


def top_keys_cuda(keys: torch.Tensor, k: int, count: torch.Tensor | None = None) -> torch.Tensor:
    """The ``min(k, W)`` largest of each row of int64 ``keys`` ``[B, W]`` (``W`` at most
    :data:`MAX_WIDTH`), sorted descending: ``torch.topk(keys, min(k, W)).values`` for keys
    as in the module docstring. ``count`` (int32 ``[B]``, optional): only a row's first
    ``count`` keys are read, the rest taken as 0. Contiguous, on one CUDA device."""
    import cupy as cp

    from .tiled import check_tensors, cupy_stream, pointer

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
    kernel = _kernel(dev.index if dev.index is not None else torch.cuda.current_device())
    null = np.uint64(0)
    args = (pointer(keys), cp.int32(w), pointer(count) if count is not None else null, cp.int32(kk), pointer(out))
    with cp.cuda.Device(dev.index), cupy_stream(dev):
        kernel((b,), (min(THREADS, max(32, p // 2)),), args, shared_mem=p * 8)
    return out
