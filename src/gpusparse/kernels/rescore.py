"""Canonical rescoring of (query, document) pairs on the GPU, one warp per pair.

The warp's lanes find the document in the posting lists of the query's terms by binary
search (one term each), and lane 0 adds ``w_q · w_d`` in float64 — exactly the summation order
of :func:`gpusparse.search.exact_scores`'s PyTorch path, so both give the same bits — then
rounds once to float32. One launch replaces the PyTorch path's few hundred small ones.
"""

from __future__ import annotations

import functools

import torch

from .tiled import available  # same requirements: CUDA and CuPy

__all__ = ["available", "exact_scores_cuda"]

CUDA_SOURCE = r"""
// One warp per pair: lane j looks the document up in query term j's list (32 terms at a
// time), so the ~22 dependent loads of a binary search overlap across the query's terms
// instead of running one term after the other; lane 0 then adds the products in term order.
extern "C" __global__ void exact_scores_kernel(
    const int* __restrict__ doc_ids, const float* __restrict__ scores,
    const long long* __restrict__ offsets, const int* __restrict__ lengths,
    const long long* __restrict__ q_terms,  // [B, T], ascending, -1 padding at the end
    const float* __restrict__ q_weights,    // [B, T]
    const int T,
    const long long* __restrict__ rows, const long long* __restrict__ docs, const long long m,
    float* __restrict__ out)
{
    const long long p = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (p >= m) return;  // the whole warp: p is the same for its lanes
    const long long r = rows[p];
    const int d = (int)docs[p];
    if (d < 0) {  // a slot the caller does not need
        if (lane == 0) out[p] = 0.0f;
        return;
    }
    double acc = 0.0;
    for (int j0 = 0; j0 < T; j0 += 32) {
        const int j = j0 + lane;
        const long long t = j < T ? q_terms[r * T + j] : -1;
        double prod = 0.0;
        bool hit = false;
        if (t >= 0) {
            const long long start = offsets[t], end = start + lengths[t];
            long long lo = start, hi = end;
            while (lo < hi) {
                const long long mid = (lo + hi) >> 1;
                if (doc_ids[mid] < d) lo = mid + 1; else hi = mid;
            }
            hit = lo < end && doc_ids[lo] == d;
            if (hit) prod = (double)scores[lo] * (double)q_weights[r * T + j];
        }
        const unsigned int hits = __ballot_sync(0xffffffffu, hit);
        const bool more = __any_sync(0xffffffffu, t >= 0) && j0 + 32 < T;
        for (int v = 0; v < 32; ++v) {  // in term order, as the PyTorch path adds them
            const double x = __shfl_sync(0xffffffffu, prod, v);
            if ((hits >> v) & 1u) acc += x;
        }
        if (!more) break;  // padding reached: the terms are at the front
    }
    if (lane == 0) out[p] = (float)acc;
}
"""

THREADS = 256


@functools.cache
def _kernel(device_index: int):  # -> cupy.RawKernel
    import cupy as cp

    with cp.cuda.Device(device_index):
        return cp.RawModule(code=CUDA_SOURCE).get_function("exact_scores_kernel")


def exact_scores_cuda(
    doc_ids: torch.Tensor,
    scores: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
    rows: torch.Tensor,
    docs: torch.Tensor,
) -> torch.Tensor:
    """float32 ``[M]`` canonical scores of pairs (``rows[i]``, ``docs[i]``); see the module docstring.

    Index arrays as in :class:`gpusparse.Index`; ``q_terms`` int64 and ``q_weights`` float32
    ``[B, T]``; ``rows``/``docs`` int64 ``[M]``; all contiguous on one CUDA device. A pair
    whose document is ``-1`` is skipped (score 0), so callers can pass fixed-shape slots.
    """
    import cupy as cp

    from .tiled import check_tensors, cupy_stream, pointer

    dev = doc_ids.device
    expected = {
        "doc_ids": (doc_ids, torch.int32),
        "scores": (scores, torch.float32),
        "offsets": (offsets, torch.int64),
        "lengths": (lengths, torch.int32),
        "q_terms": (q_terms, torch.int64),
        "q_weights": (q_weights, torch.float32),
        "rows": (rows, torch.int64),
        "docs": (docs, torch.int64),
    }
    check_tensors(expected, dev)
    m = docs.numel()
    out = torch.empty(m, dtype=torch.float32, device=dev)
    if m == 0 or doc_ids.numel() == 0:
        return out.zero_()
    kernel = _kernel(dev.index if dev.index is not None else torch.cuda.current_device())
    args = [pointer(x) for x in (doc_ids, scores, offsets, lengths, q_terms, q_weights)]
    tail = [pointer(rows), pointer(docs), cp.int64(m), pointer(out)]
    blocks = (m * 32 + THREADS - 1) // THREADS  # a warp per pair
    with cp.cuda.Device(dev.index), cupy_stream(dev):
        kernel((blocks,), (THREADS,), (*args, cp.int32(q_terms.shape[1]), *tail))
    return out
