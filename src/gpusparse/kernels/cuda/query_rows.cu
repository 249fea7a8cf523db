// A query batch from its rows (CSR) to the padded layout the tiled engine reads, quantized on the
// way where the index is: gpusparse.kernels.query_rows. One block a row (the CUDA graph's first
// kernel: the host then copies the batch's CSR, ~8 bytes a term, instead of quantizing and
// padding it itself, ~50 µs at batch 256 on an H200's host).
//
// With bits > 0, the row's weights become levels of its own power-of-two step as the host's C
// pass (gpusparse._queries_native.quantize) makes them: m the row's largest weight; step = 2**e,
// e the binary exponent of m (frexp) minus bits, plus one where m > (2**bits - 1) * 2**e; a weight
// v becomes rint(v * (1 / step)) * step (float64, half to even; exact: 1 / step is a power of two)
// rounded to float32, and terms whose level is 0 are dropped, the rest keeping their order.
// Weights are finite and > 0 (SparseCollection's rule). With bits == 0 the row is copied as is.
typedef long long i64;
#define THREADS 128
#define WARPS (THREADS / 32)

extern "C" __global__ void __launch_bounds__(THREADS) query_rows(
    const int* __restrict__ indptr, const int* __restrict__ indices, const float* __restrict__ values,
    const int width, const int bits, i64* __restrict__ terms, float* __restrict__ weights,
    int* __restrict__ terms32)  // the terms again as int32 (the search kernels' type)
{
    __shared__ float s_max[WARPS];
    __shared__ int s_count[WARPS];
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int a = indptr[r], n = indptr[r + 1] - a;
    i64* t_out = terms + (i64)r * width;
    float* w_out = weights + (i64)r * width;
    int* t32_out = terms32 + (i64)r * width;
    double step = 1.0, inv = 1.0;
    if (bits > 0) {
        float m = 0.0f;  // weights are > 0
        for (int i = tid; i < n; i += THREADS) m = fmaxf(m, values[a + i]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) s_max[warp] = m;
        __syncthreads();
        m = s_max[0];
        for (int w = 1; w < WARPS; ++w) m = fmaxf(m, s_max[w]);
        if (m > 0.0f) {
            int x;
            frexp((double)m, &x);
            x -= bits;
            if ((double)m > ldexp((double)((1 << bits) - 1), x)) x += 1;
            step = ldexp(1.0, x);
            inv = 1.0 / step;
        }
    }
    int kept = 0;  // the row's kept terms before this chunk (the same on every thread)
    for (int i0 = 0; i0 < n; i0 += THREADS) {
        const int i = i0 + tid;
        int term = -1;
        float q = 0.0f;
        if (i < n) {
            term = indices[a + i];
            const float v = values[a + i];
            q = bits > 0 ? __double2float_rn(rint(__dmul_rn((double)v, inv)) * step) : v;
        }
        const bool keep = i < n && (bits == 0 || q > 0.0f);
        const unsigned int ball = __ballot_sync(0xffffffffu, keep);
        __syncthreads();  // the last chunk's counts are read
        if (lane == 0) s_count[warp] = __popc(ball);
        __syncthreads();
        int before = kept, total = kept;
        for (int w = 0; w < WARPS; ++w) {
            const int c = s_count[w];
            before += w < warp ? c : 0;
            total += c;
        }
        if (keep) {
            const int at = before + __popc(ball & ((1u << lane) - 1u));
            t_out[at] = term;
            w_out[at] = q;
            t32_out[at] = term;
        }
        kept = total;
    }
    for (int j = kept + tid; j < width; j += THREADS) {
        t_out[j] = -1;
        w_out[j] = 0.0f;
        t32_out[j] = -1;
    }
}
