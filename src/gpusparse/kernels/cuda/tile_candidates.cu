// The tiled engine's kernel: on-chip accumulation per (document tile, query), candidates out.
// Launched by gpusparse.kernels.tile_candidates.tiled_candidates, compiled by NVRTC with
// -DTILE_BITS -DTHREADS -DUNROLL -DMIN_BLOCKS -DACC_MODE -DWT -DINT_W -DFIXED_W -DFIXED_STORED
// -DPACKED -DSELECT -DDENSE_LISTS -DOCTS -DMETA (and, for profiling builds only,
// -DPROFILE_SKIP_DENSE / -DPROFILE_SKIP_SPARSE). META builds also hold tile_meta, the kernel
// that writes their blocks' metadata records.
// WT is passed as one token (-DWT=unsigned_char): these name the two-word types.
typedef unsigned char unsigned_char;
typedef unsigned int unsigned_int;
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
// quantized queries), so products are exact 32-bit integer multiplications, no float64. The
// caller checks it on the host, or (a CUDA graph's parameters) flags the rows where it fails.
#ifndef INT_W
#define INT_W 0
#endif
// FIXED_W (mode 1 only): float32 weights multiplied in fixed point: each stored weight is
// read as d = round(w · 2**b) (FIXED_OF: an exact power-of-two scaling, then round half to
// even, as torch.round), each query weight becomes q = round(w_q · mult) and a product is
// (q · d) >> shift[query], integer arithmetic throughout; the rounding errors are in the
// margin (see fixed_point in gpusparse.engines.tiled.fixed_point).
#ifndef FIXED_W
#define FIXED_W 0
#endif
// FIXED_STORED: the layout holds the integers themselves (WT unsigned int).
#ifndef FIXED_STORED
#define FIXED_STORED 0
#endif
#if FIXED_STORED
#define FIXED_OF(x) (x)
#else
#define FIXED_OF(x) __float2uint_rn((x) * w_scale)
#endif
// PACKED: float32 sparse postings in 5 bytes (gpusparse.layout.packing): `offs` holds 32-bit
// words, offset << (32 - TILE_BITS) | the top bits of the weight's (40 - TILE_BITS)-bit field,
// and `wts` the field's low byte; the weight's bits are field + p_bias, p_bias = exp_base << 23
// or, with FIXED_W, (exp_base + b) << 23: then the float is w · 2**b already (exact), rounded
// as FIXED_OF rounds.
#ifndef PACKED
#define PACKED 0
#endif
#if PACKED
typedef unsigned int OT;   // sparse offsets array: the words
typedef unsigned char ST;  // sparse weights array: the low bytes
#define PACK_SHIFT (32 - TILE_BITS)
#define PACK_FIELD ((1u << PACK_SHIFT) - 1u)
#define SPARSE_FIXED(x) __float2uint_rn(x)
#else
typedef unsigned short OT;
typedef WT ST;
#define SPARSE_FIXED(x) FIXED_OF(x)
#endif
#define INT_PRODUCTS (INT_W || FIXED_W)
// SELECT=0 builds the kernel without the blocks' own k-th selection, for the waves that rely on
// theta alone: their code is then that much smaller (the selection's registers and unrolled
// loops cost the whole kernel ~5 % at 8.8M x 256 when compiled in but not run).
#ifndef SELECT
#define SELECT 1
#endif
// DENSE_LISTS (small batches, fixed-point float32 weights): a dense term's postings in the tile
// are read from the index's own list (doc id and float32 weight, contiguous) instead of its
// dense row (TILE slots, most of them 0): at batch 1 the rows are most of a search's bytes.
#ifndef DENSE_LISTS
#define DENSE_LISTS 0
#endif
#if DENSE_LISTS && !(ACC_MODE == 1 && FIXED_W)
#error "DENSE_LISTS needs 32-bit sums of fixed-point products"
#endif
typedef long long i64;
// PAIRS: the dense phase of 8-bit levels (integer products, 32-bit sums) takes two dense rows
// at a time: each thread loads 8 documents' bytes of each row in one vector load, interleaves
// the two rows' bytes (__byte_perm) and multiplies both rows for two documents by one __dp2a
// (16-bit weights x 8-bit levels, 32-bit sums): ~1.5 instructions a slot instead of ~2.6, and 8
// sums in registers instead of 32. The phase waits on its loads, so the instructions alone did
// not make it faster (measured); the registers freed let a sixth block reside (MIN_BLOCKS 6),
// which the loop over 32 sums in registers could not afford (it spilled, 31 % slower).
#define PAIRS (ACC_MODE == 1 && INT_W && !FIXED_W && !DENSE_LISTS && TILE / THREADS >= 8)

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
// Query terms whose metadata sits in shared memory at once: 256, or 128 in a build for six
// resident blocks (their static shared memory then fits beside six tiles of sums; the launcher
// picks that build only for batches of queries of at most 128 terms).
#ifndef MAXT
#define MAXT (MIN_BLOCKS >= 6 ? 128 : 256)
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
// OCTS: the sparse loop takes aligned groups of eight postings of the layout's arrays ("octs")
// instead of single postings: one vector load of eight offsets and one of eight weights, and each
// thread UO octs a step (up to 8 * UO postings in flight instead of UNROLL). An oct may hold
// postings of a neighbouring segment at a segment's ends: a mask keeps only the segment's own.
// A thread looks up an oct's segment once for its eight postings: groups of four (two a thread
// and step) took 4 % more kernel time at 8.8M x 256 with 8-bit levels (measured), their look-ups
// being most of the loop's instructions; two octs a thread and step spilled (+13 %).
// The launcher sets it where both arrays are aligned to eight elements and readable up to the
// end of their last oct.
#ifndef OCTS
#define OCTS 0
#endif
#define OCT 8
#define OCT_LOG 3
#define OCT_MASK 0xffu
#ifndef UO
#define UO 1
#endif
// EMIT_MAX_K: at most this k, the emission (32-bit sums) first tests each warp's largest sum
// (measured at 8.8M x 256: -0.5 to -0.8 % of the kernel at k = 10, +0.4 % at k = 100 and +1.5 %
// at k = 1,000 ungated, where more warps hold a candidate and read their sums twice).
#define EMIT_MAX_K 32
// 8-bit levels multiplied as integers, 16-bit offsets (WT one byte, not PACKED): an oct's eight
// offsets and eight levels are read as words, and its mask applied to the levels' word at once
// (-1.2 % of the kernel at 8.8M x 256 against a select a posting, measured).
#define LEVEL_WORDS (!PACKED && INT_W && !FIXED_W && sizeof(WT) == 1)
// META (PAIRS and OCTS builds without selection, T <= MAXT): each block reads its terms' metadata
// (the compacted sparse segments with their octs' prefix sums, and the pairs' table of its dense
// rows) from a record that tile_meta wrote in the launch before (one warp a query), instead of
// building it itself: one coalesced read and one barrier instead of the term ids' and the
// segments' dependent loads, the ballots' exchange, the one-warp prefix pass and four barriers.
// A record's layout (8-byte entries, uint2; T + 1 of them a block, at ((tile - first) * B + q) * (T + 1)):
//   [0]                      header: x = (np + 1) | ns << 7 | s << 15 | ws << 20, y = octs (the sparse
//                            segments' octs in all); np + 1 == 0: the block builds its metadata itself
//   [1, 1 + ns)              sparse segments: x = start | length << 24 (its low 8 bits), y = length >> 8
//                            (6 bits) | (integer weight >> ws) << 6 (8 bits) | first oct << 14 (18 bits)
//   [1 + ns, 1 + ns + np)    pairs of dense rows: x = row a | row b << 16 (0xffff: none), y = both
//                            weights >> s (16 bits each); read into pair_entry's form
// Half the bytes of 16-byte entries: a big wave's records fit one launch of tile_meta where they took
// two. A record whose fields do not fit (a start past 2**24, a query's weights above 8 bits after
// their common shift ws) is written as "builds itself".
#define REC_START_BITS 24
#define REC_OCT_BITS 18
#if META && (TILE_BITS > 13 || MAXT > 255)
#error "META records hold a segment's length in 14 bits and the segments' count in 8"
#endif
#ifndef META
#define META 0
#endif
#if META && !(PAIRS && OCTS && !SELECT)
#error "META needs a PAIRS and OCTS build without selection"
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
    int* s_start;          // [MAXT] first posting of a sparse segment, among the tile's
    int* s_pref;           // [MAXT + 1] segment lengths, then their exclusive prefix sums
    unsigned int* s_wi;    // [MAXT]
    double* s_w;           // [WMAX]
    int* warp_counts;      // [2 * warps]
    int* d_term;           // [MAXT] (DENSE_LISTS) term of a dense row
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
    const int* terms, const float* qw, int nj, double scale, const short* did_tile, const int* seg_tile, Terms& m)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    __syncthreads();  // the previous chunk's metadata is no longer read
    int nd = 0, ns = 0;
    for (int r0 = 0; r0 < nj; r0 += THREADS) {
        const int j = r0 + tid;
        int did = -1, len = 0, start = 0, term = -1;
        double w = 0.0;
        if (j < nj) {
            const int t = terms[j];
            term = t;
            w = (double)qw[j] * scale;  // exact: scale is a power of two
            if (t >= 0) {
                did = did_tile[t];
                start = seg_tile[t];
                len = seg_tile[t + 1] - start;
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
            if (DENSE_LISTS) m.d_term[od] = term;
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

#if PAIRS
// The dense phase of 8-bit levels, two rows at a time (see PAIRS): writes the tile's sums of
// its dense rows into acc (thread t: documents [8 (g · THREADS + t), + 8) for each g).
// pairs[p] = (row 2p, row 2p + 1 or -1 (an odd last row): offsets in 8-byte words from
// dense_tile; both weights, 16 bits each); sums are shifted left by sh at the end. Four pairs'
// loads are issued before the first of them is used: the phase waits on its loads, and eight
// documents a step keep the registers in flight within the kernel's budget.
#define PAIRS_AHEAD 4
__device__ __forceinline__ void dense_pairs(const WT* __restrict__ dense_tile, int np, const int4* pairs, int sh, unsigned int* acc)
{
    const uint2* rows = reinterpret_cast<const uint2*>(dense_tile);
    const int tid = threadIdx.x;
    if (np == 0) {  // most blocks (the tile has no dense row of the query's terms): the sums start at 0
        uint4* out = reinterpret_cast<uint4*>(acc);
#pragma unroll
        for (int i = 0; i < TILE / THREADS / 4; ++i) out[i * THREADS + tid] = make_uint4(0u, 0u, 0u, 0u);
        return;
    }
#pragma unroll 1
    for (int g = 0; g < TILE / THREADS / 8; ++g) {
        unsigned int sum[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) sum[v] = 0u;
        const int at = g * THREADS + tid;  // in 8-byte words of a row
#pragma unroll 1
        for (int p0 = 0; p0 < np; p0 += PAIRS_AHEAD) {
            uint2 a[PAIRS_AHEAD], b[PAIRS_AHEAD];
            unsigned int w[PAIRS_AHEAD];
#pragma unroll
            for (int u = 0; u < PAIRS_AHEAD; ++u) {
                a[u] = b[u] = make_uint2(0u, 0u);
                w[u] = 0u;
                if (p0 + u < np) {
                    const int4 e = pairs[p0 + u];
                    a[u] = __ldg(rows + (i64)e.x + at);
                    if (e.y >= 0) b[u] = __ldg(rows + (i64)e.y + at);
                    w[u] = (unsigned int)e.z;
                }
            }
#pragma unroll
            for (int u = 0; u < PAIRS_AHEAD; ++u) {
                const unsigned int av[2] = {a[u].x, a[u].y}, bv[2] = {b[u].x, b[u].y};
#pragma unroll
                for (int v = 0; v < 2; ++v) {
                    // bytes (row a, row b) of documents 4v, 4v + 1, then of 4v + 2, 4v + 3
                    const unsigned int p01 = __byte_perm(av[v], bv[v], 0x5140), p23 = __byte_perm(av[v], bv[v], 0x7362);
                    sum[4 * v + 0] = __dp2a_lo(w[u], p01, sum[4 * v + 0]);
                    sum[4 * v + 1] = __dp2a_hi(w[u], p01, sum[4 * v + 1]);
                    sum[4 * v + 2] = __dp2a_lo(w[u], p23, sum[4 * v + 2]);
                    sum[4 * v + 3] = __dp2a_hi(w[u], p23, sum[4 * v + 3]);
                }
            }
        }
        uint4* out = reinterpret_cast<uint4*>(acc) + 2 * at;
#pragma unroll
        for (int v = 0; v < 2; ++v)
            out[v] = make_uint4(sum[4 * v] << sh, sum[4 * v + 1] << sh, sum[4 * v + 2] << sh, sum[4 * v + 3] << sh);
    }
}
#endif

#if PAIRS
// The pairs' table's rule, one for the block's own build and for tile_meta's records: the weights'
// shift s is the fewest trailing zeros among the dense weights (`any`: their OR), and the rows pair
// where the largest (`top`) fits 16 bits after it and the table holds the np pairs.
__device__ __forceinline__ bool pairs_fit(unsigned int any, unsigned int top, int np, int& s)
{
    s = any ? __ffs(any) - 1 : 0;
    return (top >> s) <= 0xffffu && np <= 64;
}
// Pair p's two weights from the dense rows' integer weights [0, nd), 16 bits each after the shift s
// (the second 0 for an odd last row): the pairs' table's and a record's.
__device__ __forceinline__ unsigned int pair_weights(const unsigned int* wi, int p, int nd, int s)
{
    const int d = 2 * p;
    return (wi[d] >> s) | (d + 1 < nd ? (wi[d + 1] >> s) << 16 : 0u);
}
// Entry p of the pairs' table from the dense rows' ids and integer weights [0, nd), as dense_pairs
// reads it.
__device__ __forceinline__ int4 pair_entry(const int* row, const unsigned int* wi, int p, int nd, int s)
{
    const int d = 2 * p, two = d + 1 < nd;
    return make_int4(row[d] * (TILE / 8), two ? row[d + 1] * (TILE / 8) : -1, (int)pair_weights(wi, p, nd, s), 0);
}
#endif
#if OCTS
// The octs of a segment of n >= 1 postings from place a (counted from the tile's aligned first
// oct): from the one holding its first posting to its last's.
__device__ __forceinline__ int oct_count(int a, int n) { return ((a + n - 1) >> OCT_LOG) - (a >> OCT_LOG) + 1; }
#endif

// One addition to a 32-bit sum in shared memory, as a reduction (no value returned) at the 32-bit
// shared-window address `addr`. From a pointer into the dynamic shared array the compiler rebuilt
// the array's base from the block's id before each atomic; the sparse loops compute each address
// from one base instead.
__device__ __forceinline__ void shared_add(unsigned int addr, unsigned int v)
{
    asm volatile("red.shared.add.u32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
// Sparse postings are assigned to segments through a map of at most NCHUNK equal pieces (each
// piece's segment), so a thread's search for its posting's (or oct's) segment starts at it; where
// the block has at most NCHUNK octs (most blocks), a piece is one oct and the map is exact.
#define NCHUNK 512
__device__ __forceinline__ int chunk_shift(int total)
{
    int cs = 0;
    while (total > 0 && ((total - 1) >> cs) >= NCHUNK) ++cs;
    return cs;
}
// The chunk map: s_chunk[c] = the segment holding posting (or oct) c << cs of `total`, from the
// exclusive prefix sums of the ns segments' lengths, s_pref[0, ns] (s_pref[ns] = total; segments
// are non-empty). Each segment writes the pieces that start in it: a thread a segment, a few
// stores each, instead of a binary search a piece. All threads.
__device__ __forceinline__ void chunk_map(int total, int ns, const int* s_pref, unsigned short* s_chunk)
{
    const int cs = chunk_shift(total), up = (1 << cs) - 1;
    for (int j = threadIdx.x; j < ns; j += THREADS) {
        const int c1 = (s_pref[j + 1] + up) >> cs;
        for (int c = (s_pref[j] + up) >> cs; c < c1; ++c) s_chunk[c] = (unsigned short)j;
    }
}
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) tiled_candidates(
    const int* __restrict__ seg,              // [n_tiles * (V + 1)] start of each sparse (tile, term) segment in its tile
    const i64* __restrict__ tile_start,       // [n_tiles + 1] first sparse posting of each tile
    const OT* __restrict__ offs,              // [P] document offset inside the tile (PACKED: the words)
    const ST* __restrict__ wts,               // [P] document weight (PACKED: the low bytes)
    const short* __restrict__ dense_id,       // [n_tiles * V] row of `dense` after the tile's first, else -1
    const int* __restrict__ dense_start,      // [n_tiles + 1] first dense row of each tile
    const WT* __restrict__ dense,             // [n_dense, TILE] weights by offset (0 = absent)
    const int* __restrict__ q_terms,          // [B, T] term ids, -1 padding at the end of a row
    const float* __restrict__ q_weights,      // [B, T]
    const double* __restrict__ q_scale,       // [B] power of two: fixed-point units per score unit
    const i64* __restrict__ q_delta,          // [B] error margin in units
    const int* __restrict__ q_shift,          // [B] FIXED_W: right shift of each product
    const float w_scale,                      // FIXED_W: 2**b, stored weight to fixed point
    const unsigned int p_bias,                // PACKED: added to a posting's weight field (see above)
    const int T, const int V, const int n_docs, const int k, const int tile0, const int select,
    u64* __restrict__ theta,                  // [B] running lower bound of the k-th best score
    int* __restrict__ cand_count,             // [B]
    int* __restrict__ cand_doc,               // [B, cap]
    u64* __restrict__ cand_val,               // [B, cap]
    const int cap,
    // DENSE_LISTS only (else unused): the index's lists and where each tile's share of a list starts
    const int* __restrict__ l_doc,            // [padded postings] document ids, ascending in a list
    const float* __restrict__ l_score,        // [padded postings] weights
    const i64* __restrict__ l_off,            // [V] start of each list
    const int* __restrict__ l_len,            // [V] real postings of each list
    const int* __restrict__ l_pos,            // [n_tiles * V] real postings of the term in earlier tiles
    const int n_tiles,
    // optional [n_docs]: the document at each position (a layout in an order of its own);
    // candidates are written as documents
    const int* __restrict__ doc_of,
    // META: the launch's records (see above)
    const uint2* __restrict__ meta_rec)
{
    extern __shared__ unsigned int smem[];
    unsigned int* lo = smem;
    unsigned int* hi = smem + TILE;  // unused (not allocated) in mode 1
    // The radix histogram of the selection, and before it the sparse phase's chunk map.
    __shared__ __align__(16) unsigned int hist[256];  // 16: PAIRS reads int4 from it
    unsigned short* s_chunk = reinterpret_cast<unsigned short*>(hist);
    // d_row and d_wi side by side: a META block's pairs' table lies there (64 int4 at most)
    __shared__ __align__(16) int d_rw[2 * MAXT];
    int* d_row = d_rw;
    unsigned int* d_wi = reinterpret_cast<unsigned int*>(d_rw + MAXT);
    __shared__ int s_pref[MAXT + 1], warp_counts[2 * NWARPS], d_term[DENSE_LISTS ? MAXT : 1];
    __shared__ unsigned int s_wi[MAXT];
    __shared__ int s_start[MAXT];
    __shared__ int s_len[OCTS ? MAXT : 1];  // OCTS: segment lengths (s_pref then counts octs)
    __shared__ double d_w[WMAX], s_w[WMAX];
    __shared__ u64 s_max, s_val, s_th0;
    __shared__ unsigned int s_above;
    __shared__ int s_bucket;
    Terms meta{0, 0, d_row, d_wi, d_w, s_start, s_pref, s_wi, s_w, warp_counts, d_term};

    const int q = blockIdx.x;
    const int tile = tile0 + blockIdx.y;  // waves of tiles: see gpusparse.engines.tiled.waves
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
    const int* seg_tile = seg + (i64)tile * (V + 1);
    const short* did_tile = dense_id + (i64)tile * V;
    // the tile's own postings and rows: positions inside a tile are 32-bit
    const i64 t_first = tile_start[tile];
    const OT* offs_tile = offs + t_first;
    const ST* wts_tile = wts + t_first;
#if OCTS
    // octs are counted from the aligned oct holding the tile's first posting; `phase` is that
    // posting's place in it
    const int phase = (int)(t_first & (OCT - 1));
    const Pack<OT, OCT>* offs8 = reinterpret_cast<const Pack<OT, OCT>*>(offs + (t_first - phase));
    const Pack<ST, OCT>* wts8 = reinterpret_cast<const Pack<ST, OCT>*>(wts + (t_first - phase));
#endif
    const WT* dense_tile = dense + (i64)dense_start[tile] * TILE;

    // The query's terms are handled in chunks of MAXT: their metadata (weight, dense row,
    // sparse segment) is loaded by all threads at once into shared memory, instead of by
    // every thread one term after the other (a chain of dependent global loads).
    // 1a. Dense segments: each thread owns VEC consecutive documents in each group of
    //     THREADS * VEC and sums them in registers from coalesced vector reads; the sums
    //     initialise the shared accumulators.
    auto dense_registers = [&]() {
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
            for (int d = 0; d < (DENSE_LISTS ? 0 : meta.nd); ++d) {  // DENSE_LISTS: added in 1b
                const Pack<WT, VEC>* col = reinterpret_cast<const Pack<WT, VEC>*>(dense_tile + (i64)d_row[d] * TILE);
                const double w = INT_PRODUCTS ? 0.0 : d_w[d];
                const unsigned int wi = d_wi[d];
#pragma unroll
                for (int g = 0; g < PER / VEC; ++g) {
                    const Pack<WT, VEC> p = col[g * THREADS + tid];
#pragma unroll
                    for (int v = 0; v < VEC; ++v) {
#if ACC_MODE == 1 && FIXED_W
                        reg[g * VEC + v] += (unsigned int)(((u64)wi * (u64)FIXED_OF(p.v[v])) >> sh);
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
    };
    // META: the block's metadata from its record (every thread reads its entry beside the header:
    // one round trip)
    bool from_rec = false;
    int rec_ns = 0;
#if META && !defined(PROFILE_SKIP_DENSE)
    {
        const uint2* rec_b = meta_rec + ((i64)blockIdx.y * gridDim.x + q) * (T + 1);
        const uint2 hdr = rec_b[0];
        const uint2 e = tid < T ? rec_b[1 + tid] : make_uint2(0u, 0u);
        const int np = (int)(hdr.x & 0x7fu) - 1;
        if (np >= 0) {
            from_rec = true;
            rec_ns = (int)((hdr.x >> 7) & 0xffu);
            const int octs = (int)hdr.y;
            // the pairs' table beside the chunk map (which the selection's histogram holds)
            int4* pairs = reinterpret_cast<int4*>(d_rw);
            if (tid < rec_ns) {
                s_start[tid] = (int)(e.x & ((1u << REC_START_BITS) - 1u));
                s_len[tid] = (int)((e.x >> REC_START_BITS) | ((e.y & 0x3fu) << (32 - REC_START_BITS)));
                s_wi[tid] = ((e.y >> 6) & 0xffu) << ((hdr.x >> 20) & 31u);
                s_pref[tid] = (int)(e.y >> 14);
            } else if (tid < rec_ns + np) {
                const int row_a = (int)(e.x & 0xffffu), row_b = (int)(e.x >> 16);
                pairs[tid - rec_ns] = make_int4(row_a * (TILE / 8), row_b == 0xffff ? -1 : row_b * (TILE / 8), (int)e.y, 0);
            }
            if (tid == 0) s_pref[rec_ns] = octs;
            __syncthreads();
            // the sparse phase's chunk map now, so the barrier after the dense phase publishes it
            chunk_map(octs, rec_ns, s_pref, s_chunk);
            dense_pairs(dense_tile, np, pairs, (int)((hdr.x >> 15) & 31u), lo);
        }
    }
#endif
#if PAIRS && !defined(PROFILE_SKIP_DENSE)
    bool paired = from_rec;
    if (!from_rec && T <= MAXT) {
        load_terms(terms, qw, T, scale, did_tile, seg_tile, meta);
        // Every weight of a prepared query is a level times one power of two: with s the fewest
        // trailing zeros among the tile's dense weights, (Σ (wi >> s) · level) << s is
        // Σ wi · level bit for bit (mod 2**32, as the 32-bit sums are). A weight above 16 bits
        // after the shift (a query not prepared), or more pairs of rows than the table below
        // holds, takes the registers' loop instead.
        const int nd = meta.nd, np = (nd + 1) >> 1;
        unsigned int any = 0u, top = 0u;
        for (int d = 0; d < nd; ++d) {
            any |= d_wi[d];
            top = max(top, d_wi[d]);
        }
        int s;
        paired = pairs_fit(any, top, np, s);
        if (paired) {
            // the pairs' table lies in the selection's histogram (free until the sparse phase)
            int4* pairs = reinterpret_cast<int4*>(hist);
            for (int p = tid; p < np; p += THREADS) pairs[p] = pair_entry(d_row, d_wi, p, nd, s);
            __syncthreads();
            dense_pairs(dense_tile, np, pairs, s, lo);
        }
    }
    if (!paired) dense_registers();
#else
    if (!from_rec) dense_registers();
#endif

    // One sparse posting (document offset o in the tile, stored weight wd) times the query
    // term's weight (wq: float64, wqi: integer) into the document's shared sum.
    const unsigned int lo_s = (unsigned int)__cvta_generic_to_shared(lo);
    auto add_posting = [&](unsigned int o, WT wd, double wq, unsigned int wqi) {
        // float32 x float32 is exact in float64 (wq holds w_q * scale, a power of two);
        // one rounding to the integer unit.
#if FIXED_W
        const u64 v = ((u64)wqi * (u64)SPARSE_FIXED(wd)) >> sh;
#elif INT_W
        const u64 v = (u64)(wqi * (unsigned int)wd);
#else
        const u64 v = (u64)__double2ll_rn(wq * (double)wd);
#endif
#if ACC_MODE == 0
        const unsigned int add_lo = (unsigned int)v;
        const unsigned int old = atomicAdd(&lo[o], add_lo);
        const unsigned int add_hi = (unsigned int)(v >> 32) + (old + add_lo < old ? 1u : 0u);  // carry
        if (add_hi) atomicAdd(&hi[o], add_hi);
#else
        shared_add(lo_s + (o << 2), (unsigned int)v);
#endif
    };

    // 1b. Sparse segments: one flat loop over all their postings, so that every thread has
    //     independent loads in flight whatever the segments' lengths.
    for (int j0 = 0; j0 < T; j0 += MAXT) {
        // one chunk (the usual case): its metadata is still there from the dense phase
        if (T > MAXT) load_terms(terms + j0, qw + j0, min(MAXT, T - j0), scale, did_tile, seg_tile, meta);
        const int ns = from_rec ? rec_ns : meta.ns;
        // Exclusive prefix sums of the segment lengths, in place, by the first warp (META: read).
        if (tid < WL && !from_rec) {
            int carry = 0;
            for (int c = 0; c < ns; c += WL) {
#if OCTS
                int len = 0;  // the segment's octs
                if (c + tid < ns) {
                    const int n = s_pref[c + tid], a = phase + s_start[c + tid];
                    s_len[c + tid] = n;
                    len = oct_count(a, n);
                }
#else
                const int len = c + tid < ns ? s_pref[c + tid] : 0;
#endif
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
        const int cs = chunk_shift(total);
        if (!from_rec) {  // META: built before the dense phase
            chunk_map(total, ns, s_pref, s_chunk);
            __syncthreads();
        }
        // UNROLL postings per thread and step: all their loads are issued before the first
        // atomic, so several global loads are in flight per thread. A warp takes UNROLL * WL
        // consecutive postings a step, lane l those at l, l + WL, ... (each load coalesced
        // across the warp); a thread keeps its current segment and its bounds in registers,
        // so that a posting in the same segment as the thread's previous one costs a compare,
        // and only a posting past it looks its segment up (the chunk map, then a short walk).
        const int lane_id = tid & 31, warp_id = tid >> 5;
#if OCTS
        // UO octs per thread and step, lane l of a warp those at l, l + WL, ... of the warp's
        // UO * WL consecutive ones (each vector load coalesced across the warp); the segment is
        // found as for single postings below, and an oct's mask keeps the postings in
        // [a_lo, a_hi), the segment's own (counted from the tile's aligned first oct).
        int j = 0, next = 0, q_off = 0, a_lo = 0, a_hi = 0;  // oct = q_off + f
        double wj = 0.0;
        unsigned int wij = 0u;
        for (int f0 = warp_id * (UO * WL) + lane_id; f0 < total; f0 += UO * THREADS) {
            int qd[UO];
            unsigned int mk[UO], wqi[UO];
            double wq[UO];
#pragma unroll
            for (int u = 0; u < UO; ++u) {
                const int f = f0 + u * WL;
                mk[u] = 0u;
                qd[u] = 0;
                wq[u] = 0.0;
                wqi[u] = 0u;
                if (f < total) {
                    if (f >= next) {
                        j = max(j, (int)s_chunk[f >> cs]);
                        while (s_pref[j + 1] <= f) ++j;
                        next = s_pref[j + 1];
                        a_lo = phase + s_start[j];
                        a_hi = a_lo + s_len[j];
                        q_off = (a_lo >> OCT_LOG) - s_pref[j];
                        if (!INT_PRODUCTS) wj = s_w[j];
                        wij = s_wi[j];
                    }
                    const int g = q_off + f, p = g << OCT_LOG;
                    unsigned int m = OCT_MASK;
                    if (p < a_lo) m &= OCT_MASK << (a_lo - p);
                    if (p + OCT > a_hi) m &= OCT_MASK >> (p + OCT - a_hi);
                    mk[u] = m & OCT_MASK;
                    qd[u] = g;
                    wq[u] = wj;
                    wqi[u] = wij;
                }
            }
            if constexpr (LEVEL_WORDS) {
                // the mask's bit i spread to all bits of byte i (no carries: the four copies of a
                // nibble, 7 bits apart, do not overlap), then applied to the levels' words
                uint4 ov[UO];
                uint2 wv[UO];
#pragma unroll
                for (int u = 0; u < UO; ++u) {
                    if (mk[u]) {
                        ov[u] = reinterpret_cast<const uint4*>(offs8)[qd[u]];
                        wv[u] = reinterpret_cast<const uint2*>(wts8)[qd[u]];
                    }
                }
#pragma unroll
                for (int u = 0; u < UO; ++u) {
                    if (!mk[u]) continue;
                    const unsigned int m_lo = (((mk[u] & 0xfu) * 0x00204081u) & 0x01010101u) * 0xffu;
                    const unsigned int m_hi = (((mk[u] >> 4) * 0x00204081u) & 0x01010101u) * 0xffu;
                    const unsigned int wb[2] = {wv[u].x & m_lo, wv[u].y & m_hi};
                    const unsigned int ow[4] = {ov[u].x, ov[u].y, ov[u].z, ov[u].w};
#pragma unroll
                    for (int v = 0; v < OCT; ++v) {
                        const unsigned int o = (ow[v >> 1] >> (16 * (v & 1))) & 0xffffu;
                        add_posting(o & (TILE - 1), (WT)__byte_perm(wb[v >> 2], 0u, 0x4440u | (v & 3)), wq[u], wqi[u]);  // byte v & 3
                    }
                }
            } else {
                Pack<OT, OCT> ol[UO];
                Pack<ST, OCT> wl[UO];
#pragma unroll
                for (int u = 0; u < UO; ++u) {
                    if (mk[u]) {
                        ol[u] = offs8[qd[u]];
                        wl[u] = wts8[qd[u]];
                    }
                }
#pragma unroll
                for (int u = 0; u < UO; ++u) {
                    if (!mk[u]) continue;
#pragma unroll
                    for (int v = 0; v < OCT; ++v) {
#if PACKED
                        const unsigned int o = ol[u].v[v] >> PACK_SHIFT;
                        const WT wd = __uint_as_float((((ol[u].v[v] & PACK_FIELD) << 8) | (unsigned int)wl[u].v[v]) + p_bias);
#else
                        const unsigned int o = ol[u].v[v];
                        const WT wd = wl[u].v[v];
#endif
                        // A posting outside the segment (the mask's 0 bits: a neighbouring segment's, or
                        // an array's padding) adds 0 to a document of the tile (its offset cut to the
                        // tile, a no-op for the segment's own): no branch a posting.
                        add_posting(o & (TILE - 1), (mk[u] >> v) & 1u ? wd : (WT)0, wq[u], wqi[u]);
                    }
                }
            }
        }
#else
        int j = 0, next = 0, first_j = 0;  // segment j holds postings [.., next); idx = first_j + f
        double wj = 0.0;
        unsigned int wij = 0u;
        for (int f0 = warp_id * (UNROLL * WL) + lane_id; f0 < total; f0 += UNROLL * THREADS) {
            int idx[UNROLL];
            double wq[UNROLL];
            unsigned int wqi[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int f = f0 + u * WL;
                idx[u] = -1;
                if (f < total) {
                    if (f >= next) {  // postings only grow: j is a lower bound, as is the map's
                        j = max(j, (int)s_chunk[f >> cs]);
                        while (s_pref[j + 1] <= f) ++j;  // a piece is at most a few segments
                        next = s_pref[j + 1];
                        first_j = s_start[j] - s_pref[j];
                        if (!INT_PRODUCTS) wj = s_w[j];
                        wij = s_wi[j];
                    }
                    idx[u] = first_j + f;
                    wq[u] = wj;
                    wqi[u] = wij;
                }
            }
            ST wl[UNROLL];
            OT ol[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (idx[u] >= 0) {
                    wl[u] = wts_tile[idx[u]];
                    ol[u] = offs_tile[idx[u]];
                }
            }
            WT wd[UNROLL];
            unsigned int o[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
#if PACKED
                o[u] = ol[u] >> PACK_SHIFT;
                wd[u] = __uint_as_float((((ol[u] & PACK_FIELD) << 8) | (unsigned int)wl[u]) + p_bias);
#else
                o[u] = ol[u];
                wd[u] = wl[u];
#endif
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (idx[u] >= 0) add_posting(o[u], wd[u], wq[u], wqi[u]);
        }
#endif
#if DENSE_LISTS
        // The dense terms' postings in this tile, from their lists: the products the dense
        // phase would have added (the stored fixed point is round(w * 2**b), this conversion).
        for (int d = 0; d < meta.nd; ++d) {
            const int t = meta.d_term[d];
            const unsigned int wi = meta.d_wi[d];
            const i64 at = l_off[t];
            const int p0 = l_pos[(i64)tile * V + t];
            const int p1 = tile + 1 < n_tiles ? l_pos[(i64)(tile + 1) * V + t] : l_len[t];
            for (int p = p0 + tid; p < p1; p += THREADS) {
                const u64 v = ((u64)wi * (u64)__float2uint_rn(l_score[at + p] * w_scale)) >> sh;
                atomicAdd(&lo[l_doc[at + p] - base], (unsigned int)v);
            }
        }
#endif
    }
    __syncthreads();

    const int lane = tid & 31;
#if ACC_MODE == 1 && VEC == 4
    const uint4* lo4 = reinterpret_cast<const uint4*>(lo);
#endif
#if SELECT
    // 2. The tile's largest score.
#if ACC_MODE == 1 && VEC == 4
    // 32-bit sums: each thread reads back the groups of four it wrote, one vector load each
    // (past `width` the sums are 0: no posting or dense weight lies there).
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
    for (int pass = 0; pass < (SELECT && select ? 2 : 0); ++pass) {
        const int shift = pass == 0 ? s0 : (s0 >= 8 ? s0 - 8 : 0);
        const int bits = pass == 0 ? 8 : s0 - shift;
        if (pass == 1 && bits == 0) break;
        const u64 prefix = tau >> s0;  // pass 1: the bucket chosen in pass 0
        for (int i = tid; i < 256; i += nt) hist[i] = 0u;
        __syncthreads();
#if ACC_MODE == 1 && VEC == 4
        // 32-bit sums (vmax < 2**32, so s0 <= 24): the groups of four each thread owns, one
        // vector load each, as in the max pass (past `width` the sums are 0 and skipped)
        const unsigned int pre32 = (unsigned int)prefix, field = (1u << bits) - 1u;
#pragma unroll
        for (int g = 0; g < PER / 4; ++g) {
            const uint4 x = lo4[g * THREADS + tid];
            const unsigned int xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int v = 0; v < 4; ++v)
                if (xv[v] != 0u && (pass == 0 || (xv[v] >> s0) == pre32)) atomicAdd(&hist[(xv[v] >> shift) & field], 1u);
        }
#else
        for (int i = tid; i < width; i += nt) {
            const u64 v = ACC(i);
            if (v != 0ull && (pass == 0 || (v >> s0) == prefix))
                atomicAdd(&hist[(v >> shift) & ((1u << bits) - 1u)], 1u);
        }
#endif
        __syncthreads();
        if (tid < WL) {
            // The highest bucket b whose count from the top reaches `need` (-1: none), and the
            // count above it, by the first warp: lane l sums `per` buckets from place l * per
            // (places counted from the top), a prefix sum over the lanes finds the one holding b,
            // which walks its own (one thread walking all 256 buckets kept the others waiting).
            const int nb = 1 << bits, per = (nb + WL - 1) / WL;
            const unsigned int want = (unsigned int)need;
            unsigned int own = 0u;
            for (int j = 0; j < per; ++j) {
                const int place = per * tid + j;
                if (place < nb) own += hist[nb - 1 - place];
            }
            unsigned int incl = own;
            for (int o = 1; o < WL; o <<= 1) {
                const unsigned int up = __shfl_up_sync(WMASK, incl, o);
                if (tid >= o) incl += up;
            }
            const unsigned int hit = __ballot_sync(WMASK, incl >= want);
            if (hit == 0u) {  // fewer than `need` counted (s_above is then not read)
                if (tid == 0) s_bucket = -1;
            } else if (tid == __ffs(hit) - 1) {
                unsigned int cum = incl - own;
                int b = nb - 1 - per * tid;
                for (int j = 0; j < per; ++j, --b) {
                    if (cum + hist[b] >= want) break;
                    cum += hist[b];
                }
                s_bucket = b;
                s_above = cum;
            }
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
#else
    // A wave without the blocks' own selection (SELECT=0): no block of the launch raises theta
    // (the compaction between waves does), so the value read at the block's start is the
    // bound, and the emission pass below tests every sum against it: no pass for the tile's
    // largest sum, and no second read of theta, each with a barrier.
    const u64 th = s_th0;
#endif
    const u64 d = (u64)q_delta[q] + (th >> 22);  // + one float32 ulp: ties after rounding
    const u64 thr = th > d ? max(th - d, 1ull) : 1ull;
#if ACC_MODE == 1 && VEC == 4
    // Few documents pass: a warp tests 128 of them per step (one vector load a thread), a thread's
    // flags for up to 8 such steps kept in one word; only a warp holding some takes slots, by a
    // prefix sum of its lanes' counts and one global atomic for those 8 steps. (One atomic per
    // step holding a candidate made each such step a round trip to global memory in the
    // block's path: at top-1000 the big wave was ~7 % slower than at top-10.)
    if (thr > 0xffffffffull) return;  // above every 32-bit sum
    const unsigned int t32 = (unsigned int)thr;
    if (k <= EMIT_MAX_K) {
        // Small k: a warp's sums rarely reach the threshold. The thread's largest sum first (two
        // three-way maxima a group of four), and a warp none of whose sums passes is done.
        unsigned int m = 0u;
#pragma unroll
        for (int g = 0; g < PER / 4; ++g) {
            const uint4 x = lo4[g * THREADS + tid];
            m = __vimax3_u32(__vimax3_u32(m, x.x, x.y), x.z, x.w);
        }
        if (__ballot_sync(WMASK, m >= t32) == 0u) return;
    }
#pragma unroll 1
    for (int g0 = 0; g0 < PER / 4; g0 += 8) {
        unsigned int fl = 0u;  // bit 4 u + v: document v of the thread's group g0 + u passes
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            if (g0 + u < PER / 4) {
                const uint4 x = lo4[(g0 + u) * THREADS + tid];
                fl |= ((unsigned int)(x.x >= t32) | ((unsigned int)(x.y >= t32) << 1) |
                       ((unsigned int)(x.z >= t32) << 2) | ((unsigned int)(x.w >= t32) << 3)) << (4 * u);
            }
        }
        if (__ballot_sync(WMASK, fl != 0u) == 0u) continue;
        const int cnt = __popc(fl);
        int incl = cnt;
        for (int o = 1; o < WL; o <<= 1) {
            const int up = __shfl_up_sync(WMASK, incl, o);
            if (lane >= o) incl += up;
        }
        int first = 0;
        if (lane == WL - 1) first = atomicAdd(&cand_count[q], incl);
        first = __shfl_sync(WMASK, first, WL - 1);
        int slot = first + incl - cnt;
        while (fl != 0u) {
            const int b = __ffs(fl) - 1;
            fl &= fl - 1u;
            const int i = ((g0 + (b >> 2)) * THREADS + tid) * 4 + (b & 3);
            if (slot < cap) {
                cand_doc[(i64)q * cap + slot] = doc_of != nullptr ? doc_of[base + i] : base + i;
                cand_val[(i64)q * cap + slot] = lo[i];
            }
            ++slot;
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
                cand_doc[(i64)q * cap + slot] = doc_of != nullptr ? doc_of[base + i] : base + i;
                cand_val[(i64)q * cap + slot] = v;
            }
        }
    }
#endif
}

#if META
// The records META blocks read (see META above). One warp a query and `per` consecutive tiles
// (four queries a CUDA block): the query's term ids and weights are loaded once, each tile's
// segments before the previous tile's record is written and its dense rows' ids while it is (two
// round trips a tile, overlapped). The same metadata as load_terms and the prefix pass build
// (term order, the same integer weights, the same octs), and the pairs' table as the PAIRS phase
// builds it, in the 8-byte entries described at META; a header of 0 ("builds itself") where that
// phase would not be paired (a weight above 16 bits after the shift, or more pairs than the table
// holds) or where a field does not fit its entry.
extern "C" __global__ void __launch_bounds__(128) tile_meta(
    const int* __restrict__ seg, const i64* __restrict__ tile_start, const short* __restrict__ dense_id,
    const int* __restrict__ q_terms, const float* __restrict__ q_weights, const double* __restrict__ q_scale,
    const int T, const int V, const int B, const int tile0, const int n_tiles, const int per, uint2* __restrict__ rec)
{
    __shared__ int st_row[4][MAXT];
    __shared__ unsigned int st_wi[4][MAXT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q = blockIdx.x * 4 + warp;
    if (q >= B) return;  // the warp's own work only: no barrier below
    const int r0 = blockIdx.y * per, r1 = min(n_tiles, r0 + per);  // tiles after tile0
    const unsigned int below = (1u << lane) - 1u;
    constexpr int NC = MAXT / 32;
    int tc[NC];
    unsigned int wic[NC];
    unsigned int w_any = 0u, w_top = 0u;  // the query's weights: their OR, their largest
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
                wic[c] = (unsigned int)((double)qw[j] * scale);  // as load_terms: exact (INT_W, checked by the caller)
                if (tc[c] >= 0) {
                    w_any |= wic[c];
                    w_top = max(w_top, wic[c]);
                }
            }
        }
    }
    // A sparse entry holds its weight as 8 bits after the query's common shift ws (a prepared query's
    // weights are levels times one power of two); a query whose weights do not fit writes every record
    // as "builds itself".
    w_any = __reduce_or_sync(0xffffffffu, w_any);
    w_top = __reduce_max_sync(0xffffffffu, w_top);
    const unsigned int ws = w_any ? __ffs(w_any) - 1 : 0u;
    const bool w_fit = (w_top >> ws) <= 0xffu;
    int did[NC], start[NC], end[NC], phase = 0;
    auto fetch = [&](int r) {
        const int tile = tile0 + r;
        const int* seg_tile = seg + (i64)tile * (V + 1);
        phase = (int)(tile_start[tile] & (OCT - 1));
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            did[c] = -1;
            start[c] = end[c] = 0;
            if (tc[c] >= 0) {
                start[c] = seg_tile[tc[c]];
                end[c] = seg_tile[tc[c] + 1];
            }
        }
    };
    // A dense row's sparse segment is empty, so only terms with an empty segment (dense, or not
    // in the tile) load their row id, once the segments' bounds are in: the loads were three
    // quarters of this kernel's time, the row ids' alone ~30 % (measured), and most of a query's
    // terms have a segment.
    auto fetch_rows = [&](int r) {
        const short* did_tile = dense_id + (i64)(tile0 + r) * V;
#pragma unroll
        for (int c = 0; c < NC; ++c)
            if (tc[c] >= 0 && end[c] == start[c]) did[c] = did_tile[tc[c]];
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
        if (r + 1 < r1) fetch(r + 1);  // the next tile's loads in flight while this one's record is written
        uint2* out = rec + ((i64)r * B + q) * (T + 1);
        int nd = 0, ns = 0, octs = 0;
        unsigned int any = 0u, top = 0u;
        bool fit = w_fit;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const bool dense = dd[c] >= 0, sparse = !dense && n[c] > 0;
            const unsigned int bd = __ballot_sync(0xffffffffu, dense), bs = __ballot_sync(0xffffffffu, sparse);
            if ((bd | bs) == 0u) continue;
            const int nq = sparse ? oct_count(ph + st[c], n[c]) : 0;  // as the prefix pass counts them
            int incl = nq;
            for (int o = 1; o < 32; o <<= 1) {
                const int up = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += up;
            }
            if (sparse) {
                const unsigned int first = (unsigned int)(octs + incl - nq), len = (unsigned int)n[c];
                fit = fit && (unsigned int)st[c] < (1u << REC_START_BITS);  // (a length is at most TILE: 14 bits)
                out[1 + ns + __popc(bs & below)] = make_uint2((unsigned int)st[c] | len << REC_START_BITS,
                                                              (len >> (32 - REC_START_BITS)) | (wic[c] >> ws) << 6 | first << 14);
            }
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
        if (r + 1 < r1) fetch_rows(r + 1);  // the next tile's segments arrived while this one's were compacted
        any = __reduce_or_sync(0xffffffffu, any);
        top = __reduce_max_sync(0xffffffffu, top);
        const int np = (nd + 1) >> 1;
        int s;
        const bool paired = pairs_fit(any, top, np, s) && __all_sync(0xffffffffu, fit) && octs < (1 << REC_OCT_BITS);
        __syncwarp();
        if (paired) {
            for (int p = lane; p < np; p += 32) {
                const int d = 2 * p, two = d + 1 < nd;
                out[1 + ns + p] = make_uint2((unsigned int)st_row[warp][d] | (two ? (unsigned int)st_row[warp][d + 1] : 0xffffu) << 16,
                                             pair_weights(st_wi[warp], p, nd, s));
            }
        }
        if (lane == 0) out[0] = make_uint2(paired ? (unsigned int)(np + 1) | ns << 7 | s << 15 | ws << 20 : 0u, (unsigned int)octs);
        __syncwarp();  // the staged rows are read before the next tile rewrites them
    }
}
#endif
