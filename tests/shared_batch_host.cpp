// bench/shared_batch.cu's kernels run on the CPU, for tests without a GPU: each block's threads are
// fibers (ucontext) of one OS thread, run in turn until each reaches a barrier: __syncthreads
// releases them when every unfinished thread of the block waits there, and __shfl_up_sync exchanges
// through a warp's slots between two barriers of its warp. Blocks run one after another (the kernels
// communicate between blocks only through atomics on global memory). A barrier no thread can pass
// aborts (exit code 6).
//
// Build: g++ -std=c++20 -O1 -DTHREADS=.. -DITEMS=.. -DCHUNK=.. -DNQ=.. -DSTRIDE=..
//        -DKERNEL_SOURCE='"path/to/shared_batch.cu"' tests/shared_batch_host.cpp
// Run:   a.out DIR variant n_chunks n_docs n_pairs emit cap grid
//        reads DIR/{post,chunk_start,tinfo,qlist,theta}.bin, writes DIR/{qmax,count,cand_doc,cand_val}.bin

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(a, b)
#define __shared__
#define __align__(n)

struct Dim {
    unsigned x = 0, y = 0, z = 0;
};
Dim threadIdx, blockIdx, gridDim;

alignas(16) unsigned char smem_raw[256 * 1024];

enum State { RUNNABLE, BLOCK_WAIT, WARP_WAIT, DONE };
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    State state = RUNNABLE;
};
static std::vector<Fiber> fibers;
static ucontext_t scheduler;
static int current = 0;
static std::function<void()> body;  // the kernel call of the block, for every thread
static std::vector<unsigned long long> warp_slots;  // [warp][32]

static void wait_as(State s) {
    fibers[current].state = s;
    swapcontext(&fibers[current].ctx, &scheduler);
}

inline void __syncthreads() { wait_as(BLOCK_WAIT); }

template <class T>
T __shfl_up_sync(unsigned, T x, int d) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_slots[warp * 32 + lane] = (unsigned long long)x;
    wait_as(WARP_WAIT);
    const T y = lane >= d ? (T)warp_slots[warp * 32 + lane - d] : x;
    wait_as(WARP_WAIT);
    return y;
}

template <class T>
T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}

inline int atomicMax(int* p, int v) {
    const int old = *p;
    if (v > old) *p = v;
    return old;
}

template <class T>
T __ldg(const T* p) {
    return *p;
}

static void fiber_main() {
    body();
    fibers[current].state = DONE;
}  // returns to the scheduler (uc_link)

// Runs THREADS fibers of ``body`` for block b to completion.
static void run_block(int b) {
    blockIdx.x = b;
    fibers.assign(THREADS, Fiber());
    for (int t = 0; t < THREADS; ++t) {
        Fiber& f = fibers[t];
        f.stack.resize(1 << 16);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &scheduler;
        makecontext(&f.ctx, fiber_main, 0);
    }
    for (;;) {
        bool ran = false;
        for (int t = 0; t < THREADS; ++t) {
            if (fibers[t].state != RUNNABLE) continue;
            current = t;
            threadIdx.x = t;
            swapcontext(&scheduler, &fibers[t].ctx);
            ran = true;
        }
        bool released = false;
        for (int w = 0; w < THREADS / 32; ++w) {
            bool all = true;
            for (int l = 0; l < 32; ++l) all &= fibers[w * 32 + l].state == WARP_WAIT;
            if (all) {
                for (int l = 0; l < 32; ++l) fibers[w * 32 + l].state = RUNNABLE;
                released = true;
            }
        }
        bool all_block = true, all_done = true;
        for (auto& f : fibers) {
            all_block &= f.state == BLOCK_WAIT || f.state == DONE;
            all_done &= f.state == DONE;
        }
        if (all_done) return;
        if (all_block) {
            for (auto& f : fibers)
                if (f.state == BLOCK_WAIT) f.state = RUNNABLE;
            released = true;
        }
        if (!ran && !released) {
            std::fprintf(stderr, "block %d: threads wait at barriers that cannot be passed\n", b);
            std::exit(6);
        }
    }
}

#include KERNEL_SOURCE

template <class T>
static std::vector<T> read_file(const std::string& path) {
    std::vector<T> out;
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) {
        std::perror(path.c_str());
        std::exit(2);
    }
    std::fseek(f, 0, SEEK_END);
    const long bytes = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    out.resize(bytes / sizeof(T) + 1);  // + 1: a valid pointer for empty arrays
    if (bytes && std::fread(out.data(), 1, bytes, f) != (size_t)bytes) std::exit(3);
    std::fclose(f);
    return out;
}

template <class T>
static void write_file(const std::string& path, const std::vector<T>& v, size_t n) {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), n, f) != n) std::exit(4);
    std::fclose(f);
}

int main(int argc, char** argv) {
    if (argc != 9) {
        std::fprintf(stderr, "usage: %s DIR variant n_chunks n_docs n_pairs emit cap grid\n", argv[0]);
        return 1;
    }
    const std::string dir = argv[1], variant = argv[2];
    const int n_chunks = std::atoi(argv[3]), n_docs = std::atoi(argv[4]), n_pairs = std::atoi(argv[5]);
    const int emit = std::atoi(argv[6]), cap = std::atoi(argv[7]), grid = std::atoi(argv[8]);
    auto post = read_file<unsigned>(dir + "/post.bin");
    auto chunk_start = read_file<long long>(dir + "/chunk_start.bin");
    auto tinfo = read_file<int>(dir + "/tinfo.bin");
    auto qlist = read_file<unsigned short>(dir + "/qlist.bin");
    auto theta = read_file<int>(dir + "/theta.bin");
    const size_t words = (size_t)CHUNK * STRIDE + 3 * (size_t)W + 1 + NQ;
    if (((4 * words + 7) & ~(size_t)7) + 8 * (THREADS / 32) + 2 * (size_t)n_pairs > sizeof(smem_raw)) {
        std::fprintf(stderr, "the block's shared memory exceeds the shim's %zu bytes\n", sizeof(smem_raw));
        return 5;
    }
    std::vector<int> qmax(NQ, 0), count(NQ, 0), cand_doc((size_t)NQ * cap, -7), cand_val((size_t)NQ * cap, -7);
    warp_slots.assign((THREADS / 32) * 32, 0);
    gridDim.x = grid;
    body = [&] {
        if (variant == "flat")
            chunk_batch_flat(post.data(), chunk_start.data(), n_chunks, n_docs, tinfo.data(), qlist.data(), n_pairs,
                             theta.data(), emit, qmax.data(), count.data(), cand_doc.data(), cand_val.data(), cap);
        else
            chunk_batch_warp(post.data(), chunk_start.data(), n_chunks, n_docs, tinfo.data(), qlist.data(), n_pairs,
                             theta.data(), emit, qmax.data(), count.data(), cand_doc.data(), cand_val.data(), cap);
    };
    for (int b = 0; b < grid; ++b) {
        std::memset(smem_raw, 0xA5, sizeof(smem_raw));  // poison: the kernels must initialise what they read
        run_block(b);
    }
    write_file(dir + "/qmax.bin", qmax, NQ);
    write_file(dir + "/count.bin", count, NQ);
    write_file(dir + "/cand_doc.bin", cand_doc, (size_t)NQ * cap);
    write_file(dir + "/cand_val.bin", cand_val, (size_t)NQ * cap);
    return 0;
}
