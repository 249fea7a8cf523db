// The tiled engine's fixed-point parameters on the device: gpusparse.kernels.query_params.
typedef long long i64;
// One thread per query row. The row's reductions over its padded slots (term -1, weight 0),
// then the per-query arithmetic of gpusparse.engines.tiled.fixed_point._parameters in the same
// float64 operations and order (the explicit _rn intrinsics keep the compiler from fusing
// them). A row whose parameters are out of the fixed-point range (where the host raises), or
// whose scaled weights are not integers while the kernel multiplies integers, is flagged in
// redo: its results are not used, and the general path searches it again.
extern "C" __global__ void query_params(
    const i64* __restrict__ terms, const float* __restrict__ weights, const int b, const int width,
    const float* __restrict__ max_scores, const int top_bits, const double min_w, const double max_w,
    const int weight_bits,  // -1: none (float64 or 8-bit products)
    const double step,      // > 0: the kernel multiplies integers, w * scale * step must be one
    const i64 max_delta,
    double* __restrict__ scale_out, i64* __restrict__ delta_out, double* __restrict__ mult_out,
    int* __restrict__ shift_out, double* __restrict__ lb_out, bool* __restrict__ redo)
{
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= b) return;
    const i64* t = terms + (i64)q * width;
    const float* w = weights + (i64)q * width;
    double ub = 0.0, qsum = 0.0;
    float qmin = __int_as_float(0x7f800000), qmax = 0.0f;  // +inf; padding's 0 counts in qmax
    int n = 0;
    for (int j = 0; j < width; ++j) {
        const float wj = w[j];
        qsum = __dadd_rn(qsum, (double)wj);
        qmax = j == 0 ? wj : fmaxf(qmax, wj);
        if (t[j] >= 0) {
            ub = __dadd_rn(ub, __dmul_rn((double)wj, (double)max_scores[t[j]]));
            qmin = fminf(qmin, wj);
            ++n;
        }
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
        mult_out[q] = ldexp(scale, c);
        shift_out[q] = shift;
    }
    if (step > 0.0) {  // integer products: every scaled weight must be an integer
        const double unit = __dmul_rn(scale, step);
        for (int j = 0; j < width; ++j) {
            const double v = __dmul_rn((double)w[j], unit);
            if (v != rint(v)) bad = true;
        }
    }
    scale_out[q] = scale;
    delta_out[q] = bad ? (i64)0 : (i64)delta;
    lb_out[q] = lb;
    redo[q] = bad;
}
