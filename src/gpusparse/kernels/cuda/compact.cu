// One-launch compaction of a wave's candidates: gpusparse.kernels.compact.compact_candidates.
typedef unsigned long long u64;
typedef long long i64;
#define NT 512
// One block per query: the k-th largest candidate value's leading 16 bits (two passes of an
// MSB-first radix select, 8 bits a pass, from the byte holding the row's largest value's top
// bit; the bits below are 0: a lower bound of the k-th value within 2**-8 of it) raise theta,
// then the candidates below theta's margin are dropped in place, the kept ones in their order.
// The passes that would resolve the lower bits cost their time and bought a threshold at most
// ~0.4 % higher: a few more candidates kept, the same results. The rule is
// gpusparse.engines.tiled.waves.compact_torch's, which is its reference.
// A row's first `cached` values are kept in shared memory (dynamic, 8 bytes each) by the first
// pass, so that the radix passes do not wait on global loads: a small batch has one block a
// query, whose passes are latency-bound. `overflow` (may be null): set for a row whose count
// exceeds cap (candidates counted but not stored), before the count is rewritten.
extern "C" __global__ void __launch_bounds__(NT) compact_candidates(
    u64* __restrict__ theta, int* __restrict__ count, int* __restrict__ cand_doc, u64* __restrict__ cand_val,
    const i64* __restrict__ q_delta, const int k, const int cap, const int most, const int cached,
    bool* __restrict__ overflow)
{
    extern __shared__ u64 cache[];
    __shared__ unsigned int hist[256];
    __shared__ u64 s_max, s_prefix;
    __shared__ int s_need, s_warp[NT / 32];
    const int q = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = min(count[q], cap);
    if (tid == 0 && overflow != nullptr && count[q] > cap) overflow[q] = true;
    u64* val = cand_val + (i64)q * cap;
    int* doc = cand_doc + (i64)q * cap;
    u64 th = theta[q];
    if (most >= k && n >= k) {  // (a row of fewer than k keeps its theta, as in _compact)
        if (tid == 0) s_max = 0ull;
        __syncthreads();
        u64 m = 0ull;
        for (int i = tid; i < n; i += NT) {
            const u64 v = val[i];
            if (i < cached) cache[i] = v;
            m = max(m, v);
        }
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_down_sync(0xffffffffu, m, o));
        if (lane == 0) atomicMax(&s_max, m);
        if (tid == 0) {
            s_prefix = 0ull;
            s_need = k;
        }
        __syncthreads();
        const int top = s_max ? ((63 - __clzll((i64)s_max)) / 8) * 8 : 0;
        for (int shift = top; shift >= 0 && shift >= top - 8; shift -= 8) {
            for (int i = tid; i < 256; i += NT) hist[i] = 0u;
            __syncthreads();
            const u64 prefix = s_prefix;
            for (int i = tid; i < n; i += NT) {
                const u64 v = i < cached ? cache[i] : val[i];
                if (shift + 8 >= 64 || (v >> (shift + 8)) == (prefix >> (shift + 8)))
                    atomicAdd(&hist[(v >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (warp == 0) {
                // the highest bin b >= 1 whose count from the top reaches s_need, else 0 (the
                // counts above it are dropped from s_need); lane l sums bins 255 - 8l down to 248 - 8l
                const unsigned int need = (unsigned int)s_need;
                unsigned int own = 0u;
                for (int j = 0; j < 8; ++j) own += hist[255 - 8 * lane - j];
                unsigned int incl = own;
                for (int o = 1; o < 32; o <<= 1) {
                    const unsigned int up = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += up;
                }
                const unsigned int hit = __ballot_sync(0xffffffffu, incl >= need);
                const int first = hit ? __ffs(hit) - 1 : 31;  // counts always reach need; 31 holds bin 0
                if (lane == first) {
                    unsigned int cum = incl - own;
                    int b = 255 - 8 * lane;
                    for (int j = 0; j < 8 && b > 0; ++j, --b) {
                        if (cum + hist[b] >= need) break;
                        cum += hist[b];
                    }
                    s_need -= (int)cum;
                    s_prefix = prefix | ((u64)b << shift);
                }
            }
            __syncthreads();
        }
        th = max(th, s_prefix);  // the k-th largest value's leading 16 bits
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
