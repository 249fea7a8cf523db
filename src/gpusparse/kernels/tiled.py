"""The tiled engine's CUDA kernel: on-chip accumulation per (document tile, query), compiled at run time.

Documents are cut into tiles of ``2**TILE_BITS``; the postings of each (tile, term) pair are
stored together as 16-bit offsets inside the tile and float32 weights (see
:mod:`gpusparse.tiled`). One thread block handles one (query, tile): it accumulates the
query's scores for the whole tile in shared memory, so no ``[B, N]`` buffer exists and the
only device-memory traffic is reading postings (blocks of the same tile run together and
share them through L2) and writing a few candidates.

Scores are accumulated in fixed point (ACC_MODES: 32-bit sums, or 64 bits as two 32-bit
halves): every product ``w_q · w_d`` is scaled by the query's power-of-two ``scale`` and
rounded to an integer (or, with fixed-point weights, computed in integers), so the sum is
exact integer arithmetic, independent of the order of the atomics, within a bounded number
of units of the true sum. After accumulating, the block finds by a two-pass
radix histogram a value ``tau`` that at least ``k`` of its documents reach, raises the
query's running threshold ``theta`` to it (a lower bound of the k-th best score of the
whole collection), and emits every document within the error margin ``delta`` of
``max(tau, theta)`` as a candidate. Triton cannot express shared-memory atomics, hence CUDA
(through CuPy's NVRTC); :func:`available` says whether it can run here. The same module
holds the one-launch compaction of a wave's candidates (:func:`compact_candidates`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

CUDA_SOURCE = r"""
#ifndef TILE_BITS
#define TILE_BITS 14
#endif
#ifndef THREADS
#define THREADS 512
#endif
#define TILE (1 << TILE_BITS)
#define PER (TILE / THREADS)  // documents each thread owns in the dense phase
typedef unsigned long long u64;
// How a document's fixed-point sum is held in shared memory (see ACC_MODES in Python):
//   0 "carry": 64 bits as lo/hi 32-bit halves (shared-memory atomics are native for 32
//     bits; a 64-bit one compiles to a compare-and-swap loop); each product is rounded to
//     the integer unit and the dense phase sums integers.
//   1 "u32": a scale that keeps every sum below 2**32; one atomic per posting, half the
//     shared memory, and the dense phase sums exact float64 products in float64 registers
//     (rounded once per document: one conversion per element instead of two).
#ifndef ACC_MODE
#define ACC_MODE 0
#endif
#if ACC_MODE == 0
#define ACC(i) (((u64)hi[i] << 32) | (u64)lo[i])
#else
#define ACC(i) ((u64)lo[i])
#endif
// Document weights: float32, or 8-bit levels of a quantized index (the query's scale then
// includes the index's step).
#ifndef WT
#define WT float
#endif
// INT_W (mode 1 only): every scaled query weight is an integer (a quantized index and
// quantized queries), so products are exact 32-bit integer multiplications, no float64.
#ifndef INT_W
#define INT_W 0
#endif
// FIXED_W (mode 1 only): float32 weights stored as fixed point, d = round(w · 2**b) (WT is
// unsigned int); each query weight becomes q = round(w_q · mult) and a product is
// (q · d) >> shift[query], integer arithmetic throughout; the rounding errors are in the
// margin (see fixed_point in gpusparse.tiled).
#ifndef FIXED_W
#define FIXED_W 0
#endif
#define INT_PRODUCTS (INT_W || FIXED_W)
typedef long long i64;

#define MAXT 256  // query terms whose metadata sits in shared memory at once
#ifndef UNROLL
#define UNROLL 4
#endif

// Dense rows are read VEC weights at a time (one vector load).
#define VEC (PER >= 4 ? 4 : PER)
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// Shared-memory metadata of a chunk of query terms, compacted (padding and empty segments
// dropped): the dense rows [0, nd) and the non-empty sparse segments [0, ns). Weights as
// float64 only where products are float64 (INT_PRODUCTS needs the integer ones only).
#if INT_PRODUCTS
#define WMAX 1
#else
#define WMAX MAXT
#endif
struct Terms {
    int nd, ns;
    int* d_row;            // [MAXT] dense row
    unsigned int* d_wi;    // [MAXT] integer query weight (INT_PRODUCTS)
    double* d_w;           // [WMAX] float64 query weight
    i64* s_start;          // [MAXT] first posting of a sparse segment
    int* s_pref;           // [MAXT + 1] segment lengths, then their exclusive prefix sums
    unsigned int* s_wi;    // [MAXT]
    double* s_w;           // [WMAX]
    int* warp_counts;      // [2 * warps]
};

#define NWARPS ((THREADS + 31) / 32)
// A block of tiny tiles may have fewer than 32 threads: warp-wide operations use WL lanes.
#define WL (THREADS < 32 ? THREADS : 32)
#define WMASK (WL == 32 ? 0xffffffffu : (1u << WL) - 1u)

// Loads the metadata of query terms [0, nj) of a chunk (all threads), compacted in term order:
// each warp's entries by ballot, the warps' counts through shared memory. Every load a term
// needs is issued at once (its dense row and its segment bounds), so one round trip follows
// the term id's instead of a chain of three.
__device__ __forceinline__ void load_terms(
    const int* terms, const float* qw, int nj, double scale, const int* did_tile, const i64* seg_tile, Terms& m)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    __syncthreads();  // the previous chunk's metadata is no longer read
    int nd = 0, ns = 0;
    for (int r0 = 0; r0 < nj; r0 += THREADS) {
        const int j = r0 + tid;
        int did = -1, len = 0;
        i64 start = 0;
        double w = 0.0;
        if (j < nj) {
            const int t = terms[j];
            w = (double)qw[j] * scale;  // exact: scale is a power of two
            if (t >= 0) {
                did = did_tile[t];
                start = seg_tile[t];
                len = (int)(seg_tile[t + 1] - start);
            }
        }
        const bool dense = did >= 0, sparse = !dense && len > 0;
        const unsigned int bd = __ballot_sync(WMASK, dense), bs = __ballot_sync(WMASK, sparse);
        if (lane == 0) {
            m.warp_counts[warp] = __popc(bd);
            m.warp_counts[NWARPS + warp] = __popc(bs);
        }
        __syncthreads();
        int od = nd, os = ns;
        for (int v = 0; v < NWARPS; ++v) {
            const int cd = m.warp_counts[v], cs = m.warp_counts[NWARPS + v];
            if (v < warp) {
                od += cd;
                os += cs;
            }
            nd += cd;
            ns += cs;
        }
        const unsigned int below = (1u << lane) - 1u;
        // INT_W: exact (checked by the caller); FIXED_W: rounded to the nearest integer
        const unsigned int wi = INT_W ? (unsigned int)w : FIXED_W ? __double2uint_rn(w) : 0u;
        if (dense) {
            od += __popc(bd & below);
            m.d_row[od] = did;
            m.d_wi[od] = wi;
            if (!INT_PRODUCTS) m.d_w[od] = w;
        }
        if (sparse) {
            os += __popc(bs & below);
            m.s_start[os] = start;
            m.s_pref[os] = len;
            m.s_wi[os] = wi;
            if (!INT_PRODUCTS) m.s_w[os] = w;
        }
        __syncthreads();  // warp_counts is rewritten by the next round
    }
    m.nd = nd;
    m.ns = ns;
}

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
// Sparse postings are assigned to segments through a map of NCHUNK equal pieces (each piece's
// first segment, found by binary search once per block), so a thread's search for its
// posting's segment starts next to it.
#define NCHUNK 512
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) tiled_candidates(
    const i64* __restrict__ seg,              // [n_tiles * V + 1] start of each sparse (tile, term) segment
    const unsigned short* __restrict__ offs,  // [P] document offset inside the tile
    const WT* __restrict__ wts,               // [P] document weight
    const int* __restrict__ dense_id,         // [n_tiles * V] row of `dense` for a dense segment, else -1
    const WT* __restrict__ dense,             // [n_dense, TILE] weights by offset (0 = absent)
    const int* __restrict__ q_terms,          // [B, T] term ids, -1 padding at the end of a row
    const float* __restrict__ q_weights,      // [B, T]
    const double* __restrict__ q_scale,       // [B] power of two: fixed-point units per score unit
    const i64* __restrict__ q_delta,          // [B] error margin in units
    const int* __restrict__ q_shift,          // [B] FIXED_W: right shift of each product
    const int T, const int V, const int n_docs, const int k, const int tile0, const int select,
    u64* __restrict__ theta,                  // [B] running lower bound of the k-th best score
    int* __restrict__ cand_count,             // [B]
    int* __restrict__ cand_doc,               // [B, cap]
    u64* __restrict__ cand_val,               // [B, cap]
    const int cap)
{
    extern __shared__ unsigned int smem[];
    unsigned int* lo = smem;
    unsigned int* hi = smem + TILE;  // unused (not allocated) in mode 1
    // The radix histogram of the selection, and before it the sparse phase's chunk map.
    __shared__ unsigned int hist[256];
    unsigned short* s_chunk = reinterpret_cast<unsigned short*>(hist);
    __shared__ int d_row[MAXT], s_pref[MAXT + 1], warp_counts[2 * NWARPS];
    __shared__ unsigned int d_wi[MAXT], s_wi[MAXT];
    __shared__ i64 s_start[MAXT];
    __shared__ double d_w[WMAX], s_w[WMAX];
    __shared__ u64 s_max, s_val, s_th0;
    __shared__ unsigned int s_above;
    __shared__ int s_bucket;
    Terms meta{0, 0, d_row, d_wi, d_w, s_start, s_pref, s_wi, s_w, warp_counts};

    const int q = blockIdx.x;
    const int tile = tile0 + blockIdx.y;  // waves of tiles: see gpusparse.tiled
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const int base = tile << TILE_BITS;
    const int width = min(TILE, n_docs - base);

    // The query's running threshold, read now so its latency hides behind the accumulation
    // (it only grows: an older value is still a valid bound for the early exit below).
    if (tid == 0) {
        s_max = 0ull;
        s_th0 = __ldcg(&theta[q]);
    }
    const double scale = q_scale[q];
    const int sh = FIXED_W ? q_shift[q] : 0;
    const int* terms = q_terms + (i64)q * T;
    const float* qw = q_weights + (i64)q * T;
    const i64* seg_tile = seg + (i64)tile * V;
    const int* did_tile = dense_id + (i64)tile * V;

    // The query's terms are handled in chunks of MAXT: their metadata (weight, dense row,
    // sparse segment) is loaded by all threads at once into shared memory, instead of by
    // every thread one term after the other (a chain of dependent global loads).
    // 1a. Dense segments: each thread owns VEC consecutive documents in each group of
    //     THREADS * VEC and sums them in registers from coalesced vector reads; the sums
    //     initialise the shared accumulators.
#if ACC_MODE == 1 && INT_PRODUCTS
    unsigned int reg[PER];
#elif ACC_MODE == 1
    double reg[PER];
#else
    u64 reg[PER];
#endif
#pragma unroll
    for (int r = 0; r < PER; ++r) reg[r] = 0;
    for (int j0 = 0; j0 < T; j0 += MAXT) {
        const int nj = min(MAXT, T - j0);
        load_terms(terms + j0, qw + j0, nj, scale, did_tile, seg_tile, meta);
#ifdef PROFILE_SKIP_DENSE  // profiling only (bench/profile_tiled.py): results are wrong
        continue;
#endif
        for (int d = 0; d < meta.nd; ++d) {
            const Pack<WT, VEC>* col = reinterpret_cast<const Pack<WT, VEC>*>(dense + (i64)d_row[d] * TILE);
            const double w = INT_PRODUCTS ? 0.0 : d_w[d];
            const unsigned int wi = d_wi[d];
#pragma unroll
            for (int g = 0; g < PER / VEC; ++g) {
                const Pack<WT, VEC> p = col[g * THREADS + tid];
#pragma unroll
                for (int v = 0; v < VEC; ++v) {
#if ACC_MODE == 1 && FIXED_W
                    reg[g * VEC + v] += (unsigned int)(((u64)wi * (u64)p.v[v]) >> sh);
#elif ACC_MODE == 1 && INT_W
                    reg[g * VEC + v] += wi * (unsigned int)p.v[v];
#elif ACC_MODE == 1
                    reg[g * VEC + v] = fma(w, (double)p.v[v], reg[g * VEC + v]);  // exact product
#else
                    reg[g * VEC + v] += (u64)__double2ll_rn(w * (double)p.v[v]);
#endif
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < PER / VEC; ++g) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
            const int i = (g * THREADS + tid) * VEC + v;
#if ACC_MODE == 0
            lo[i] = (unsigned int)reg[g * VEC + v];
            hi[i] = (unsigned int)(reg[g * VEC + v] >> 32);
#elif INT_PRODUCTS
            lo[i] = reg[g * VEC + v];
#else
            lo[i] = (unsigned int)__double2ll_rn(reg[g * VEC + v]);
#endif
        }
    }

    // 1b. Sparse segments: one flat loop over all their postings, so that every thread has
    //     independent loads in flight whatever the segments' lengths.
    for (int j0 = 0; j0 < T; j0 += MAXT) {
        // one chunk (the usual case): its metadata is still there from the dense phase
        if (T > MAXT) load_terms(terms + j0, qw + j0, min(MAXT, T - j0), scale, did_tile, seg_tile, meta);
        const int ns = meta.ns;
        // Exclusive prefix sums of the segment lengths, in place, by the first warp.
        if (tid < WL) {
            int carry = 0;
            for (int c = 0; c < ns; c += WL) {
                const int len = c + tid < ns ? s_pref[c + tid] : 0;
                int incl = len;
                for (int o = 1; o < WL; o <<= 1) {
                    const int up = __shfl_up_sync(WMASK, incl, o);
                    if (tid >= o) incl += up;
                }
                if (c + tid < ns) s_pref[c + tid] = carry + incl - len;
                carry += __shfl_sync(WMASK, incl, WL - 1);
            }
            if (tid == 0) s_pref[ns] = carry;
        }
        __syncthreads();
#ifdef PROFILE_SKIP_SPARSE  // profiling only: results are wrong
        const int total = 0;
#else
        const int total = s_pref[ns];
#endif
        // Chunk map: s_chunk[c] = the segment holding posting c << cs (segments are non-empty,
        // so the prefix sums increase strictly).
        int cs = 5;
        while (total > 0 && ((total - 1) >> cs) >= NCHUNK) ++cs;
        for (int c = tid; total > 0 && c <= (total - 1) >> cs; c += THREADS) {
            const int pos = c << cs;
            int a = 0, b = ns - 1;
            while (a < b) {
                const int mid = (a + b + 1) >> 1;
                if (s_pref[mid] <= pos) a = mid;
                else b = mid - 1;
            }
            s_chunk[c] = (unsigned short)a;
        }
        __syncthreads();
        // UNROLL postings per thread and step: all their loads are issued before the first
        // atomic, so several global loads are in flight per thread.
        for (int f0 = tid; f0 < total; f0 += UNROLL * THREADS) {
            i64 idx[UNROLL];
            double wq[UNROLL];
            unsigned int wqi[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int f = f0 + u * THREADS;
                idx[u] = -1;
                if (f < total) {
                    int j = s_chunk[f >> cs];
                    while (s_pref[j + 1] <= f) ++j;  // a piece is at most a few segments
                    idx[u] = s_start[j] + (f - s_pref[j]);
                    wq[u] = INT_PRODUCTS ? 0.0 : s_w[j];
                    wqi[u] = s_wi[j];
                }
            }
            WT wd[UNROLL];
            unsigned int o[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (idx[u] >= 0) {
                    wd[u] = wts[idx[u]];
                    o[u] = offs[idx[u]];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (idx[u] < 0) continue;
                // float32 x float32 is exact in float64 (wq holds w_q * scale, a power of two);
                // one rounding to the integer unit.
#if FIXED_W
                const u64 v = ((u64)wqi[u] * (u64)wd[u]) >> sh;
#elif INT_W
                const u64 v = (u64)(wqi[u] * (unsigned int)wd[u]);
#else
                const u64 v = (u64)__double2ll_rn(wq[u] * (double)wd[u]);
#endif
#if ACC_MODE == 0
                const unsigned int add_lo = (unsigned int)v;
                const unsigned int old = atomicAdd(&lo[o[u]], add_lo);
                const unsigned int add_hi = (unsigned int)(v >> 32) + (old + add_lo < old ? 1u : 0u);  // carry
                if (add_hi) atomicAdd(&hi[o[u]], add_hi);
#else
                atomicAdd(&lo[o[u]], (unsigned int)v);
#endif
            }
        }
    }
    __syncthreads();

    // 2. The tile's largest score.
    const int lane = tid & 31;
#if ACC_MODE == 1 && VEC == 4
    // 32-bit sums: each thread reads back the groups of four it wrote, one vector load each
    // (past `width` the sums are 0: no posting or dense weight lies there).
    const uint4* lo4 = reinterpret_cast<const uint4*>(lo);
    unsigned int m32 = 0u;
#pragma unroll
    for (int g = 0; g < PER / 4; ++g) {
        const uint4 x = lo4[g * THREADS + tid];
        m32 = max(m32, max(max(x.x, x.y), max(x.z, x.w)));
    }
    m32 = __reduce_max_sync(WMASK, m32);
    if (lane == 0) atomicMax(&s_max, (u64)m32);
#else
    u64 m = 0ull;
    for (int i = tid; i < width; i += nt) m = max(m, ACC(i));
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_down_sync(0xffffffffu, m, o));
    if (lane == 0) atomicMax(&s_max, m);
#endif
    __syncthreads();
    const u64 vmax = s_max;
    if (vmax == 0ull) return;  // no document of this tile matches the query
    // Nothing to emit if even the tile's best stays below the query's current threshold
    // (common once earlier waves have set theta): skip the selection passes.
    {
        const u64 th0 = s_th0;
        const u64 d0 = (u64)q_delta[q] + (th0 >> 22);
        if (th0 > d0 && vmax < th0 - d0) return;
    }

    // 3. tau: at least k documents of the tile score >= tau (two 8-bit radix passes below
    //    the top bit; 0 when fewer than k documents match).
    const int msb = 63 - __clzll((i64)vmax);
    const int s0 = msb >= 7 ? msb - 7 : 0;
    //    Skipped (select == 0) once theta comes from earlier waves: it is then a far better
    //    bound than one tile's k-th, and the two passes over the tile are saved.
    u64 tau = 0ull;
    int need = k;
    for (int pass = 0; pass < (select ? 2 : 0); ++pass) {
        const int shift = pass == 0 ? s0 : (s0 >= 8 ? s0 - 8 : 0);
        const int bits = pass == 0 ? 8 : s0 - shift;
        if (pass == 1 && bits == 0) break;
        const u64 prefix = tau >> s0;  // pass 1: the bucket chosen in pass 0
        for (int i = tid; i < 256; i += nt) hist[i] = 0u;
        __syncthreads();
        for (int i = tid; i < width; i += nt) {
            const u64 v = ACC(i);
            if (v != 0ull && (pass == 0 || (v >> s0) == prefix))
                atomicAdd(&hist[(v >> shift) & ((1u << bits) - 1u)], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            unsigned int cum = 0u;
            int b = (1 << bits) - 1;
            for (; b >= 0; --b) {
                if (cum + hist[b] >= (unsigned int)need) break;
                cum += hist[b];
            }
            s_bucket = b;
            s_above = cum;
        }
        __syncthreads();
        const int b = s_bucket;
        if (b < 0) { tau = 0ull; break; }  // fewer than k matches (only possible in pass 0)
        need -= (int)s_above;
        tau = pass == 0 ? ((u64)b << s0) : (tau | ((u64)b << shift));
        __syncthreads();  // everyone has read s_bucket before the next pass rewrites it
    }

    // 4. Raise the query's running threshold and emit the documents within the margin.
    if (tid == 0) {
        const u64 old = tau > 0ull ? atomicMax(&theta[q], tau) : atomicAdd(&theta[q], 0ull);
        s_val = max(old, tau);
    }
    __syncthreads();
    const u64 th = s_val;
    const u64 d = (u64)q_delta[q] + (th >> 22);  // + one float32 ulp: ties after rounding
    const u64 thr = th > d ? max(th - d, 1ull) : 1ull;
#if ACC_MODE == 1 && VEC == 4
    // Few documents pass: a warp tests 128 of them per step (one vector load a thread) and
    // only a warp holding some takes the slots, by a prefix sum of its lanes' counts.
    if (thr > 0xffffffffull) return;  // above every 32-bit sum
    const unsigned int t32 = (unsigned int)thr;
    for (int g = 0; g < PER / 4; ++g) {
        const uint4 x = lo4[g * THREADS + tid];
        const unsigned int f = (unsigned int)(x.x >= t32) | ((unsigned int)(x.y >= t32) << 1) |
                               ((unsigned int)(x.z >= t32) << 2) | ((unsigned int)(x.w >= t32) << 3);
        if (__ballot_sync(WMASK, f != 0u) == 0u) continue;
        const int cnt = __popc(f);
        int incl = cnt;
        for (int o = 1; o < WL; o <<= 1) {
            const int up = __shfl_up_sync(WMASK, incl, o);
            if (lane >= o) incl += up;
        }
        int first = 0;
        if (lane == WL - 1) first = atomicAdd(&cand_count[q], incl);
        first = __shfl_sync(WMASK, first, WL - 1);
        int slot = first + incl - cnt;
        const int i = (g * THREADS + tid) * 4;
        const unsigned int xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            if ((f >> v) & 1u) {
                if (slot < cap) {
                    cand_doc[(i64)q * cap + slot] = base + i + v;
                    cand_val[(i64)q * cap + slot] = xv[v];
                }
                ++slot;
            }
        }
    }
#else
    for (int i0 = 0; i0 < width; i0 += nt) {
        const int i = i0 + tid;
        const u64 v = i < width ? ACC(i) : 0ull;
        const bool emit = v >= thr;
        const unsigned int mask = __ballot_sync(0xffffffffu, emit);
        if (mask == 0u) continue;
        const int leader = __ffs(mask) - 1;
        int first = 0;
        if (lane == leader) first = atomicAdd(&cand_count[q], __popc(mask));
        first = __shfl_sync(0xffffffffu, first, leader);
        if (emit) {
            const int slot = first + __popc(mask & ((1u << lane) - 1u));
            if (slot < cap) {
                cand_doc[(i64)q * cap + slot] = base + i;
                cand_val[(i64)q * cap + slot] = v;
            }
        }
    }
#endif
}
"""

COMPACT_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;
#define NT 512
// One block per query: the k-th largest candidate value (MSB-first radix select, 8 bits a
// pass) raises theta, then the candidates below theta's margin are dropped in place, the
// kept ones in their order. The rule is gpusparse.tiled._compact's, which is its reference.
extern "C" __global__ void __launch_bounds__(NT) compact_candidates(
    u64* __restrict__ theta, int* __restrict__ count, int* __restrict__ cand_doc, u64* __restrict__ cand_val,
    const i64* __restrict__ q_delta, const int k, const int cap, const int most)
{
    __shared__ unsigned int hist[256];
    __shared__ u64 s_max, s_prefix;
    __shared__ int s_need, s_warp[NT / 32];
    const int q = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = min(count[q], cap);
    u64* val = cand_val + (i64)q * cap;
    int* doc = cand_doc + (i64)q * cap;
    u64 th = theta[q];
    if (most >= k && n >= k) {  // (a row of fewer than k keeps its theta, as in _compact)
        if (tid == 0) s_max = 0ull;
        __syncthreads();
        u64 m = 0ull;
        for (int i = tid; i < n; i += NT) m = max(m, val[i]);
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_down_sync(0xffffffffu, m, o));
        if (lane == 0) atomicMax(&s_max, m);
        if (tid == 0) {
            s_prefix = 0ull;
            s_need = k;
        }
        __syncthreads();
        const int top = s_max ? ((63 - __clzll((i64)s_max)) / 8) * 8 : 0;
        for (int shift = top; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += NT) hist[i] = 0u;
            __syncthreads();
            const u64 prefix = s_prefix;
            for (int i = tid; i < n; i += NT) {
                const u64 v = val[i];
                if (shift + 8 >= 64 || (v >> (shift + 8)) == (prefix >> (shift + 8)))
                    atomicAdd(&hist[(v >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                unsigned int cum = 0u;
                int b = 255;
                for (; b > 0; --b) {
                    if (cum + hist[b] >= (unsigned int)s_need) break;
                    cum += hist[b];
                }
                s_need -= (int)cum;
                s_prefix = prefix | ((u64)b << shift);
            }
            __syncthreads();
        }
        th = max(th, s_prefix);  // the k-th largest value
        if (tid == 0) theta[q] = th;
    }
    const u64 d = (u64)q_delta[q] + (th >> 22);
    const u64 thr = th > d ? max(th - d, 1ull) : 1ull;
    int kept = 0;
    for (int c0 = 0; c0 < n; c0 += NT) {
        const int i = c0 + tid;
        const u64 v = i < n ? val[i] : 0ull;
        const int dd = i < n ? doc[i] : 0;
        const bool keep = i < n && v >= thr;
        const unsigned int mask = __ballot_sync(0xffffffffu, keep);
        if (lane == 0) s_warp[warp] = __popc(mask);
        __syncthreads();  // every element of this piece is read: the writes below may overwrite it
        int dest = kept, total = 0;
        for (int w = 0; w < NT / 32; ++w) {
            if (w < warp) dest += s_warp[w];
            total += s_warp[w];
        }
        if (keep) {
            dest += __popc(mask & ((1u << lane) - 1u));  // <= i: nothing unread is overwritten
            val[dest] = v;
            doc[dest] = dd;
        }
        kept += total;
        __syncthreads();  // s_warp is rewritten by the next piece
    }
    if (tid == 0) count[q] = kept;
}
"""


@functools.cache
def _compact_kernel(device_index: int):  # -> cupy.RawKernel
    import cupy as cp

    with cp.cuda.Device(device_index):
        return cp.RawModule(code=COMPACT_SOURCE).get_function("compact_candidates")


def compact_candidates(
    theta: torch.Tensor,
    count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    delta: torch.Tensor,
    k: int,
    most: int,
) -> None:
    """:func:`gpusparse.tiled._compact` in one launch (a block per query), in place.

    ``theta`` int64 ``[B]``, ``count`` int32 ``[B]``, ``cand_doc`` int32 and ``cand_val``
    int64 ``[B, cap]``, ``delta`` int64 ``[B]``, contiguous on one CUDA device; ``most`` is the
    largest count (every count is at most ``cap``).
    """
    import cupy as cp

    dev = theta.device
    check_tensors(
        {
            "theta": (theta, torch.int64),
            "count": (count, torch.int32),
            "cand_doc": (cand_doc, torch.int32),
            "cand_val": (cand_val, torch.int64),
            "delta": (delta, torch.int64),
        },
        dev,
    )
    b, cap = cand_val.shape
    if b == 0 or most == 0:
        return
    kernel = _compact_kernel(dev.index if dev.index is not None else torch.cuda.current_device())
    args = [pointer(x) for x in (theta, count, cand_doc, cand_val, delta)]
    with cp.cuda.Device(dev.index), cupy_stream(dev):
        kernel((b,), (512,), (*args, cp.int32(k), cp.int32(cap), cp.int32(most)))


# Threads per block and resident blocks per SM the registers must allow; None: launch_shape's
# choice (profiling scripts set numbers to sweep them).
THREADS: int | None = None
UNROLL = 4  # sparse postings per thread and step
MIN_BLOCKS: int | None = None
# Accumulator modes (see CUDA_SOURCE) and the largest fixed-point value each holds: a query's
# scale keeps its score bound at or below ``top`` (rounding adds at most n/2 units).
ACC_MODES = {"carry": 0, "u32": 1}
ACC_TOP = {"carry": 2.0**61, "u32": 2.0**31}
# float32 weights; uint8 levels of a quantized index; int32 holding fixed-point float32
# weights (read as unsigned, FIXED_W).
_WEIGHT_TYPES = {torch.float32: "float", torch.uint8: "unsigned char", torch.int32: "unsigned int"}
# Extra -D options for profiling builds only (bench/profile_tiled.py: PROFILE_SKIP_DENSE,
# PROFILE_SKIP_SPARSE time one phase without the other; their results are wrong).
PROFILE_DEFINES: tuple[str, ...] = ()


def launch_shape(tile_bits: int, acc: str = "u32") -> tuple[int, int]:
    """``(threads, min_blocks)`` for tiles of ``2**tile_bits`` documents.

    Measured at 8.8M x 256 on an H200 (bench/results/2026-11-26-H200-profile-tiled-8.8M-v12-shape.json):
    at 8K documents a tile, 256 threads (32 documents each in the dense phase) with room in
    the registers for 4 blocks per SM beat 512 threads with 3 (search 14.5 against 15.4 ms
    at k = 1000), and 2 blocks were slowest. Larger tiles keep 32 documents a thread (at
    most 1,024 threads); the blocks per SM are what shared memory and the SM's 2,048
    threads allow.
    """
    tile = 1 << tile_bits
    threads = THREADS or min(tile, max(256, tile >> 5), 1024)
    fit = (227 << 10) // (shared_bytes(tile_bits, acc) + (8 << 10))  # + the static arrays
    return threads, MIN_BLOCKS or max(1, min(4 if threads <= 256 else 3, fit, 2048 // threads))


def check_tensors(expected: dict[str, tuple[torch.Tensor, torch.dtype]], dev: torch.device) -> None:
    """Refuse a kernel argument that is not a contiguous tensor of its dtype on ``dev``."""
    for name, (tensor, dtype) in expected.items():
        if tensor.dtype != dtype or tensor.device != dev or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor on {dev}")


def pointer(tensor: torch.Tensor) -> np.uint64:
    """A tensor's device address as a kernel argument (8 bytes, like the pointer parameter).

    Cheaper than wrapping each tensor with ``cupy.from_dlpack`` (~60 µs each, measured: a
    millisecond per launch); the caller has checked dtype, device and contiguity.
    """
    return np.uint64(tensor.data_ptr())


def cupy_stream(dev: torch.device):  # -> a CuPy stream context
    """PyTorch's current stream on ``dev``, as a CuPy stream (launches then order with PyTorch's)."""
    import cupy as cp

    stream = torch.cuda.current_stream(dev)
    if hasattr(cp.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cp.cuda.Stream.from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream)  # older CuPy or PyTorch


@functools.cache
def available() -> bool:
    """Whether the CUDA kernel can run here (CuPy importable and a CUDA device present)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel(
    tile_bits: int,
    device_index: int,
    threads: int,
    unroll: int,
    min_blocks: int,
    acc: str,
    weight_type: str,
    int_weights: bool,
    defines: tuple[str, ...] = (),
):  # -> cupy.RawKernel
    import cupy as cp

    with cp.cuda.Device(device_index):
        options = (
            "--std=c++17",
            f"-DTILE_BITS={tile_bits}",
            f"-DTHREADS={threads}",
            f"-DUNROLL={unroll}",
            f"-DMIN_BLOCKS={min_blocks}",
            f"-DACC_MODE={ACC_MODES[acc]}",
            f"-DWT={weight_type.replace(' ', '_')}",
            f"-DINT_W={int(int_weights and weight_type != 'unsigned int')}",
            f"-DFIXED_W={int(weight_type == 'unsigned int')}",
            *(f"-D{d}" for d in defines),
        )
        source = "typedef unsigned char unsigned_char;\ntypedef unsigned int unsigned_int;\n" + CUDA_SOURCE
        module = cp.RawModule(code=source, options=options)
        kernel = module.get_function("tiled_candidates")
        kernel.max_dynamic_shared_size_bytes = shared_bytes(tile_bits, acc)
    return kernel


def shared_bytes(tile_bits: int, acc: str) -> int:
    """Dynamic shared memory of one block: the tile's accumulators."""
    return (4 if acc == "u32" else 8) << tile_bits


def tiled_candidates(
    seg: torch.Tensor,
    offs: torch.Tensor,
    wts: torch.Tensor,
    dense_id: torch.Tensor,
    dense: torch.Tensor,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
    q_scale: torch.Tensor,
    q_delta: torch.Tensor,
    *,
    n_docs: int,
    n_terms: int,
    tile_bits: int,
    k: int,
    tiles: tuple[int, int] | None = None,
    select: bool = True,
    acc: str = "carry",
    int_weights: bool = False,
    q_shift: torch.Tensor | None = None,
    theta: torch.Tensor,
    cand_count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
) -> None:
    """Launch :data:`CUDA_SOURCE`'s kernel on the current PyTorch stream (see the module docstring).

    All tensors must be contiguous on one CUDA device: ``seg`` int64 ``[n_tiles·V + 1]``,
    ``offs`` int16 (read as unsigned) and ``wts`` float32 or uint8 ``[P]``, ``dense_id`` int32
    ``[n_tiles·V]``, ``dense`` (``wts``'s dtype) ``[n_dense, 2**tile_bits]``, ``q_terms`` int32 and
    ``q_weights`` float32 ``[B, T]``, ``q_scale`` float64 and ``q_delta`` int64 ``[B]``,
    ``theta`` int64 ``[B]`` (zeros, updated), ``cand_count`` int32 ``[B]`` (zeros, updated),
    ``cand_doc`` int32 and ``cand_val`` int64 ``[B, cap]`` (written). ``tiles = (first, count)``
    restricts the launch to a range of tiles (default: all). ``select=False`` skips each
    block's own k-th selection and relies on ``theta`` alone (for waves after the first).
    ``acc`` is the accumulator mode (:data:`ACC_MODES`); the caller's scales must keep every
    sum within its :data:`ACC_TOP`. ``int_weights`` (with "u32" only): every
    ``q_weights · q_scale`` is an integer (checked by the caller), so the kernel multiplies
    integers. int32 ``wts`` are fixed-point float32 weights (FIXED_W, "u32" only): each query
    weight is rounded to ``round(q_weights · q_scale)`` and each product shifted right by the
    query's ``q_shift`` (int32 ``[B]``).
    """
    import cupy as cp

    b, t = q_terms.shape
    cap = cand_doc.shape[1]
    n_tiles = (n_docs + (1 << tile_bits) - 1) >> tile_bits
    expected = {
        "seg": (seg, torch.int64),
        "offs": (offs, torch.int16),
        "wts": (wts, wts.dtype if wts.dtype in _WEIGHT_TYPES else torch.float32),
        "dense_id": (dense_id, torch.int32),
        "dense": (dense, wts.dtype),
        "q_terms": (q_terms, torch.int32),
        "q_weights": (q_weights, torch.float32),
        "q_scale": (q_scale, torch.float64),
        "q_delta": (q_delta, torch.int64),
        "theta": (theta, torch.int64),
        "cand_count": (cand_count, torch.int32),
        "cand_doc": (cand_doc, torch.int32),
        "cand_val": (cand_val, torch.int64),
    }
    dev = seg.device
    if acc not in ACC_MODES:
        raise ValueError(f"acc must be one of {sorted(ACC_MODES)}")
    if int_weights and acc != "u32":
        raise ValueError('int_weights needs acc="u32"')
    fixed = wts.dtype == torch.int32
    if fixed and (acc != "u32" or q_shift is None):
        raise ValueError('fixed-point weights need acc="u32" and q_shift')
    expected["q_shift"] = (cand_count if q_shift is None else q_shift, torch.int32)  # None: any int32, not read
    check_tensors(expected, dev)
    q_shift = expected["q_shift"][0]
    if seg.numel() != n_tiles * n_terms + 1:
        raise ValueError("seg does not match n_docs, n_terms and tile_bits")
    first, count = (0, n_tiles) if tiles is None else tiles
    if not (first >= 0 and count >= 0 and first + count <= n_tiles):
        raise ValueError(f"tile range {tiles} outside 0..{n_tiles}")
    if count > 65535:
        raise ValueError(f"{count} tiles exceed the grid's y limit; use larger tiles or waves")
    if b == 0 or count == 0 or t == 0:
        return
    threads, min_blocks = launch_shape(tile_bits, acc)
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    wtype = _WEIGHT_TYPES[wts.dtype]
    kernel = _kernel(tile_bits, dev_index, threads, UNROLL, min_blocks, acc, wtype, int_weights, PROFILE_DEFINES)
    if dense.numel() == 0:  # CuPy wants real memory behind every pointer
        dense = torch.zeros((1, 1 << tile_bits), dtype=wts.dtype, device=dev)
    args = [pointer(x) for x in (seg, offs, wts, dense_id, dense, q_terms, q_weights, q_scale, q_delta, q_shift)]
    ints = [cp.int32(t), cp.int32(n_terms), cp.int32(n_docs), cp.int32(k), cp.int32(first), cp.int32(select)]
    outs = [pointer(x) for x in (theta, cand_count, cand_doc, cand_val)]
    with cp.cuda.Device(dev.index), cupy_stream(dev):
        kernel((b, count), (threads,), (*args, *ints, *outs, cp.int32(cap)), shared_mem=shared_bytes(tile_bits, acc))
