// Issue 23 prototype (bench/dense_mma.py): a tile's 8-bit dense rows times the batch's query
// levels on tensor cores, the sums kept in registers (what a fused dense phase would pay).
#include <mma.h>
using namespace nvcuda;
typedef long long i64;
typedef unsigned long long u64;
#ifndef QB
#define QB 8  // blocks of 8 queries a warp carries (QB * 8 queries a CUDA block)
#endif
#define NW 8  // warps a CUDA block
#define SQ (QB * 32 + 32)  // bytes between two rows of the staged query levels
#ifndef KMAX
#define KMAX 8  // the most 16-row steps a tile has (the launcher passes the layout's)
#endif
// One CUDA block per (tile, group of QB * 8 queries). S^T = D^T Q^T in m32n8k16 steps (u8 x u8 -> s32,
// exact): A = 32 documents x 16 rows of the tile's dense rows (column-major: a row's documents are
// contiguous, TILE apart), B = 16 rows x 8 queries of `qa` (row-major, each block of 8 queries at its
// own 32 bytes, as WMMA loads want 256-bit aligned pointers), staged in shared memory; a slab's A
// fragments are all loaded before its products. A warp takes 32 documents at a time and
// all of the group's queries. The sums leave only as a checksum (one 64-bit atomic a warp), and, for
// the first `out_tiles` tiles, stored whole (`out`, [n_tiles, B, TILE] int32) for the exactness check.
extern "C" __global__ void __launch_bounds__(NW * 32) dense_mma(
    const unsigned char* __restrict__ dense,  // [rows + 16, TILE] levels, 16 zero rows after the last
    const i64* __restrict__ row_start,        // [n_tiles + 1] first dense row of each tile
    const unsigned char* __restrict__ qa,     // [n_tiles, RMAX, n_blocks * 32] query levels by tile row
    const int n_blocks, const int RMAX, const int TILE,
    u64* __restrict__ checksum, int* __restrict__ out, const int out_tiles)
{
    const int t = blockIdx.x, g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 r0 = row_start[t];
    const int rk = (int)((row_start[t + 1] - r0 + 15) & ~15ll);  // rows, padded to 16 (zero levels in qa)
    const unsigned char* a_base = dense + r0 * TILE;
    const unsigned char* b_base = qa + (i64)t * RMAX * (n_blocks * 32) + (i64)g * QB * 32;
    const int ldb = n_blocks * 32;
    // The group's query levels for the tile's rows, staged once in shared memory (rk x QB blocks of 32
    // bytes): every warp reads them for each of its slabs.
    // Rows SQ bytes apart, 32 more than a row's QB * 32: a fragment's 16 rows fall in different banks
    // (at QB * 32 = 256 bytes apart they all hit the same ones: Nsight Compute saw the loads 16-way
    // conflicted).
    extern __shared__ __align__(32) unsigned char s_q[];
    for (int i = threadIdx.x * 16; i < rk * QB * 32; i += NW * 32 * 16) {
        const int row = i / (QB * 32), col = i % (QB * 32);
        *reinterpret_cast<uint4*>(s_q + row * SQ + col) = *reinterpret_cast<const uint4*>(b_base + (i64)row * ldb + col);
    }
    __syncthreads();
    u64 sum = 0ull;
    for (int slab = warp; slab < TILE / 32; slab += NW) {
        wmma::fragment<wmma::accumulator, 32, 8, 16, int> acc[QB];
#pragma unroll
        for (int j = 0; j < QB; ++j) wmma::fill_fragment(acc[j], 0);
        // all of the slab's document fragments first (KMAX loads in flight), then the products
        wmma::fragment<wmma::matrix_a, 32, 8, 16, unsigned char, wmma::col_major> a[KMAX];
#pragma unroll
        for (int kk = 0; kk < KMAX; ++kk)
            if (kk * 16 < rk) wmma::load_matrix_sync(a[kk], a_base + (i64)kk * 16 * TILE + slab * 32, TILE);
#pragma unroll
        for (int kk = 0; kk < KMAX; ++kk) {
            if (kk * 16 >= rk) break;
#pragma unroll
            for (int j = 0; j < QB; ++j) {
                wmma::fragment<wmma::matrix_b, 32, 8, 16, unsigned char, wmma::row_major> b;
                wmma::load_matrix_sync(b, s_q + kk * 16 * SQ + j * 32, SQ);
                wmma::mma_sync(acc[j], a[kk], b, acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < QB; ++j) {
            for (int i = 0; i < acc[j].num_elements; ++i) sum += (unsigned int)acc[j].x[i];
            if (out != nullptr && t < out_tiles) {
                int* o = out + ((i64)t * (n_blocks * 8) + (i64)(g * QB + j) * 8) * TILE + slab * 32;
                wmma::store_matrix_sync(o, acc[j], TILE, wmma::mem_col_major);
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if (lane == 0) atomicAdd(checksum, sum);
}
