// CUDA kernels of the advantage ops on raw pointers: no torch headers, so this
// file compiles standalone (nvcc -c) and is bound in advantages_cuda_binding.cpp.
// The kernels themselves live in headers included below (gae_kernel.h, group_segment_kernel.h,
// whiten_kernels.h) that include nothing, so that tests/test_advantages.py also compiles them with the host
// compiler under a warp emulator (tests/cuda_emulated/) and checks them on a CPU, AddressSanitizer watching.
//
// gae: one block per sequence walks its row backwards in tiles of kThreads * kItems tokens (aligned to the row
// start). Each thread loads its kItems consecutive tokens (16-byte vector loads when the rows are aligned); every
// valid token's "next value" (that of the next valid token, found by a warp ballot and one shuffle, across warps
// through shared memory) gives its TD error; the advantage chain's two-component affine maps are composed over the
// thread's tokens, suffix-scanned across the warp by shuffles and chained across the warps from the state carried
// from the tile to the right; each thread then replays its tokens from its incoming advantage; the outputs go out
// through shared memory so that a warp's stores are contiguous.
// group_advantages: contiguous groups of up to 256 scores: a warp holds 32 / W of them (W the power of two >= an
// eighth of the group size), eight consecutive scores per lane (a 16-byte load where aligned), the statistics by
// shuffles within each W-lane segment (one coalesced read, one write); otherwise one warp per group, three passes
// over the (L1-resident) group.
// masked_whiten: per-block (count, pivot, mean - pivot, M2) from chunks of 8 consecutive values a thread (16-byte
// loads where aligned) by Chan merges; by default in one cooperative kernel that, after a grid barrier, merges them
// in every block and normalizes the block's own chunks (whiten_fused_kernel); else (misaligned memory, no cooperative
// launch, RLKERNELS_WHITEN=passes) one block merges them (and rescues an overflow, see kRescueDown) and every block
// of a third kernel normalizes its share, kUnroll loads per thread in flight.
#include <algorithm>
#include <atomic>

#include <cooperative_groups.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "advantages_cuda.h"
#include "per_device.h"  // once_per_device, device_attribute

namespace rlkernels_cuda {
namespace {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

#include "vector_loads.h"  // kItems, load8, load8_mask
#include "gae_kernel.h"  // Affine, gae_kernel, gae_passes

__device__ __forceinline__ int warp_sum(int x) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

constexpr int kGroupWarps = 4;

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

#include "group_segment_kernel.h"  // group_scale, group_segment_kernel, plan_group_segments

__global__ void __launch_bounds__(kGroupWarps * 32)
    group_kernel(const float* __restrict__ s, float* __restrict__ out, const int64_t* __restrict__ perm,
                 const int64_t* __restrict__ starts, int64_t G, int64_t group_size, int mode, float eps) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kGroupWarps + (threadIdx.x >> 5);
  if (g >= G) return;
  const int lane = threadIdx.x & 31;
  const int64_t lo = starts != nullptr ? starts[g] : g * group_size;
  const int64_t hi = starts != nullptr ? starts[g + 1] : lo + group_size;
  const double n = static_cast<double>(hi - lo);
  auto at = [&](int64_t i) { return perm != nullptr ? perm[i] : i; };
  const float first = s[at(lo)];
  double sum = 0.0;
  int differ = 0;
  for (int64_t i = lo + lane; i < hi; i += 32) {
    const float x = s[at(i)];
    sum += x;
    differ += (x != first);  // NaN != NaN: a group with NaN is never constant
  }
  const double mean = warp_sum(sum) / n;
  const bool zero = warp_sum(differ) == 0 || hi - lo < 2;
  double ssq = 0.0;
  for (int64_t i = lo + lane; i < hi; i += 32) {
    const double d = static_cast<double>(s[at(i)]) - mean;
    ssq += d * d;
  }
  ssq = warp_sum(ssq);
  const double scale = group_scale(mode, n, ssq, eps);
  for (int64_t i = lo + lane; i < hi; i += 32) {
    const int64_t j = at(i);
    out[j] = zero ? 0.f : static_cast<float>((static_cast<double>(s[j]) - mean) * scale);
  }
}

// 1/x from the special-function unit alone (MUFU.RCP, ~1 ulp; subnormals flushed): for counts >= 1
__device__ __forceinline__ float approx_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// A barrier of the whole grid of a cooperative launch (fences included): cooperative_groups' own, inlined (no -rdc)
__device__ __forceinline__ void grid_sync() { cooperative_groups::this_grid().sync(); }
#include "whiten_kernels.h"  // Moments, the fused whiten kernel, the three passes, whiten_parts

template <typename T>
int gae_launch(const void* rewards, const void* values, const uint8_t* mask, float* adv, float* ret, int64_t B,
               int64_t T_len, float gamma, float lam, cudaStream_t stream) {
  gae_passes(static_cast<const T*>(rewards), static_cast<const T*>(values), mask, adv, ret, B, T_len, gamma, lam,
             [stream](auto kernel, int64_t blocks, auto... args) {
               kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args...);
             });
  return static_cast<int>(cudaGetLastError());
}

bool cooperative_launch_supported();

template <typename T>
int whiten_resident_blocks(bool fused);

// Whether `stream` is capturing into a CUDA graph (an unanswerable query counts as capturing: the plain path)
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// `part` holds 4 * num_parts + 5 floats (num_parts = whiten_partials: enough for either path's grid)
template <typename T>
int whiten_launch(const void* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N, float eps,
                  bool shift_mean, bool fused, cudaStream_t stream) {
  if (N == 0) return 0;
  // A refused cooperative launch (too large a grid to be resident at once, or no support: nothing ran) falls to the
  // passes; any other error is the call's. Not taken while the stream is being captured into a CUDA graph: a launch
  // refused there would have invalidated the capture, and the passes capture plainly.
  cudaError_t fused_error = cudaSuccess;
  auto launch_cooperative = [stream, &fused_error](auto kernel, int blocks, auto... args) {
    cudaLaunchAttribute cooperative{};
    cooperative.id = cudaLaunchAttributeCooperative;
    cooperative.val.cooperative = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(blocks));
    config.blockDim = dim3(kWhitenThreads);
    config.stream = stream;
    config.attrs = &cooperative;
    config.numAttrs = 1;
    const cudaError_t error = cudaLaunchKernelEx(&config, kernel, args...);
    if (error == cudaErrorCooperativeLaunchTooLarge || error == cudaErrorNotSupported) {
      cudaGetLastError();  // the refusal must not surface as a later launch's error
      return false;
    }
    fused_error = error;
    return true;
  };
  const int fused_blocks = std::min(num_parts, whiten_parts(N, whiten_resident_blocks<T>(true)));
  if (fused && cooperative_launch_supported() && !capturing(stream) &&
      whiten_fused(static_cast<const T*>(x), mask, out, part, fused_blocks, N, eps, shift_mean, launch_cooperative)) {
    const cudaError_t last = cudaGetLastError();  // read (and cleared) either way
    return static_cast<int>(fused_error != cudaSuccess ? fused_error : last);
  }
  num_parts = std::min(num_parts, whiten_parts(N, whiten_resident_blocks<T>(false)));
  whiten_passes(static_cast<const T*>(x), mask, out, part, num_parts, N, eps, shift_mean,
                [stream](auto kernel, int blocks, auto... args) {
                  kernel<<<static_cast<unsigned>(blocks), kWhitenThreads, 0, stream>>>(args...);
                });
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int gae(int dtype, const void* rewards, const void* values, const uint8_t* mask, float* adv, float* ret, int64_t B,
        int64_t T_len, float gamma, float lam, cudaStream_t stream) {
  switch (dtype) {
    case kFloat32:
      return gae_launch<float>(rewards, values, mask, adv, ret, B, T_len, gamma, lam, stream);
    case kFloat16:
      return gae_launch<__half>(rewards, values, mask, adv, ret, B, T_len, gamma, lam, stream);
    case kBFloat16:
      return gae_launch<__nv_bfloat16>(rewards, values, mask, adv, ret, B, T_len, gamma, lam, stream);
    default:
      return -1;
  }
}

int group_advantages(const float* scores, float* out, const int64_t* perm, const int64_t* starts, int64_t G,
                     int64_t group_size, int mode, float eps, cudaStream_t stream) {
  if (G == 0) return 0;
  const SegmentPlan plan = plan_group_segments(G, group_size, scores, out);
  if (starts == nullptr && perm == nullptr && plan.usable) {
    auto kernel = plan.vec ? group_segment_kernel<true> : group_segment_kernel<false>;
    kernel<<<plan.blocks, kSegmentThreads, 0, stream>>>(scores, out, G, static_cast<int>(group_size), plan.width,
                                                        group_constants(mode, group_size, eps));
    return static_cast<int>(cudaGetLastError());
  }
  const int64_t blocks = (G + kGroupWarps - 1) / kGroupWarps;
  group_kernel<<<static_cast<unsigned>(blocks), kGroupWarps * 32, 0, stream>>>(scores, out, perm, starts, G,
                                                                               group_size, mode, eps);
  return static_cast<int>(cudaGetLastError());
}

namespace {

// Blocks of one whitening path's kernels one wave of the current device holds (SMs x resident blocks per SM of the
// kernel that fits fewest: the fused kernel, whose grid must be resident at once, or the statistics pass's two
// variants), from the occupancy calculator, once per device, dtype and path; kMaxWhitenParts if the runtime cannot
// say (a cooperative launch of more blocks than fit is refused, and the passes run).
template <typename T>
int whiten_resident_blocks(bool fused) {
  static std::atomic<int> cached[2][kMaxDevices];
  const int blocks = once_per_device(cached[fused], [fused](int device) {
    const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
    int fewest = 0;
    bool known = sms >= 1;
    auto per_sm = [&](auto kernel) {
      int n = 0;
      known = known && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kWhitenThreads, 0) == cudaSuccess &&
              n >= 1;
      fewest = fewest == 0 || n < fewest ? n : fewest;
    };
    if (fused) {
      per_sm(whiten_fused_kernel<T>);
    } else {
      per_sm(whiten_partial_kernel<T, true>);
      per_sm(whiten_partial_kernel<T, false>);
    }
    cudaGetLastError();  // a failed query's error must not surface as a later launch's
    return known ? sms * fewest : 0;
  }, 0);
  return blocks > 0 ? blocks : kMaxWhitenParts;
}

// Whether the current device runs cooperative launches (every Volta and later GPU does, outside some MPS and
// virtualised setups), once per device.
bool cooperative_launch_supported() {
  static std::atomic<int> cached[kMaxDevices];
  return once_per_device(cached, [](int device) { return device_attribute(cudaDevAttrCooperativeLaunch, device) != 0; },
                         0) != 0;
}

template <typename T>
int whiten_partials_of() {  // the larger of the two paths' one-wave grids
  const int fused = whiten_resident_blocks<T>(true), passes = whiten_resident_blocks<T>(false);
  return fused > passes ? fused : passes;
}
}  // namespace

int whiten_partials(int dtype, int64_t N) {
  switch (dtype) {
    case kFloat16:
      return whiten_parts(N, whiten_partials_of<__half>());
    case kBFloat16:
      return whiten_parts(N, whiten_partials_of<__nv_bfloat16>());
    default:
      return whiten_parts(N, whiten_partials_of<float>());
  }
}

int masked_whiten(int dtype, const void* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N,
                  float eps, bool shift_mean, bool fused, cudaStream_t stream) {
  switch (dtype) {
    case kFloat32:
      return whiten_launch<float>(x, mask, out, part, num_parts, N, eps, shift_mean, fused, stream);
    case kFloat16:
      return whiten_launch<__half>(x, mask, out, part, num_parts, N, eps, shift_mean, fused, stream);
    case kBFloat16:
      return whiten_launch<__nv_bfloat16>(x, mask, out, part, num_parts, N, eps, shift_mean, fused, stream);
    default:
      return -1;
  }
}

}  // namespace rlkernels_cuda
