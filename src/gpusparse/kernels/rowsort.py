"""The top-k of each row of int64 ranking keys, sorted, by one CUDA block per row.

``torch.topk`` on a ``[256, 3024]`` row of keys takes ~0.1 ms in about ten launches (a radix
select, then a sort of the k kept); a row here is loaded into shared memory (its first
``count`` keys, padded with 0 to a power of two) and sorted by a bitonic network in one
launch. Keys are :func:`gpusparse.topk.encode_keys` values: non-negative, 0 for an empty
slot, distinct otherwise, so the order, and the result, are the same as ``torch.topk``'s.

The NCCL merge of the processes' ranked lists has its two kernels here too: one packs a
process's results into keys, one merges the gathered lists (:func:`pack_results_cuda`,
:func:`merge_gathered_cuda`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .tiled import available  # same requirements: CUDA and CuPy

__all__ = ["MAX_WIDTH", "available", "merge_gathered_cuda", "pack_results_cuda", "top_keys_cuda"]

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

#define ID_MASK ((((i64)1) << 31) - 1)
// One process's result rows (scores [B, L], global ids [B, L], redo flags [B] or null) as
// the rows it sends: [B, L + 1], L ranking keys (0 for an empty slot: id -1 or score 0, as
// gpusparse.topk.result_keys) and the flag.
extern "C" __global__ void pack_results(const float* __restrict__ scores, const i64* __restrict__ ids,
                                        const bool* __restrict__ flags, const i64 B, const int L,
                                        i64* __restrict__ out)
{
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= B * (L + 1)) return;
    const i64 r = t / (L + 1);
    const int j = (int)(t - r * (L + 1));
    if (j == L) {
        out[t] = flags != nullptr && flags[r] ? 1 : 0;
        return;
    }
    const float s = scores[r * L + j];
    const i64 id = ids[r * L + j];
    out[t] = id >= 0 && s > 0.0f ? ((i64)__float_as_int(s) << 31) | (ID_MASK - id) : 0;
}

// The R processes' packed rows gathered as [R, B, L + 1] (pack_results): row r's top kk,
// decoded into scores [B, kk] and ids [B, kk] (empty slots 0 and -1, as
// gpusparse.topk.merge_keys pads them), and each row's flag on any process. Each process's
// L keys are ranked (descending): a key's place in the merged order is its place in its own
// list plus, in every other list, the keys before it (binary search; between equal keys,
// which only 0 has, the lower process first). Places before kk are written: a permutation
// of the R * L keys, so every slot below min(kk, R * L) is filled; the rest are padding.
extern "C" __global__ void merge_gathered(const i64* __restrict__ g, const int R, const i64 B, const int L,
                                          const int kk, float* __restrict__ out_s, i64* __restrict__ out_i,
                                          bool* __restrict__ flags)
{
    const i64 r = blockIdx.x;
    const int C = L + 1;
    if (threadIdx.x == 0 && flags != nullptr) {
        bool f = false;
        for (int q = 0; q < R; ++q) f = f || g[((i64)q * B + r) * C + L] != 0;
        flags[r] = f;
    }
    for (int e = threadIdx.x; e < R * L; e += blockDim.x) {
        const int p = e / L, i = e - p * L;
        const i64 x = g[((i64)p * B + r) * C + i];
        int pos = i;
        for (int q = 0; q < R; ++q) {
            if (q == p) continue;
            const i64* run = g + ((i64)q * B + r) * C;
            int lo = 0, hi = L;
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                const i64 y = run[mid];
                if (q < p ? y >= x : y > x) lo = mid + 1; else hi = mid;
            }
            pos += lo;
        }
        if (pos < kk) {
            out_s[r * kk + pos] = x > 0 ? __int_as_float((int)(x >> 31)) : 0.0f;
            out_i[r * kk + pos] = x > 0 ? ID_MASK - (x & ID_MASK) : -1;
        }
    }
    for (int e = R * L + threadIdx.x; e < kk; e += blockDim.x) {  // fewer results than kk
        out_s[r * kk + e] = 0.0f;
        out_i[r * kk + e] = -1;
    }
}
"""


@functools.cache
def _module(device_index: int):  # -> cupy.RawModule
    import cupy as cp

    with cp.cuda.Device(device_index):
        return cp.RawModule(code=CUDA_SOURCE)


def _kernel(device_index: int, name: str = "top_keys"):  # -> cupy.RawKernel
    return _module(device_index).get_function(name)


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


def pack_results_cuda(scores: torch.Tensor, ids: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
    """One process's results as the rows it sends to a merge: int64 ``[B, L + 1]``, the
    :func:`gpusparse.topk.result_keys` of float32 ``scores`` and int64 global ``ids``
    ``[B, L]``, then each row's flag (bool ``[B]``; 0 without). One launch."""
    import cupy as cp

    from .tiled import check_tensors, cupy_stream, pointer

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
    kernel = _kernel(dev.index if dev.index is not None else torch.cuda.current_device(), "pack_results")
    null = np.uint64(0)
    args = (pointer(scores), pointer(ids), pointer(flags) if flags is not None else null, cp.int64(b), cp.int32(w),
            pointer(out))  # fmt: skip
    with cp.cuda.Device(dev.index), cupy_stream(dev):
        kernel((-(-n // 256),), (256,), args)
    return out


def merge_gathered_cuda(
    gathered: torch.Tensor, runs: int, k: int, *, flags: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The merge of ``runs`` processes' :func:`pack_results_cuda` rows gathered as int64
    ``[runs · B, L + 1]`` (an all-gather into one tensor): ``(scores, ids)`` ``[B, k]``, the
    top ``k`` of each row by score descending then id ascending, padded with 0 / -1 (as
    :func:`gpusparse.topk.merge_keys`), and with ``flags`` each row's flag on any process
    (bool ``[B]``; else ``None``). Each process's keys must be ranked (descending). One launch."""
    import cupy as cp

    from .tiled import check_tensors, cupy_stream, pointer

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
    kernel = _kernel(dev.index if dev.index is not None else torch.cuda.current_device(), "merge_gathered")
    null = np.uint64(0)
    args = (pointer(gathered), cp.int32(runs), cp.int64(b), cp.int32(w), cp.int32(k), pointer(out_s),
            pointer(out_i), pointer(out_f) if out_f is not None else null)  # fmt: skip
    with cp.cuda.Device(dev.index), cupy_stream(dev):
        kernel((b,), (min(THREADS, max(32, -(-max(runs * w, k) // 32) * 32)),), args)
    return out_s, out_i, out_f
