// A host-compiler stand-in for the CUDA features the csrc kernels use, so that a kernel's own source
// (csrc/group_segment_kernel.h, csrc/whiten_kernels.h, csrc/gae_kernel.h, csrc/logits_policy_kernel.h) can be run and
// checked on a CPU: every thread of a block runs as a host thread, all of the block's at once; a shuffle is an
// exchange through the warp's slots between two barriers of its 32 lanes (all 32 reach every shuffle, as the
// full-mask shuffles require on a GPU); __syncthreads is a barrier of the block's threads; __shared__ variables are
// function-local statics (shared by the block's threads; blocks run one after another). A cooperative launch
// (launch_cooperative) gives every thread of the grid a host thread and runs one block at a time between grid_sync()
// barriers, so that a block's registers (locals) live across them and its __shared__ statics are its own while it
// runs. A cluster launch (launch_cluster) runs the clusters one after another, each like a cooperative grid of its
// blocks between cluster_sync() barriers, every block with dynamic shared memory of its own that the others reach
// through cluster_remote(); a block's shared memory is overwritten with 0xff bytes (NaN) when it returns, so that a
// read of it after its owner finished shows. The blocks of a cluster take their turns in rank order, those of every
// second cluster in reverse order, so that such a read shows whichever rank it reaches. Memory is plain host memory
// (a block's dynamic shared memory too, allocated at exactly its size), so AddressSanitizer (-fsanitize=address) sees
// any read or write out of bounds.
#pragma once
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

struct EmulatedIndex {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmulatedIndex threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
using std::fmax;
using std::isfinite;
inline float log1pf(float x) { return std::log1p(x); }
inline float expm1f(float x) { return std::expm1(x); }
using std::sqrt;
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float approx_rcp(float x) { return 1.f / x; }  // the device's (advantages_cuda.cu) is rcp.approx: ~1 ulp
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline int __popc(unsigned x) { return std::popcount(x); }

// The two 16-bit float types as their bits, with the device's exact widening to float (advantages_cuda.cu's
// to_float: __half2float, __bfloat162float).
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};
inline float to_float(__nv_bfloat16 h) { return __uint_as_float(static_cast<unsigned>(h.bits) << 16); }
inline float to_float(__half h) {
  const unsigned sign = (h.bits >> 15) & 1u, exponent = (h.bits >> 10) & 0x1fu, mantissa = h.bits & 0x3ffu;
  float magnitude;
  if (exponent == 0x1fu)
    magnitude = mantissa != 0 ? std::nanf("") : INFINITY;
  else if (exponent == 0)
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal (or zero)
  else
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  return sign ? -magnitude : magnitude;
}

// float to the 16-bit types, rounded to nearest even as the device's __float2bfloat16_rn / __float2half_rn
inline void from_float(float g, float* p) { *p = g; }
inline void from_float(float g, __nv_bfloat16* p) {
  unsigned x;
  std::memcpy(&x, &g, sizeof x);
  p->bits = g != g ? static_cast<uint16_t>(0x7fc0u | ((x >> 16) & 0x8000u))
                   : static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline void from_float(float g, __half* p) {
  unsigned x;
  std::memcpy(&x, &g, sizeof x);
  const unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  unsigned h;
  if (ax > 0x7f800000u)
    h = 0x7e00u;  // NaN
  else if (ax >= 0x477ff000u)
    h = 0x7c00u;  // >= 65520: rounds to inf
  else if (ax >= 0x38800000u)  // a normal half (>= 2^-14): re-bias the exponent, round at bit 13
    h = (ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13;
  else  // a subnormal half (or 0): units of 2^-24, the product exact, ties to even
    h = static_cast<unsigned>(std::nearbyint(std::fabs(g) * 16777216.0f));
  p->bits = static_cast<uint16_t>(sign | h);
}

namespace emulated {
struct Warp {
  std::barrier<> sync{32};
  uint64_t slot[32] = {};
};
inline thread_local Warp* warp = nullptr;
inline thread_local int lane = 0;
inline thread_local std::barrier<>* block = nullptr;

template <typename T>
T exchange(T value, int source) {  // every lane offers `value` and takes lane `source`'s
  static_assert(sizeof(T) <= sizeof(uint64_t));
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  warp->slot[lane] = bits;
  warp->sync.arrive_and_wait();
  const uint64_t got = warp->slot[source];
  warp->sync.arrive_and_wait();  // no lane overwrites a slot before every lane has read
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

struct Block {  // one block's barriers, fresh for each block (a finished thread drops out of them)
  explicit Block(unsigned threads) : sync(threads), warps(threads / 32) {}
  std::barrier<> sync;
  std::vector<Warp> warps;
};

// A cooperative grid's turns: block b's j-th turn (j = the grid barriers it has passed) comes when `turn` reaches
// j * blocks + b; a block hands the turn on at each grid_sync() and when its last thread returns. On a GPU a grid
// barrier that some block never reaches hangs (or that a block reaches more often than the others): here a grid
// barrier reached after a block returned aborts at once, and launch_cooperative aborts when the blocks passed
// different numbers of barriers, each with a message on stderr.
struct Grid {
  std::mutex m;
  std::condition_variable cv;
  unsigned long long turn = 0;
  unsigned blocks = 0, returned = 0;
  std::vector<unsigned> barriers;  // grid barriers each block has passed
  void wait_for(unsigned long long t) {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return turn == t; });
  }
  void pass() {
    {
      std::lock_guard<std::mutex> lock(m);
      ++turn;
    }
    cv.notify_all();
  }
  void arrive(unsigned b) {  // block b's first thread at a grid barrier
    std::lock_guard<std::mutex> lock(m);
    if (returned > 0) {
      std::fprintf(stderr, "grid_sync: block %u reached a grid barrier after %u block(s) returned without it\n", b,
                   returned);
      std::abort();
    }
    ++barriers[b];
  }
};
inline thread_local Grid* grid = nullptr;
inline thread_local unsigned long long turns = 0;  // grid barriers this thread has passed

// The host thread that runs thread t of block b: its indices, warp, lane and barriers
inline void enter(Block& here, unsigned b, unsigned t, unsigned blocks, unsigned threads) {
  blockIdx.x = b;
  threadIdx.x = t;
  blockDim.x = threads;
  gridDim.x = blocks;
  warp = &here.warps[t / 32];
  lane = static_cast<int>(t % 32);
  block = &here.sync;
}

// Its kernel returned: a finished thread no longer holds back the block's barriers (as on a GPU)
inline void leave(Block& here, unsigned t) {
  here.sync.arrive_and_drop();
  here.warps[t / 32].sync.arrive_and_drop();
}

// kernel<<<blocks, threads>>>(args...): threads a multiple of 32. One host thread per thread of a block, kept for
// every block; a block starts when every thread has finished the one before (its __shared__ statics are reused).
template <typename Kernel, typename... Args>
void launch(unsigned blocks, unsigned threads, Kernel kernel, Args... args) {
  std::vector<std::unique_ptr<Block>> state;
  for (unsigned b = 0; b < blocks; ++b) state.push_back(std::make_unique<Block>(threads));
  std::barrier<> between(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (unsigned b = 0; b < blocks; ++b) {
        Block& here = *state[b];
        enter(here, b, t, blocks, threads);
        kernel(args...);
        leave(here, t);
        between.arrive_and_wait();
      }
    });
  }
  for (auto& t : pool) t.join();
}

// A cooperative launch of kernel over blocks x threads (threads a multiple of 32): a host thread for every thread of
// the grid, one block running at a time (see Grid), grid_sync() a barrier of all of them. Returns true (launched).
template <typename Kernel, typename... Args>
bool launch_cooperative(unsigned blocks, unsigned threads, Kernel kernel, Args... args) {
  std::vector<std::unique_ptr<Block>> state;
  for (unsigned b = 0; b < blocks; ++b) state.push_back(std::make_unique<Block>(threads));
  std::vector<std::atomic<unsigned>> finished(blocks);
  Grid shared_grid;
  shared_grid.blocks = blocks;
  shared_grid.barriers.assign(blocks, 0);
  std::vector<std::thread> pool;
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, b, t] {
        Block& here = *state[b];
        enter(here, b, t, blocks, threads);
        grid = &shared_grid;
        turns = 0;
        shared_grid.wait_for(b);
        kernel(args...);
        leave(here, t);
        if (finished[b].fetch_add(1) + 1 == threads) {  // the block's last thread: the next turn
          {
            std::lock_guard<std::mutex> lock(shared_grid.m);
            ++shared_grid.returned;
          }
          shared_grid.pass();
        }
      });
    }
  }
  for (auto& t : pool) t.join();
  for (unsigned b = 1; b < blocks; ++b) {
    if (shared_grid.barriers[b] != shared_grid.barriers[0]) {
      std::fprintf(stderr, "grid_sync: block %u passed %u grid barriers, block 0 %u\n", b, shared_grid.barriers[b],
                   shared_grid.barriers[0]);
      std::abort();
    }
  }
  return true;
}

// A cluster's state: the turns of its blocks (a Grid of `ranks` blocks) and each block's dynamic shared memory
struct Cluster {
  Grid turns;
  std::vector<std::unique_ptr<unsigned char[]>> shared;  // [ranks], each `shared_bytes` (new[]: 16-byte aligned)
  size_t shared_bytes = 0;
};
inline thread_local Cluster* cluster = nullptr;
inline thread_local unsigned cluster_block = 0;  // this block's rank in its cluster
inline thread_local unsigned cluster_turn = 0;  // its place in the cluster's turns (its rank, or reversed)

// kernel over `blocks` blocks of `threads` in clusters of `ranks` consecutive blocks (blocks a multiple of ranks),
// each block with `shared_bytes` of dynamic shared memory (dynamic_shared()); the clusters run one after another,
// the blocks of cluster k in rank order for even k and in reverse rank order for odd k (a GPU runs them in any
// order: a block that reads another's shared memory after that one may have returned reads the poison in one of
// the two orders). Each block's memory is exactly `shared_bytes` long (a byte past it is AddressSanitizer's).
template <typename Kernel, typename... Args>
void launch_cluster(unsigned blocks, unsigned ranks, unsigned threads, size_t shared_bytes, Kernel kernel,
                    Args... args) {
  if (ranks == 0 || blocks % ranks != 0) {
    std::fprintf(stderr, "launch_cluster: %u blocks do not divide into clusters of %u\n", blocks, ranks);
    std::abort();
  }
  for (unsigned first = 0; first < blocks; first += ranks) {
    Cluster here_cluster;
    here_cluster.turns.blocks = ranks;
    here_cluster.turns.barriers.assign(ranks, 0);
    here_cluster.shared_bytes = shared_bytes;
    for (unsigned r = 0; r < ranks; ++r) {
      here_cluster.shared.emplace_back(new unsigned char[shared_bytes > 0 ? shared_bytes : 1]);
      if (reinterpret_cast<uintptr_t>(here_cluster.shared.back().get()) % 16 != 0) {
        std::fprintf(stderr, "launch_cluster: dynamic shared memory not 16-byte aligned\n");
        std::abort();
      }
      std::memset(here_cluster.shared.back().get(), 0xff, shared_bytes);  // uninitialised: NaN
    }
    const bool reverse = (first / ranks) % 2 == 1;  // this cluster's blocks take their turns last rank first
    std::vector<std::unique_ptr<Block>> state;
    for (unsigned r = 0; r < ranks; ++r) state.push_back(std::make_unique<Block>(threads));
    std::vector<std::atomic<unsigned>> finished(ranks);
    std::vector<std::thread> pool;
    for (unsigned r = 0; r < ranks; ++r) {
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, r, t] {
          Block& here = *state[r];
          enter(here, first + r, t, blocks, threads);
          cluster = &here_cluster;
          cluster_block = r;
          cluster_turn = reverse ? ranks - 1 - r : r;
          turns = 0;
          here_cluster.turns.wait_for(cluster_turn);
          kernel(args...);
          leave(here, t);
          if (finished[r].fetch_add(1) + 1 == threads) {  // the block's last thread: its memory is gone, next turn
            std::memset(here_cluster.shared[r].get(), 0xff, shared_bytes);
            {
              std::lock_guard<std::mutex> lock(here_cluster.turns.m);
              ++here_cluster.turns.returned;
            }
            here_cluster.turns.pass();
          }
        });
      }
    }
    for (auto& t : pool) t.join();
    for (unsigned r = 1; r < ranks; ++r) {  // barriers[] is indexed by turn
      if (here_cluster.turns.barriers[r] != here_cluster.turns.barriers[0]) {
        std::fprintf(stderr, "cluster_sync: block %u passed %u cluster barriers, block %u %u\n",
                     reverse ? ranks - 1 - r : r, here_cluster.turns.barriers[r], reverse ? ranks - 1 : 0,
                     here_cluster.turns.barriers[0]);
        std::abort();
      }
    }
  }
}
}  // namespace emulated

// CUDA's semantics with a width: lanes form segments of `width`; source lanes are relative to the segment
template <typename T>
T __shfl_sync(unsigned, T value, int source, int width = 32) {
  return emulated::exchange(value, (emulated::lane & ~(width - 1)) + (source & (width - 1)));
}

template <typename T>
T __shfl_down_sync(unsigned, T value, unsigned delta, int width = 32) {
  const int target = emulated::lane + static_cast<int>(delta);  // past the segment: the lane's own value
  const bool inside = (target & ~(width - 1)) == (emulated::lane & ~(width - 1));
  return emulated::exchange(value, inside ? target : emulated::lane);
}

template <typename T>
T __shfl_xor_sync(unsigned, T value, int mask, int width = 32) {
  const int target = emulated::lane ^ mask;  // outside the segment: the lane's own value, as on a GPU
  const bool inside = (target & ~(width - 1)) == (emulated::lane & ~(width - 1));
  return emulated::exchange(value, inside ? target : emulated::lane);
}

// Bit l: lane l's predicate (every lane takes part, as the full-mask ballot requires on a GPU)
inline unsigned __ballot_sync(unsigned, bool predicate) {
  emulated::warp->slot[emulated::lane] = predicate ? 1u : 0u;
  emulated::warp->sync.arrive_and_wait();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(emulated::warp->slot[l] != 0) << l;
  emulated::warp->sync.arrive_and_wait();  // no lane overwrites a slot before every lane has read
  return bits;
}
inline int __ffs(unsigned x) { return x == 0 ? 0 : std::countr_zero(x) + 1; }  // 1 + the lowest set bit; 0 for 0

inline void __syncthreads() { emulated::block->arrive_and_wait(); }

// cooperative_groups::this_grid().sync() of a launch_cooperative grid: the block's threads meet, its first hands the
// turn on, and all wait for the block's next turn (after every other block has reached the barrier too)
namespace emulated {
inline void turn_barrier(Grid& g, unsigned b) {
  __syncthreads();
  if (threadIdx.x == 0) {
    g.arrive(b);
    g.pass();
  }
  ++turns;
  g.wait_for(turns * g.blocks + b);
}
}  // namespace emulated
inline void grid_sync() { emulated::turn_barrier(*emulated::grid, blockIdx.x); }

// cooperative_groups::this_cluster().sync() of a launch_cluster cluster, its block rank, a block's dynamic shared
// memory and map_shared_rank(p, rank): the same offset in block `rank`'s (p must lie in this block's)
inline void cluster_sync() { emulated::turn_barrier(emulated::cluster->turns, emulated::cluster_turn); }
inline int cluster_rank() { return static_cast<int>(emulated::cluster_block); }
inline void* dynamic_shared() { return emulated::cluster->shared[emulated::cluster_block].get(); }
template <typename P>
P* cluster_remote(P* p, int rank) {
  using Byte = std::conditional_t<std::is_const_v<P>, const unsigned char, unsigned char>;
  const auto* mine = emulated::cluster->shared[emulated::cluster_block].get();
  const auto offset = reinterpret_cast<const unsigned char*>(p) - mine;
  constexpr size_t size = std::is_void_v<P> ? 1 : sizeof(std::conditional_t<std::is_void_v<P>, char, P>);
  if (offset < 0 || static_cast<size_t>(offset) + size > emulated::cluster->shared_bytes || rank < 0 ||
      static_cast<unsigned>(rank) >= emulated::cluster->turns.blocks) {
    std::fprintf(stderr, "cluster_remote: offset %td or rank %d outside the cluster's shared memory\n", offset, rank);
    std::abort();
  }
  return reinterpret_cast<P*>(const_cast<Byte*>(emulated::cluster->shared[rank].get() + offset));
}

template <typename T>
T __ldcg(const T* p) {  // a load through L2 only, on a GPU; here memory is one
  return *p;
}
