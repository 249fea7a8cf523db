// The tiled engine's last device step in one launch: gpusparse.kernels.finish.finish_rows.
typedef long long i64;
#define NT 128
#define ID_BITS 31
#define ID_MASK ((1ll << ID_BITS) - 1ll)
// One block per row. Ranked int64 keys (gpusparse.topk.encode_keys; 0 = empty) become float32
// scores and int64 ids padded to k columns (score 0 -> id -1, as gpusparse.exact.pad_results),
// and the row is flagged where its top-k may miss matches below one fixed-point unit (the rule
// of gpusparse.engines.tiled.fixed_point.uncertain_rows, in the same float64 operations: the
// explicit _rn intrinsics keep the compiler from fusing them). The row's flag (`flags`) is
// `redo`'s, set where that rule fails or where the row has more candidates than its keys'
// width (`count` may be null: not checked).
extern "C" __global__ void __launch_bounds__(NT) finish_rows(
    const i64* __restrict__ top, const int kk, const int k, const i64* __restrict__ delta,
    const double* __restrict__ scale, const double* __restrict__ lb, const double* __restrict__ floor_,
    const int* __restrict__ count, const int width, const bool* __restrict__ redo,
    float* __restrict__ scores, i64* __restrict__ ids, bool* __restrict__ flags)
{
    const int q = blockIdx.x;
    const i64* row = top + (i64)q * kk;
    float* s_out = scores + (i64)q * k;
    i64* i_out = ids + (i64)q * k;
    for (int c = threadIdx.x; c < k; c += NT) {
        float s = 0.0f;
        i64 id = -1;
        if (c < kk) {
            const i64 key = row[c];
            const float v = __int_as_float((int)(key >> ID_BITS));
            if (v > 0.0f) {
                s = v;
                id = ID_MASK - (key & ID_MASK);
            }
        }
        s_out[c] = s;
        i_out[c] = id;
    }
    if (threadIdx.x == 0) {
        double kth = 0.0;
        if (k - 1 < kk) {
            const float v = __int_as_float((int)(row[k - 1] >> ID_BITS));
            kth = v > 0.0f ? (double)v : 0.0;
        }
        if (floor_ != nullptr) kth = fmax(kth, floor_[q]);
        kth = __dmul_rn(__dmul_rn(kth, scale[q]), 1.0 - 0x1p-22);
        const double d = (double)delta[q];
        const bool certain = kth > d || __dmul_rn(lb[q], scale[q]) >= __dadd_rn(__dmul_rn(d, 0.5), 1.0);
        flags[q] = redo[q] || !certain || (count != nullptr && count[q] > width);
    }
}
