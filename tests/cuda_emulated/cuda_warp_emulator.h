// A host-compiler stand-in for the CUDA features the csrc kernels use, so that a kernel's own source
// (csrc/group_segment_kernel.h, csrc/whiten_kernels.h, csrc/gae_kernel.h) can be run and checked on a CPU: every thread of a block runs
// as a host thread, all of the block's at once; a shuffle is an exchange through the warp's slots between two
// barriers of its 32 lanes (all 32 reach every shuffle, as the full-mask shuffles require on a GPU);
// __syncthreads is a barrier of the block's threads; __shared__ variables are function-local statics (shared by
// the block's threads; blocks run one after another). A cooperative launch (launch_cooperative) gives every thread
// of the grid a host thread and runs one block at a time between grid_sync() barriers, so that a block's
// registers (locals) live across them and its __shared__ statics are its own while it runs. Memory is plain host
// memory, so AddressSanitizer (-fsanitize=address) sees any read or write out of bounds.
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
inline void grid_sync() {
  __syncthreads();
  if (threadIdx.x == 0) {
    emulated::grid->arrive(blockIdx.x);
    emulated::grid->pass();
  }
  ++emulated::turns;
  emulated::grid->wait_for(emulated::turns * emulated::grid->blocks + blockIdx.x);
}

template <typename T>
T __ldcg(const T* p) {  // a load through L2 only, on a GPU; here memory is one
  return *p;
}
