// bench/tile_meta_order.py's variant of tile_candidates.cu's tile_meta: the same records, from
// copies of the layout's segment starts and dense row ids stored term-major ([term][tile], a
// row of NTT tiles a term) instead of tile-major ([tile][term]). A warp walks META_TILES
// consecutive tiles of one query, so a lane's eight tiles of one term lie in one or two 32-byte
// sectors instead of eight. Appended to tile_candidates.cu's text and compiled with the META
// build's options (it uses that file's helpers and META_TILES).
extern "C" __global__ void __launch_bounds__(128) tile_meta_tm(
    const int* __restrict__ seg_t, const i64* __restrict__ tile_start, const short* __restrict__ did_t,
    const int* __restrict__ q_terms, const float* __restrict__ q_weights, const double* __restrict__ q_scale,
    const int T, const int V, const int B, const int tile0, const int n_tiles, int4* __restrict__ rec, const int NTT)
{
    __shared__ int st_row[4][MAXT];
    __shared__ unsigned int st_wi[4][MAXT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q = blockIdx.x * 4 + warp;
    if (q >= B) return;
    const int r0 = blockIdx.y * META_TILES, r1 = min(n_tiles, r0 + META_TILES);
    const unsigned int below = (1u << lane) - 1u;
    constexpr int NC = MAXT / 32;
    int tc[NC];
    unsigned int wic[NC];
    {
        const int* terms = q_terms + (i64)q * T;
        const float* qw = q_weights + (i64)q * T;
        const double scale = q_scale[q];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int j = c * 32 + lane;
            tc[c] = -1;
            wic[c] = 0u;
            if (j < T) {
                tc[c] = terms[j];
                wic[c] = (unsigned int)((double)qw[j] * scale);
            }
        }
    }
    int did[NC], start[NC], end[NC], phase = 0;
    auto fetch = [&](int r) {
        const int tile = tile0 + r;
        phase = (int)(tile_start[tile] & (OCT - 1));
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            did[c] = -1;
            start[c] = end[c] = 0;
            if (tc[c] >= 0) {
                start[c] = seg_t[(i64)tc[c] * NTT + tile];
                end[c] = seg_t[(i64)(tc[c] + 1) * NTT + tile];
            }
        }
    };
    auto fetch_rows = [&](int r) {
        const int tile = tile0 + r;
#pragma unroll
        for (int c = 0; c < NC; ++c)
            if (tc[c] >= 0 && end[c] == start[c]) did[c] = did_t[(i64)tc[c] * NTT + tile];
    };
    if (r0 < r1) {
        fetch(r0);
        fetch_rows(r0);
    }
    for (int r = r0; r < r1; ++r) {
        int n[NC], dd[NC], st[NC];
        const int ph = phase;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            n[c] = end[c] - start[c];
            dd[c] = did[c];
            st[c] = start[c];
        }
        if (r + 1 < r1) fetch(r + 1);
        int4* out = rec + ((i64)r * B + q) * (T + 1);
        int nd = 0, ns = 0, octs = 0;
        unsigned int any = 0u, top = 0u;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const bool dense = dd[c] >= 0, sparse = !dense && n[c] > 0;
            const unsigned int bd = __ballot_sync(0xffffffffu, dense), bs = __ballot_sync(0xffffffffu, sparse);
            if ((bd | bs) == 0u) continue;
            const int nq = sparse ? oct_count(ph + st[c], n[c]) : 0;
            int incl = nq;
            for (int o = 1; o < 32; o <<= 1) {
                const int up = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += up;
            }
            if (sparse) out[1 + ns + __popc(bs & below)] = make_int4(st[c], n[c], (int)wic[c], octs + incl - nq);
            if (dense) {
                const int at = nd + __popc(bd & below);
                st_row[warp][at] = dd[c];
                st_wi[warp][at] = wic[c];
                any |= wic[c];
                top = max(top, wic[c]);
            }
            octs += __shfl_sync(0xffffffffu, incl, 31);
            nd += __popc(bd);
            ns += __popc(bs);
        }
        if (r + 1 < r1) fetch_rows(r + 1);
        any = __reduce_or_sync(0xffffffffu, any);
        top = __reduce_max_sync(0xffffffffu, top);
        const int np = (nd + 1) >> 1;
        int s;
        const bool paired = pairs_fit(any, top, np, s);
        __syncwarp();
        if (paired)
            for (int p = lane; p < np; p += 32) out[1 + ns + p] = pair_entry(st_row[warp], st_wi[warp], p, nd, s);
        if (lane == 0) out[0] = make_int4(paired ? np : -1, ns, octs, s);
        __syncwarp();
    }
}
