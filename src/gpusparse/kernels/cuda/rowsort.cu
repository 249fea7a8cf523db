// Row top-k of ranking keys and the NCCL merge's pack / merge: gpusparse.kernels.rowsort
// (top_keys_cuda, pack_results_cuda, merge_gathered_cuda).
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
