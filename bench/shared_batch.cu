// One block per document chunk for the whole batch (issue 23, fifth session; a benchmark prototype).
//
// Compile-time parameters (-D): THREADS (a multiple of 32, <= 1024), ITEMS (postings a thread loads per
// window; the window is W = THREADS * ITEMS postings), CHUNK (documents a chunk, <= 256), NQ (queries,
// <= 256), STRIDE (the accumulators' row stride, >= NQ; odd).
//
// Inputs (see bench/shared_batch_ops.py): post uint32 [nnz] = term << 16 | offset << 8 | level, sorted
// by (term, offset) inside each chunk; chunk_start int64 [n_chunks + 1]; tinfo int32 [V] = qoff << 9 | m
// (m queries of the term, their entries at qlist[qoff, qoff + m); 0 outside the batch); qlist uint16
// [n_pairs] = query << 8 | query level; theta int32 [NQ] (candidates: acc >= theta[q], none where
// theta[q] <= 0). Outputs: qmax int32 [NQ] (atomicMax; zeroed by the caller), cand_count int32 [NQ]
// (zeroed by the caller; may exceed cap: the excess is the overflow), cand_doc / cand_val int32
// [NQ][cap]. Scores are exact integers sum(q_level * d_level) < 2**31 (<= 30522 terms * 255 * 255).
//
// Shared memory (dynamic): acc uint32 [CHUNK][STRIDE] | cpost uint32 [W] | cinfo uint32 [W] |
// aux uint32 [W + 1] (flat: the pair prefix; warp: the run starts) | smax int32 [NQ] |
// scan uint64 [THREADS / 32] | qlist uint16 [n_pairs].
//
// A window: each thread loads ITEMS consecutive postings and looks each term up in tinfo (global,
// cached); one block scan of a packed uint64 (pairs | postings << 32 | runs << 48) compacts the
// window's postings of batch terms in order and gives each its exclusive pair prefix and run number.
// flat: the window's P pairs are split evenly over the threads; each thread binary-searches the prefix
// for its first posting and walks: query + 1, wrapping to the next posting. warp: a warp per run (equal
// terms), lane l taking query l % m of posting l / m, then 32 pairs further each step.
// After the chunk's windows, one pass over acc: per-query maxima, candidates, and acc zeroed.

#ifndef THREADS
#define THREADS 1024
#endif
#ifndef ITEMS
#define ITEMS 4
#endif
#ifndef CHUNK
#define CHUNK 128
#endif
#ifndef NQ
#define NQ 256
#endif
#ifndef STRIDE
#define STRIDE 257
#endif

#define W (THREADS * ITEMS)
#define NWARPS (THREADS / 32)
#define ACC_WORDS (CHUNK * STRIDE)

typedef unsigned int u32;
typedef unsigned long long u64;

// Exclusive scan of v over the block; *total gets the block's sum. Ends with every thread past a
// __syncthreads after the last write of scan[] (so the caller may write what the scan orders).
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, u64* scan, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 x = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u64 y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) scan[warp] = x;
    __syncthreads();
    if (warp == 0) {
        u64 s = lane < NWARPS ? scan[lane] : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            u64 y = __shfl_up_sync(0xffffffffu, s, d);
            if (lane >= d) s += y;
        }
        if (lane < NWARPS) scan[lane] = s;  // inclusive sums of the warps
    }
    __syncthreads();
    *total = scan[NWARPS - 1];
    return (warp ? scan[warp - 1] : 0ull) + x - v;
}

template <int WARP_PER_RUN>
__device__ __forceinline__ void chunk_batch(const u32* __restrict__ post, const long long* __restrict__ chunk_start,
                                            int n_chunks, int n_docs, const int* __restrict__ tinfo,
                                            const unsigned short* __restrict__ qlist, int n_pairs,
                                            const int* __restrict__ theta, int emit, int* __restrict__ qmax,
                                            int* __restrict__ cand_count, int* __restrict__ cand_doc,
                                            int* __restrict__ cand_val, int cap) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u32* acc = reinterpret_cast<u32*>(smem_raw);
    u32* cpost = acc + ACC_WORDS;
    u32* cinfo = cpost + W;
    u32* aux = cinfo + W;               // W + 1 entries
    int* smax = reinterpret_cast<int*>(aux + W + 1);
    u64* scan = reinterpret_cast<u64*>(smem_raw + ((4ull * (ACC_WORDS + 3 * W + 1 + NQ) + 7) & ~7ull));
    unsigned short* qls = reinterpret_cast<unsigned short*>(scan + NWARPS);

    const int tid = threadIdx.x;
    for (int i = tid; i < n_pairs; i += THREADS) qls[i] = qlist[i];
    for (int i = tid; i < ACC_WORDS; i += THREADS) acc[i] = 0u;
    for (int i = tid; i < NQ; i += THREADS) smax[i] = 0;
    __syncthreads();

    for (int chunk = blockIdx.x; chunk < n_chunks; chunk += gridDim.x) {
        const long long cs = chunk_start[chunk], ce = chunk_start[chunk + 1];
        for (long long w0 = cs; w0 < ce; w0 += W) {
            const int wn = ce - w0 < (long long)W ? (int)(ce - w0) : W;
            u32 p[ITEMS], inf[ITEMS];
            u64 val[ITEMS];
            u64 local = 0;
            u32 prev_term = 0xffffffffu;  // no posting has this term: the window's first starts a run
            const int first = tid * ITEMS;
            if (first > 0 && first < wn) prev_term = post[w0 + first - 1] >> 16;
#pragma unroll
            for (int i = 0; i < ITEMS; ++i) {
                const int idx = first + i;
                p[i] = 0u;
                inf[i] = 0u;
                val[i] = 0ull;
                if (idx < wn) {
                    p[i] = post[w0 + idx];
                    const u32 term = p[i] >> 16;
                    inf[i] = (u32)__ldg(tinfo + term);
                    const u32 m = inf[i] & 511u;
                    if (m) val[i] = (u64)m | (1ull << 32) | ((u64)(term != prev_term) << 48);
                    prev_term = term;
                    local += val[i];
                }
            }
            u64 total;
            u64 run = block_exclusive_scan(local, scan, &total);
#pragma unroll
            for (int i = 0; i < ITEMS; ++i) {
                if (val[i]) {
                    const int c = (int)((run >> 32) & 0xffffu);
                    cpost[c] = p[i];
                    cinfo[c] = inf[i];
                    if (WARP_PER_RUN) {
                        if (val[i] >> 48) aux[(int)(run >> 48)] = (u32)c;
                    } else {
                        aux[c] = (u32)(run & 0xffffffffu);
                    }
                    run += val[i];
                }
            }
            const int count = (int)((total >> 32) & 0xffffu);
            const u32 pairs = (u32)(total & 0xffffffffu);
            const int n_runs = (int)(total >> 48);
            if (tid == 0) aux[WARP_PER_RUN ? n_runs : count] = WARP_PER_RUN ? (u32)count : pairs;
            __syncthreads();

            if (!WARP_PER_RUN) {
                const u32 lo = (u32)(((u64)pairs * tid) / THREADS);
                const u32 hi = (u32)(((u64)pairs * (tid + 1)) / THREADS);
                if (lo < hi) {
                    // the last compacted posting whose prefix is <= lo (prefixes strictly increase: m >= 1)
                    int a = 0, b = count - 1;
                    while (a < b) {
                        const int mid = (a + b + 1) >> 1;
                        if (aux[mid] <= lo) a = mid; else b = mid - 1;
                    }
                    int c = a;
                    u32 j = lo - aux[c];
                    u32 info = cinfo[c], pp = cpost[c];
                    u32 m = info & 511u, qoff = info >> 9;
                    u32 base = ((pp >> 8) & 255u) * STRIDE, dl = pp & 255u;
                    for (u32 n = hi - lo; n > 0; --n) {
                        const u32 e = qls[qoff + j];
                        atomicAdd(acc + base + (e >> 8), (e & 255u) * dl);
                        if (++j == m && n > 1) {
                            j = 0;
                            ++c;  // < count: pairs remain
                            info = cinfo[c];
                            pp = cpost[c];
                            m = info & 511u;
                            qoff = info >> 9;
                            base = ((pp >> 8) & 255u) * STRIDE;
                            dl = pp & 255u;
                        }
                    }
                }
            } else {
                const int lane = tid & 31;
                for (int r = tid >> 5; r < n_runs; r += NWARPS) {
                    const u32 c0 = aux[r], c1 = aux[r + 1];
                    const u32 info = cinfo[c0];
                    const u32 m = info & 511u, qoff = info >> 9;
                    const u32 n_run_pairs = (c1 - c0) * m;
                    u32 pi = (u32)lane / m, j = (u32)lane - pi * m;
                    const u32 si = 32u / m, sj = 32u - si * m;
                    for (u32 q = lane; q < n_run_pairs; q += 32) {
                        const u32 pp = cpost[c0 + pi];
                        const u32 e = qls[qoff + j];
                        atomicAdd(acc + ((pp >> 8) & 255u) * STRIDE + (e >> 8), (e & 255u) * (pp & 255u));
                        j += sj;
                        pi += si;
                        if (j >= m) {
                            j -= m;
                            ++pi;
                        }
                    }
                }
            }
            __syncthreads();  // the window's compacted arrays are free again
        }

        // selection: per-query maxima, candidates at theta, accumulators zeroed
        const int docs = n_docs - chunk * CHUNK < CHUNK ? n_docs - chunk * CHUNK : CHUNK;
        for (int e = tid; e < ACC_WORDS; e += THREADS) {
            const int d = e / STRIDE, q = e - d * STRIDE;
            const int v = (int)acc[e];
            acc[e] = 0u;
            if (q < NQ && d < docs && v > 0) {
                if (v > smax[q]) atomicMax(smax + q, v);
                if (emit) {
                    const int th = __ldg(theta + q);
                    if (th > 0 && v >= th) {
                        const int slot = atomicAdd(cand_count + q, 1);
                        if (slot < cap) {
                            cand_doc[(long long)q * cap + slot] = chunk * CHUNK + d;
                            cand_val[(long long)q * cap + slot] = v;
                        }
                    }
                }
            }
        }
        __syncthreads();
        for (int q = tid; q < NQ; q += THREADS) {
            if (smax[q] > 0) atomicMax(qmax + q, smax[q]);
            smax[q] = 0;
        }
        __syncthreads();  // smax flushed before any later selection (an empty chunk has no window barriers)
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    chunk_batch_flat(const u32* post, const long long* chunk_start, int n_chunks, int n_docs, const int* tinfo,
                     const unsigned short* qlist, int n_pairs, const int* theta, int emit, int* qmax, int* cand_count,
                     int* cand_doc, int* cand_val, int cap) {
    chunk_batch<0>(post, chunk_start, n_chunks, n_docs, tinfo, qlist, n_pairs, theta, emit, qmax, cand_count,
                   cand_doc, cand_val, cap);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    chunk_batch_warp(const u32* post, const long long* chunk_start, int n_chunks, int n_docs, const int* tinfo,
                     const unsigned short* qlist, int n_pairs, const int* theta, int emit, int* qmax, int* cand_count,
                     int* cand_doc, int* cand_val, int cap) {
    chunk_batch<1>(post, chunk_start, n_chunks, n_docs, tinfo, qlist, n_pairs, theta, emit, qmax, cand_count,
                   cand_doc, cand_val, cap);
}
