// bench/shared_batch.cu's kernels run on the CPU, for tests without a GPU: each block's threads are
// std::threads, __syncthreads a std::barrier of the block, __shfl_up_sync an exchange through a
// warp's slots between two barriers of the warp, shared atomics std::atomic_ref. Blocks run one after
// another (the kernels do not communicate between blocks but through atomics on global memory).
//
// Build: g++ -std=c++20 -O1 -pthread -DTHREADS=.. -DITEMS=.. -DCHUNK=.. -DNQ=.. -DSTRIDE=..
//        -DKERNEL_SOURCE='"path/to/shared_batch.cu"' tests/shared_batch_host.cpp
// Run:   a.out DIR variant n_chunks n_docs n_pairs emit cap grid
//        reads DIR/{post,chunk_start,tinfo,qlist,theta}.bin, writes DIR/{qmax,count,cand_doc,cand_val}.bin

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
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
thread_local Dim threadIdx, blockIdx;
Dim gridDim;

alignas(16) unsigned char smem_raw[256 * 1024];

static std::barrier<>* block_barrier = nullptr;
static std::vector<std::barrier<>*> warp_barriers;
static std::vector<unsigned long long> warp_slots;  // [warp][32]

inline void __syncthreads() { block_barrier->arrive_and_wait(); }

template <class T>
T __shfl_up_sync(unsigned, T x, int d) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_slots[warp * 32 + lane] = (unsigned long long)x;
    warp_barriers[warp]->arrive_and_wait();
    const T y = lane >= d ? (T)warp_slots[warp * 32 + lane - d] : x;
    warp_barriers[warp]->arrive_and_wait();
    return y;
}

template <class T>
T atomicAdd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}

inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

template <class T>
T __ldg(const T* p) {
    return *p;
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
    std::vector<int> qmax(NQ, 0), count(NQ, 0), cand_doc((size_t)NQ * cap, -7), cand_val((size_t)NQ * cap, -7);
    std::barrier<> bar(THREADS);
    block_barrier = &bar;
    for (int w = 0; w < THREADS / 32; ++w) warp_barriers.push_back(new std::barrier<>(32));
    warp_slots.assign((THREADS / 32) * 32, 0);
    gridDim.x = grid;
    for (int b = 0; b < grid; ++b) {
        std::memset(smem_raw, 0xA5, sizeof(smem_raw));  // poison: the kernels must initialise what they read
        std::vector<std::thread> threads;
        for (int t = 0; t < THREADS; ++t) {
            threads.emplace_back([&, t, b] {
                threadIdx.x = t;
                blockIdx.x = b;
                if (variant == "flat")
                    chunk_batch_flat(post.data(), chunk_start.data(), n_chunks, n_docs, tinfo.data(), qlist.data(),
                                     n_pairs, theta.data(), emit, qmax.data(), count.data(), cand_doc.data(),
                                     cand_val.data(), cap);
                else
                    chunk_batch_warp(post.data(), chunk_start.data(), n_chunks, n_docs, tinfo.data(), qlist.data(),
                                     n_pairs, theta.data(), emit, qmax.data(), count.data(), cand_doc.data(),
                                     cand_val.data(), cap);
            });
        }
        for (auto& th : threads) th.join();
    }
    write_file(dir + "/qmax.bin", qmax, NQ);
    write_file(dir + "/count.bin", count, NQ);
    write_file(dir + "/cand_doc.bin", cand_doc, (size_t)NQ * cap);
    write_file(dir + "/cand_val.bin", cand_val, (size_t)NQ * cap);
    return 0;
}
