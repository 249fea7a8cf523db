// The tiled engine's fixed-point parameters on the device: gpusparse.kernels.query_params.
typedef long long i64;
// One warp per query row (a thread per row waited on each slot's dependent loads in turn: ~25 µs
// at batch 1). The row's reductions over its padded slots (term -1, weight 0), lanes taking
// every 32nd slot and combining by shuffles, then, on every lane, the per-query arithmetic of
// gpusparse.engines.tiled.fixed_point._parameters in the same float64 operations and order (the
// explicit _rn intrinsics keep the compiler from fusing them). A row whose parameters are out of
// the fixed-point range (where the host raises), or whose scaled weights are not integers while
// the kernel multiplies integers, is flagged in redo: its results are not used, and the general
// path searches it again.
#define WARPS 4
extern "C" __global__ void __launch_bounds__(WARPS * 32) query_params(
    const i64* __restrict__ terms, const float* __restrict__ weights, const int b, const int width,
    const float* __restrict__ max_scores, const int top_bits, const double min_w, const double max_w,
    const int weight_bits,  // -1: none (float64 or 8-bit products)
    const double step,      // > 0: the kernel multiplies integers, w * scale * step must be one (terms with postings)
    const i64 max_delta,
    double* __restrict__ scale_out, i64* __restrict__ delta_out, double* __restrict__ mult_out,
    int* __restrict__ shift_out, double* __restrict__ lb_out, bool* __restrict__ redo)
{
    const int q = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (q >= b) return;  // the whole warp: its shuffles stay full
    const i64* t = terms + (i64)q * width;
    const float* w = weights + (i64)q * width;
    double ub = 0.0, qsum = 0.0;
    float qmin = __int_as_float(0x7f800000), qmax = __int_as_float(0xff800000);  // +inf, -inf
    int n = 0;
    for (int j = lane; j < width; j += 32) {
        const float wj = w[j];
        qsum = __dadd_rn(qsum, (double)wj);
        qmax = fmaxf(qmax, wj);  // padding's 0 counts, as in numpy's reduction over the row
        const i64 tj = t[j];
        if (tj >= 0) {
            ub = __dadd_rn(ub, __dmul_rn((double)wj, (double)max_scores[tj]));
            qmin = fminf(qmin, wj);
            ++n;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        ub = __dadd_rn(ub, __shfl_xor_sync(0xffffffffu, ub, o));
        qsum = __dadd_rn(qsum, __shfl_xor_sync(0xffffffffu, qsum, o));
        qmin = fminf(qmin, __shfl_xor_sync(0xffffffffu, qmin, o));
        qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, o));
        n += __shfl_xor_sync(0xffffffffu, n, o);
    }
    if (width == 0) qmax = 0.0f;
    const double nd = (double)n;
    int expo;
    const double mant = frexp(ub, &expo);
    int e = top_bits - expo + (mant == 0.5 ? 1 : 0);
    e = min(max(e, -1000), 1000);
    const double scale = ub > 0.0 ? ldexp(1.0, e) : 1.0;
    const double canon = __dmul_rn(__dmul_rn(__dmul_rn(__dmul_rn(ub, scale), 2.0), __dadd_rn(nd, 1.0)), 0x1p-53);
    const double lb = __dmul_rn((double)qmin, min_w);
    double delta;
    bool bad = false;
    if (weight_bits < 0) {
        delta = ceil(__dadd_rn(__dadd_rn(__dmul_rn(2.0, __dadd_rn(__dmul_rn(nd, 0.5), 1.0)), __dmul_rn(2.0, canon)), 2.0));
    } else {
        const double qmax_s = __dmul_rn((double)qmax, scale);
        const double qsum_s = __dmul_rn(qsum, scale);
        int qexpo;
        frexp(qmax_s, &qexpo);
        const int c = qmax_s > 0.0 ? 31 - qexpo : 0;
        double err = __dadd_rn(__dadd_rn(nd, __dmul_rn(__dmul_rn(nd, max_w), ldexp(0.5, -c))),
                               __dmul_rn(qsum_s, ldexp(1.0, -(weight_bits + 1))));
        err = __dadd_rn(err, __dmul_rn(nd, ldexp(0.25, -(weight_bits + c))));
        delta = ceil(__dadd_rn(__dadd_rn(__dmul_rn(2.0, __dadd_rn(err, 1.0)), __dmul_rn(2.0, canon)), 2.0));
        const int shift = weight_bits + c;
        bad = shift < 0 || shift > 62 || delta > (double)max_delta;
        if (lane == 0) {
            mult_out[q] = ldexp(scale, c);
            shift_out[q] = shift;
        }
    }
    if (step > 0.0) {  // integer products: every scaled weight must be an integer
        const double unit = __dmul_rn(scale, step);
        bool frac = false;
        for (int j = lane; j < width; j += 32) {  // a term without postings is never multiplied
            const i64 tj = t[j];
            const double v = __dmul_rn((double)w[j], unit);
            frac |= tj >= 0 && max_scores[tj] > 0.0f && v != rint(v);
        }
        bad |= __any_sync(0xffffffffu, frac);
    }
    if (lane != 0) return;
    scale_out[q] = scale;
    // Integer products (step > 0, the row not flagged): every product and partial sum is exact, in
    // the kernel as in the canonical float64 sum, so the margin is 0 (fixed_point.exact_margin).
    delta_out[q] = bad || step > 0.0 ? (i64)0 : (i64)delta;
    lb_out[q] = lb;
    redo[q] = bad;
}
