// Issue 23 prototype (bench/dense_frag.py): a tile's 8-bit dense rows times a group of queries' levels on
// tensor cores, both operands stored in the order of the MMA's register fragments, the sums kept in
// registers. sm_80+: mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 (u8 x u8 -> s32, exact).
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k32", .u8; gid = lane >> 2, tig = lane & 3; four
// 8-bit elements a register, element i in byte i):
//   A 16 x 32 (documents x rows): a0 (doc gid,   row 4 tig + i)   a1 (doc gid + 8, row 4 tig + i)
//                                 a2 (doc gid,   row 16 + 4 tig + i)  a3 (doc gid + 8, row 16 + 4 tig + i)
//   B 32 x 8 (rows x queries):    b0 (row 4 tig + i, query gid)   b1 (row 16 + 4 tig + i, query gid)
//   C 16 x 8 s32:                 c0, c1 (doc gid, query 2 tig + 0/1)  c2, c3 (doc gid + 8, query 2 tig + 0/1)
// A block of A is 512 bytes, lane l's a0..a3 at 16 l (one uint4 load); a block of B is 256 bytes, lane l's
// b0, b1 at 8 l (one uint2 load). The blocks of A are stored tile by tile, in a tile 16-document group by
// group, in a group k-step by k-step: a warp walks one contiguous run of steps x 512 bytes.
typedef long long i64;
typedef unsigned long long u64;
#ifndef QG
#define QG 64  // queries a CUDA block (a multiple of 8)
#endif
#define NB (QG / 8)  // blocks of 8 queries: the MMAs per A fragment
#define NW 8  // warps a CUDA block
#ifndef MINB
#define MINB 1  // __launch_bounds__ min blocks an SM (register cap 65536 / (256 MINB))
#endif
#ifndef PF
#define PF 2  // positions of a warp's A stream in flight ahead of its MMAs
#endif
#ifndef GM
#define GM 1  // 16-document groups a warp multiplies at once: each B fragment loaded once for GM MMAs
#endif

__device__ __forceinline__ void mma_u8(int (&c)[4], const uint4& a, const uint2& b) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
}

// A document group's sums: added to the warp's checksum, stored whole for the first `out_tiles` tiles (C
// layout: c0, c1 doc d, queries q, q + 1; c2, c3 doc d + 8, same queries), then zeroed for the next group.
__device__ __forceinline__ void finish_group(int (&acc)[NB][4], u64& sum, int* __restrict__ out, const int t,
                                             const int out_tiles, const int n_blocks, const int TILE, const int group,
                                             const int g, const int lane) {
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        sum += (u64)(unsigned int)acc[j][0] + (unsigned int)acc[j][1] + (unsigned int)acc[j][2] +
               (unsigned int)acc[j][3];
        if (out != nullptr && t < out_tiles) {
            const int q = (group * NB + j) * 8 + tig * 2, d = g * 16 + gid;
            int* o = out + ((i64)t * (n_blocks * 8) + q) * TILE + d;
            o[0] = acc[j][0];         // doc d,     query q
            o[TILE] = acc[j][1];      // doc d,     query q + 1
            o[8] = acc[j][2];         // doc d + 8, query q
            o[TILE + 8] = acc[j][3];  // doc d + 8, query q + 1
        }
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
    }
}

// One CUDA block per (tile, group of QG queries); the blocks of one tile are adjacent in the grid
// (blockIdx.x = tile * n_qgroups + group), so the groups of a tile run together and read its rows from L2.
// Each of the 8 warps takes the tile's 16-document groups in turn, GM at once: per group, NB accumulators of
// 4 s32 registers; per k-step one uint4 load of A a group (issued PF steps ahead), then NB x GM MMAs, each B
// fragment from shared memory (staged once a CUDA block) used for GM of them. The sums leave as a checksum (one
// 64-bit atomic a warp, of the sum of its sums mod 2**64) and, for the first `out_tiles` tiles, whole in
// `out` ([out_tiles, n_queries, TILE] int32, n_queries = n_blocks * 8).
extern "C" __global__ void __launch_bounds__(NW * 32, MINB) dense_frag(
    const uint4* __restrict__ a_frag,      // [blocks, 32] the dense rows in A-fragment order
    const i64* __restrict__ step_start,    // [n_tiles + 1] first k-step of each tile (32 padded rows a step)
    const uint2* __restrict__ b_frag,      // [steps, n_blocks, 32] the query levels in B-fragment order
    const int n_blocks, const int TILE,
    u64* __restrict__ checksum, int* __restrict__ out, const int out_tiles)
{
    const int n_qgroups = n_blocks / NB;
    const int t = blockIdx.x / n_qgroups, qg = blockIdx.x % n_qgroups;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 s0 = step_start[t];
    const int steps = (int)(step_start[t + 1] - s0);
    const int doc_groups = TILE / 16;
    const uint4* a_tile = a_frag + s0 * doc_groups * 32 + lane;  // the tile's first block, this lane's bytes
    // This warp's A loads form one stream: (unit u = warp + NW i, step s) for s < steps, for i, a unit being
    // GM adjacent 16-document groups (GM loads a position; a group's loads are contiguous, steps x 512
    // bytes). PF positions of the stream are in flight ahead of the MMAs, across the boundary between units
    // too (a group has only ~4 steps: a prefetch that stopped at it would wait for L2 once a group).
    const int units = doc_groups / GM;
    const int my_units = (units - warp + NW - 1) / NW;
    const int total = my_units * steps, sd = steps > 0 ? steps : 1;
    uint4 buf[PF][GM];  // issued before the B fragments' staging: both latencies overlap
#pragma unroll
    for (int p = 0; p < PF; ++p)
#pragma unroll
        for (int m = 0; m < GM; ++m) {
            buf[p][m] = uint4{0u, 0u, 0u, 0u};
            if (p < total) buf[p][m] = a_tile[((i64)((warp + (p / sd) * NW) * GM + m) * steps + p % sd) * 32];
        }
    // The group's B fragments for the tile's steps: steps x NB x 256 bytes, read by every warp for each
    // of its units (a warp's uint2 loads of one fragment are 256 contiguous bytes: no conflict).
    extern __shared__ __align__(16) uint2 s_b[];
    for (int i = threadIdx.x; i < steps * NB * 32; i += NW * 32) {
        const int s = i / (NB * 32), rest = i % (NB * 32);
        s_b[i] = b_frag[((s0 + s) * n_blocks + (i64)qg * NB) * 32 + rest];
    }
    __syncthreads();
    u64 sum = 0ull;
    int acc[GM][NB][4];
#pragma unroll
    for (int m = 0; m < GM; ++m)
#pragma unroll
        for (int j = 0; j < NB; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0;
    int u = warp, s = 0;  // the unit and step of stream position `idx`
    int lu = warp + (PF / sd) * NW, ls = PF % sd;  // those of idx + PF
    for (int idx = 0; idx < total; ++idx) {
        uint4 a[GM];
#pragma unroll
        for (int m = 0; m < GM; ++m) a[m] = buf[0][m];
#pragma unroll
        for (int p = 0; p + 1 < PF; ++p)
#pragma unroll
            for (int m = 0; m < GM; ++m) buf[p][m] = buf[p + 1][m];
        if (idx + PF < total)
#pragma unroll
            for (int m = 0; m < GM; ++m) buf[PF - 1][m] = a_tile[((i64)(lu * GM + m) * steps + ls) * 32];
        if (++ls == steps) { ls = 0; lu += NW; }
        const uint2* b = s_b + s * NB * 32 + lane;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            const uint2 bj = b[j * 32];
#pragma unroll
            for (int m = 0; m < GM; ++m) mma_u8(acc[m][j], a[m], bj);
        }
        if (++s == steps) {  // the unit's sums are complete
#pragma unroll
            for (int m = 0; m < GM; ++m)
                finish_group(acc[m], sum, out, t, out_tiles, n_blocks, TILE, qg, u * GM + m, lane);
            s = 0;
            u += NW;
        }
    }
    if (steps == 0)  // a tile without dense rows: its sums are 0 (stored for the check)
        for (; u < units; u += NW)
#pragma unroll
            for (int m = 0; m < GM; ++m)
                finish_group(acc[m], sum, out, t, out_tiles, n_blocks, TILE, qg, u * GM + m, lane);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if (lane == 0) atomicAdd(checksum, sum);
}
