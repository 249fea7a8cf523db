// Canonical rescoring, one warp per (query, document) pair: gpusparse.kernels.rescore
// (exact_scores_cuda, candidate_keys_cuda).
typedef long long i64;
// The canonical score of document d for query row r, by the calling warp: lane j looks the
// document up in query term j's list (32 terms at a time), so the ~22 dependent loads of a
// binary search overlap across the query's terms instead of running one term after the
// other; then the products are added in term order. `list_pos` (optional, n_tiles > 0)
// narrows each search to the document's tile: list_pos[tile * V + t] real postings of term
// t lie in earlier tiles of 2**tile_bits documents (see gpusparse.layout.tiled).
__device__ __forceinline__ float canonical(
    const int* __restrict__ doc_ids, const float* __restrict__ scores,
    const i64* __restrict__ offsets, const int* __restrict__ lengths,
    const i64* __restrict__ terms, const float* __restrict__ weights, const int T, const int d,
    const int* __restrict__ list_pos, const int tile_bits, const int V, const int n_tiles)
{
    const int lane = threadIdx.x & 31;
    const int tile = n_tiles > 0 ? d >> tile_bits : 0;
    double acc = 0.0;
    for (int j0 = 0; j0 < T; j0 += 32) {
        const int j = j0 + lane;
        const i64 t = j < T ? terms[j] : -1;
        double prod = 0.0;
        bool hit = false;
        if (t >= 0) {
            const i64 start = offsets[t], end = start + lengths[t];
            i64 lo = start, hi = end;
            if (n_tiles > 0) {
                lo = start + list_pos[(i64)tile * V + t];
                if (tile + 1 < n_tiles) hi = start + list_pos[(i64)(tile + 1) * V + t];
            }
            while (lo < hi) {
                const i64 mid = (lo + hi) >> 1;
                if (doc_ids[mid] < d) lo = mid + 1; else hi = mid;
            }
            hit = lo < end && doc_ids[lo] == d;
            if (hit) prod = (double)scores[lo] * (double)weights[j];
        }
        const unsigned int hits = __ballot_sync(0xffffffffu, hit);
        const bool more = __any_sync(0xffffffffu, t >= 0) && j0 + 32 < T;
        for (int v = 0; v < 32; ++v) {  // in term order, as the PyTorch path adds them
            const double x = __shfl_sync(0xffffffffu, prod, v);
            if ((hits >> v) & 1u) acc += x;
        }
        if (!more) break;  // padding reached: the terms are at the front
    }
    return (float)acc;
}

// One warp per pair (rows[p], docs[p]).
extern "C" __global__ void exact_scores_kernel(
    const int* __restrict__ doc_ids, const float* __restrict__ scores,
    const i64* __restrict__ offsets, const int* __restrict__ lengths,
    const i64* __restrict__ q_terms,  // [B, T], ascending, -1 padding at the end
    const float* __restrict__ q_weights,    // [B, T]
    const int T,
    const i64* __restrict__ rows, const i64* __restrict__ docs, const i64 m,
    float* __restrict__ out)
{
    const i64 p = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (p >= m) return;  // the whole warp: p is the same for its lanes
    const i64 r = rows[p];
    const int d = (int)docs[p];
    const float s = d < 0 ? 0.0f  // a slot the caller does not need
        : canonical(doc_ids, scores, offsets, lengths, q_terms + r * T, q_weights + r * T, T, d, nullptr, 0, 0, 0);
    if ((threadIdx.x & 31) == 0) out[p] = s;
}

// canonical() from the document's side, with the forward index (document-major CSR: its
// terms ascending, their weights): lane i takes the document's terms i, i + 32, ... (up to
// 4 at once, their loads in flight together) and finds each among the query's terms: in
// `table` (shared memory, 1 + the term's column in the query, 0 if absent) where given,
// else by binary search over the query's row; the products of the terms found are added in
// term order, as canonical() adds them (both lists are ascending), so the bits are the same.
// A document's ~120 postings are ~1 KB read in order, where the binary searches in the
// inverted lists touch ~10 scattered sectors per query term.
#define FWD_UNROLL 4
__device__ __forceinline__ float canonical_fwd(
    const i64* __restrict__ fwd_off, const int* __restrict__ fwd_terms, const float* __restrict__ fwd_w,
    const i64* __restrict__ terms, const float* __restrict__ weights, const int T, const int d,
    const unsigned char* table)
{
    const int lane = threadIdx.x & 31;
    const i64 start = fwd_off[d], end = fwd_off[d + 1];
    double acc = 0.0;
    for (i64 i0 = start; i0 < end; i0 += 32 * FWD_UNROLL) {
        int t[FWD_UNROLL];
        float w[FWD_UNROLL];
#pragma unroll
        for (int u = 0; u < FWD_UNROLL; ++u) {
            const i64 i = i0 + u * 32 + lane;
            t[u] = i < end ? fwd_terms[i] : -1;
            w[u] = i < end ? fwd_w[i] : 0.0f;
        }
        double prod[FWD_UNROLL];
        bool hit[FWD_UNROLL];
#pragma unroll
        for (int u = 0; u < FWD_UNROLL; ++u) {
            int col = -1;  // the term's column in the query row
            if (t[u] >= 0 && table != nullptr) {
                col = (int)table[t[u]] - 1;
            } else if (t[u] >= 0) {
                int lo = 0, hi = T;  // first query term >= t[u] (padding, -1, sorts last)
                while (lo < hi) {
                    const int mid = (lo + hi) >> 1;
                    const i64 q = terms[mid];
                    if (q >= 0 && q < t[u]) lo = mid + 1; else hi = mid;
                }
                col = lo < T && terms[lo] == t[u] ? lo : -1;
            }
            hit[u] = col >= 0;
            prod[u] = hit[u] ? (double)w[u] * (double)weights[col] : 0.0;
        }
#pragma unroll
        for (int u = 0; u < FWD_UNROLL; ++u) {
            unsigned int hits = __ballot_sync(0xffffffffu, hit[u]);
            while (hits) {  // in term order
                const int v = __ffs(hits) - 1;
                acc += __shfl_sync(0xffffffffu, prod[u], v);
                hits &= hits - 1;
            }
        }
    }
    return (float)acc;
}

// canonical() from the tiled layout (gpusparse.layout.tiled), for an index whose lists are
// not on the device: document d lies in tile d >> tile_bits at offset o; lane j finds query
// term j's weight in d in the (tile, term) segment's dense row when it has one (0: absent),
// else by binary search for o among the segment's ascending 16-bit offsets (a segment holds
// one tile's share of the list: a few steps). Segments start at t_tile_start[tile] +
// t_seg[tile * (V + 1) + term], dense rows at t_dense_start[tile] + t_dense_id[tile * V + term].
// Weights are float32 (t_wf, t_df) or 8-bit levels times `step` (t_wq, t_dq; exact: step is
// a power of two), or packed (t_low non-null, gpusparse.layout.packing): t_offs then holds
// 32-bit words, offset << (32 - tile_bits) | the top of the weight's field, searched as they
// are (word < o << (32 - tile_bits): offset below o), and the weight's bits are field + t_bias.
// The products are added
// in term order as canonical() adds them, so the bits are the same
// (gpusparse.engines.tiled.ranking.tiled_exact_scores is the PyTorch reference).
__device__ __forceinline__ float canonical_tiled(
    const int* __restrict__ t_seg, const i64* __restrict__ t_tile_start, const void* __restrict__ t_offs,
    const short* __restrict__ t_dense_id, const int* __restrict__ t_dense_start,
    const float* __restrict__ t_wf, const float* __restrict__ t_df,
    const unsigned char* __restrict__ t_wq, const unsigned char* __restrict__ t_dq, const float step,
    const unsigned char* __restrict__ t_low, const unsigned int t_bias,
    const int tile_bits, const int V,
    const i64* __restrict__ terms, const float* __restrict__ weights, const int T, const int d)
{
    const int lane = threadIdx.x & 31;
    const i64 tile = d >> tile_bits;
    const int o = d & ((1 << tile_bits) - 1);
    const bool levels = t_wq != nullptr;
    double acc = 0.0;
    for (int j0 = 0; j0 < T; j0 += 32) {
        const int j = j0 + lane;
        const i64 t = j < T ? terms[j] : -1;
        float w = 0.0f;
        if (t >= 0) {
            const int row = t_dense_id[tile * V + t];
            if (row >= 0) {
                const i64 at = ((i64)(t_dense_start[tile] + row) << tile_bits) + o;
                w = levels ? (float)t_dq[at] * step : t_df[at];
            } else {
                const int* seg = t_seg + tile * (V + 1) + t;
                const i64 base = t_tile_start[tile];
                int lo = seg[0], hi = seg[1];  // inside the tile's postings
                const int end = hi;
                if (t_low != nullptr) {
                    const unsigned int* words = reinterpret_cast<const unsigned int*>(t_offs) + base;
                    const int shift = 32 - tile_bits;
                    const unsigned int key = (unsigned int)o << shift;
                    while (lo < hi) {
                        const int mid = (lo + hi) >> 1;
                        if (words[mid] < key) lo = mid + 1; else hi = mid;
                    }
                    if (lo < end && (words[lo] >> shift) == (unsigned int)o) {
                        const unsigned int field = ((words[lo] & ((1u << shift) - 1u)) << 8) | (unsigned int)t_low[base + lo];
                        w = __uint_as_float(field + t_bias);
                    }
                } else {
                    const short* offs = reinterpret_cast<const short*>(t_offs) + base;
                    while (lo < hi) {
                        const int mid = (lo + hi) >> 1;
                        if ((int)(unsigned short)offs[mid] < o) lo = mid + 1; else hi = mid;
                    }
                    if (lo < end && (int)(unsigned short)offs[lo] == o)
                        w = levels ? (float)t_wq[base + lo] * step : t_wf[base + lo];
                }
            }
        }
        const bool hit = w != 0.0f;  // stored weights are positive: 0 is an absent posting
        const double prod = hit ? (double)w * (double)weights[j] : 0.0;
        const unsigned int hits = __ballot_sync(0xffffffffu, hit);
        const bool more = __any_sync(0xffffffffu, t >= 0) && j0 + 32 < T;
        for (int v = 0; v < 32; ++v) {  // in term order, as the PyTorch path adds them
            const double x = __shfl_sync(0xffffffffu, prod, v);
            if ((hits >> v) & 1u) acc += x;
        }
        if (!more) break;  // padding reached: the terms are at the front
    }
    return (float)acc;
}

// A candidate's ranking key (gpusparse.topk.encode_keys): its float32 score's bits, then the
// document id reversed, so that keys sort as score descending, id ascending.
__device__ __forceinline__ i64 rank_key(const float s, const i64 d)
{
    return ((i64)__float_as_int(s) << 31) | (((i64)1 << 31) - 1 - d);
}

// The float32 scores a candidate's fixed-point sum v may stand for: (low, high), the sum less and
// plus its margin (q_delta + v * 2**-50) over the scale, each rounded to float32; the same float64
// operations as gpusparse.engines.tiled.ranking.rank_candidates's PyTorch path, each rounded on its
// own (no contraction), so both give the same bits.
__device__ __forceinline__ float2 score_range(const i64 val, const i64 delta, const double scale)
{
    const double v = (double)val;
    const double margin = __dadd_rn((double)delta, __dmul_rn(v, 0x1p-50));
    const double inv = 1.0 / scale;
    // A power of two (the fixed-point scales are) whose reciprocal is one too:
    // x * inv is then the same real number as x / scale, rounded the same way.
    const long long bits = __double_as_longlong(scale), ex = (bits >> 52) & 0x7FF;
    const bool pow2 = (bits & 0xFFFFFFFFFFFFFLL) == 0 && ex != 0 && ex != 0x7FF && inv != 0.0 && !isinf(inv);
    const double lo_v = fmax(__dsub_rn(v, margin), 0.0), hi_v = __dadd_rn(v, margin);
    return make_float2(__double2float_rn(pow2 ? __dmul_rn(lo_v, inv) : __ddiv_rn(lo_v, scale)),
                       __double2float_rn(pow2 ? __dmul_rn(hi_v, inv) : __ddiv_rn(hi_v, scale)));
}

// The tiled engine's candidates (the first W of each row of ld slots) to ranking keys (gpusparse.topk.encode_keys): a
// candidate's float32 score is read off its fixed-point sum where the margin leaves one
// float32 value possible, and computed canonically otherwise; absent slots (doc -1) get key
// 0. The same float64 operations as gpusparse.engines.tiled.ranking.rank_candidates's PyTorch path, each
// rounded on its own (no contraction), so both give the same bits.
// With `floor` (a bound the row's k-th float32 score reaches, gpusparse.engines.tiled.waves.candidate_lows),
// a candidate whose float32 score is at most `high` < floor cannot be in the top-k: key 0.
// Rescoring reads the forward index where given (fwd_off non-null), else the tiled layout
// where given (t_seg non-null: canonical_tiled), else binary-searches the inverted lists; with `use_table` (dynamic shared memory of V bytes, T < 256) each block
// first writes its row's term-to-column table. Blocks (x, row): the warps of a row's
// gridDim.x blocks take its occupied slots (the first count[r]) in turn, a warp per slot, or
// with `lanes` 32 slots a warp, a lane each (rows whose margin is 0: few slots are rescored);
// the rest of the row's W slots are zeroed by all threads, so a row costs its candidates,
// not W warps.
// Blocks of 256 threads resident per SM that the registers must allow: 5 leaves the 48
// registers it needs; 6 and 7 (more warps in flight for its chains of dependent loads) spill
// and measured slower (0.196 and 0.227 against 0.188 ms, bench/results/2026-11-26-H200-anatomy-v17.log),
// and so did a warp rescoring two slots at a time (0.225 ms at best, ...-anatomy-v18.log).
#ifndef KEYS_MIN_BLOCKS
#define KEYS_MIN_BLOCKS 5
#endif
extern "C" __global__ void __launch_bounds__(256, KEYS_MIN_BLOCKS) candidate_keys(
    const int* __restrict__ doc_ids, const float* __restrict__ scores,
    const i64* __restrict__ offsets, const int* __restrict__ lengths,
    const i64* __restrict__ q_terms, const float* __restrict__ q_weights, const int T,
    const int* __restrict__ list_pos, const int tile_bits, const int V, const int n_tiles,
    const int* __restrict__ cand_doc, const i64* __restrict__ cand_val, const i64 ld,
    const int* __restrict__ count, const i64 W,
    const i64* __restrict__ q_delta, const double* __restrict__ q_scale, const i64 B,
    const float* __restrict__ floor,  // optional [B]: candidates whose score must stay below it get key 0
    const i64* __restrict__ fwd_off, const int* __restrict__ fwd_terms, const float* __restrict__ fwd_w,
    const int use_table, const int lanes,
    const int* __restrict__ t_seg, const i64* __restrict__ t_tile_start, const void* __restrict__ t_offs,
    const short* __restrict__ t_dense_id, const int* __restrict__ t_dense_start,
    const float* __restrict__ t_wf, const float* __restrict__ t_df,
    const unsigned char* __restrict__ t_wq, const unsigned char* __restrict__ t_dq, const float t_step,
    const unsigned char* __restrict__ t_low, const unsigned int t_bias,
    const int* __restrict__ t_pos_of,  // optional [n_docs]: a layout in an order of its own, each document's position
    i64* __restrict__ keys)
{
    extern __shared__ int4 table4[];
    const unsigned char* table = use_table ? reinterpret_cast<const unsigned char*>(table4) : nullptr;
    const int warps = blockDim.x >> 5;
    const i64 stride = (i64)gridDim.x * warps;
    for (i64 r = blockIdx.y; r < B; r += gridDim.y) {  // block-uniform
        if (use_table) {
            __syncthreads();  // the previous row's lookups are done
            for (int i = threadIdx.x; i < (V + 15) / 16; i += blockDim.x) table4[i] = make_int4(0, 0, 0, 0);
            __syncthreads();
            for (int j = threadIdx.x; j < T; j += blockDim.x) {
                const i64 q = q_terms[r * T + j];
                if (q >= 0) reinterpret_cast<unsigned char*>(table4)[q] = (unsigned char)(j + 1);
            }
            __syncthreads();
        }
        const i64 n = count != nullptr ? min((i64)max(count[r], 0), W) : W;  // slots that may hold candidates
        for (i64 j = n + (i64)blockIdx.x * blockDim.x + threadIdx.x; j < W; j += (i64)gridDim.x * blockDim.x)
            keys[r * W + j] = 0;
        // The canonical score of document dd, by the whole warp (dd warp-uniform).
        auto rescored = [&](int dd) -> float {
            return fwd_off != nullptr
                ? canonical_fwd(fwd_off, fwd_terms, fwd_w, q_terms + r * T, q_weights + r * T, T, dd, table)
                : t_seg != nullptr
                ? canonical_tiled(t_seg, t_tile_start, t_offs, t_dense_id, t_dense_start, t_wf, t_df, t_wq, t_dq,
                                  t_step, t_low, t_bias, tile_bits, V, q_terms + r * T, q_weights + r * T, T,
                                  t_pos_of != nullptr ? t_pos_of[dd] : dd)
                : canonical(doc_ids, scores, offsets, lengths, q_terms + r * T, q_weights + r * T, T, dd, list_pos,
                            tile_bits, V, n_tiles);
        };
        if (lanes) {
            // A lane a slot, 32 slots a warp at a time: for rows whose margin is 0 (exact integer
            // products) the key is read off the sum and nearly no slot is rescored; those that are
            // (the sum within 2**-50 of a float32 rounding boundary) are rescored by the warp together.
            const int lane = threadIdx.x & 31;
            for (i64 j0 = ((i64)blockIdx.x * warps + (threadIdx.x >> 5)) * 32; j0 < n; j0 += stride * 32) {
                const i64 j = j0 + lane;
                const i64 d = j < n ? (i64)cand_doc[r * ld + j] : -1;
                i64 key = 0;
                bool again = false;
                if (d >= 0) {
                    const float2 lh = score_range(cand_val[r * ld + j], q_delta[r], q_scale[r]);
                    if (floor == nullptr || lh.y >= floor[r]) {  // else it cannot reach the top-k: key 0
                        again = lh.x != lh.y;
                        key = rank_key(lh.x, d);
                    }
                }
                for (unsigned int todo = __ballot_sync(0xffffffffu, again); todo != 0u; todo &= todo - 1u) {
                    const int src = __ffs(todo) - 1;
                    const float sc = rescored(__shfl_sync(0xffffffffu, (int)d, src));
                    if (lane == src) key = rank_key(sc, d);
                }
                if (j < n) keys[r * W + j] = key;
            }
            continue;
        }
        for (i64 j = (i64)blockIdx.x * warps + (threadIdx.x >> 5); j < n; j += stride) {  // warp-uniform
            const i64 d = cand_doc[r * ld + j];
            i64 key = 0;
            if (d >= 0) {
                const float2 lh = score_range(cand_val[r * ld + j], q_delta[r], q_scale[r]);
                if (floor == nullptr || lh.y >= floor[r]) {  // else it cannot reach the top-k: not rescored
                    const float sc = lh.x != lh.y ? rescored((int)d) : lh.x;
                    key = rank_key(sc, d);
                }
            }
            if ((threadIdx.x & 31) == 0) keys[r * W + j] = key;
        }
    }
}
