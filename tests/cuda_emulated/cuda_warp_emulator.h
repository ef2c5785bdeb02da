// A host-compiler stand-in for the CUDA features a warp-synchronous kernel without shared memory uses, so that
// such a kernel's own source (csrc/group_segment_kernel.h) can be run and checked on a CPU: each warp's 32 lanes
// run as 32 threads, and every shuffle is an exchange through the warp's slots between two barriers (all 32 lanes
// reach every shuffle, as the full-mask shuffles require on a GPU). Blocks and warps run one after another.
// Memory is plain host memory, so AddressSanitizer (-fsanitize=address) sees any read or write out of bounds.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct EmulatedIndex {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmulatedIndex threadIdx, blockIdx;

struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
using std::fmax;
using std::sqrt;

namespace emulated {
struct Warp {
  std::barrier<> sync{32};
  uint64_t slot[32] = {};
};
inline thread_local Warp* warp = nullptr;
inline thread_local int lane = 0;

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

// kernel<<<blocks, threads>>>(args...): threads a multiple of 32
template <typename Kernel, typename... Args>
void launch(unsigned blocks, unsigned threads, Kernel kernel, Args... args) {
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned w = 0; w < threads / 32; ++w) {
      Warp shared_warp;
      std::vector<std::thread> lanes;
      for (int l = 0; l < 32; ++l) {
        lanes.emplace_back([&, l] {
          blockIdx.x = b;
          threadIdx.x = w * 32 + l;
          warp = &shared_warp;
          lane = l;
          kernel(args...);
        });
      }
      for (auto& t : lanes) t.join();
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
T __shfl_xor_sync(unsigned, T value, int mask, int width = 32) {
  const int target = emulated::lane ^ mask;  // outside the segment: the lane's own value, as on a GPU
  const bool inside = (target & ~(width - 1)) == (emulated::lane & ~(width - 1));
  return emulated::exchange(value, inside ? target : emulated::lane);
}
