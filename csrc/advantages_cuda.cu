// CUDA kernels of the advantage ops on raw pointers: no torch headers, so this
// file compiles standalone (nvcc -c) and is bound in advantages_cuda_binding.cpp.
//
// gae: one block per sequence walks its row backwards in tiles of
// kThreads * kItems tokens (aligned to the row start). Each thread loads its kItems
// consecutive tokens (16-byte vector loads when the rows are aligned) and composes their
// affine maps, a warp-shuffle suffix scan composes them across the warp, the warps'
// boundary states are chained in shared memory, and each thread then replays its
// tokens from its incoming state; the outputs go out through shared memory so that a warp's
// stores are contiguous. The state (A, V) = (advantage, value) of the next valid token carries
// from tile to tile.
// group_advantages: contiguous groups of up to 256 scores: a warp holds 32 / W of them (W the power of two >= an
// eighth of the group size), eight consecutive scores per lane (a 16-byte load where aligned), the statistics by
// shuffles within each W-lane segment (one coalesced read, one write); otherwise one warp per group, three passes
// over the (L1-resident) group.
// masked_whiten: per-block (count, pivot, mean - pivot, M2) by Chan merges, one block merges
// them (and rescues an overflow, see whiten_merge_kernel), then every block of a third kernel
// normalizes its share; both passes keep kUnroll loads per thread in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "advantages_cuda.h"

namespace rlkernels_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 8;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// A' = a*A + b*V + c, V' = z*V + e
struct Affine {
  float a, b, c, z, e;
};

__device__ __forceinline__ Affine identity() { return {1.f, 0.f, 0.f, 1.f, 0.f}; }

// first `p` (later tokens), then `q` (earlier tokens)
__device__ __forceinline__ Affine then(const Affine& p, const Affine& q) {
  return {q.a * p.a, q.a * p.b + q.b * p.z, q.a * p.c + q.b * p.e + q.c, q.z * p.z, q.z * p.e + q.e};
}

__device__ __forceinline__ Affine shfl_down(const Affine& x, int delta) {
  return {__shfl_down_sync(0xffffffffu, x.a, delta), __shfl_down_sync(0xffffffffu, x.b, delta),
          __shfl_down_sync(0xffffffffu, x.c, delta), __shfl_down_sync(0xffffffffu, x.z, delta),
          __shfl_down_sync(0xffffffffu, x.e, delta)};
}

// kItems consecutive tokens t0..t0+7 as float: one 16-byte load per 4 floats or per 8 halves, when
// kVec (the row base and t0 16-byte aligned and the 8 tokens inside the row); else one element at a time.
template <bool kVec>
__device__ __forceinline__ void load8(const float* p, int64_t t0, int64_t n, float (&out)[kItems]) {
  if (kVec) {
    const float4 a = *reinterpret_cast<const float4*>(p + t0), b = *reinterpret_cast<const float4*>(p + t0 + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = t0 + k < n ? p[t0 + k] : 0.f;
  }
}

template <bool kVec, typename H>  // H: __half or __nv_bfloat16
__device__ __forceinline__ void load8(const H* p, int64_t t0, int64_t n, float (&out)[kItems]) {
  if (kVec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + t0);
    const H* h = reinterpret_cast<const H*>(&raw);
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = to_float(h[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = t0 + k < n ? to_float(p[t0 + k]) : 0.f;
  }
}

template <bool kVec>
__device__ __forceinline__ void load8_mask(const uint8_t* p, int64_t t0, int64_t n, bool (&out)[kItems]) {
  if (kVec) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p + t0);
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = ((k < 4 ? raw.x >> (8 * k) : raw.y >> (8 * (k - 4))) & 0xffu) != 0;
  } else {
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = t0 + k < n && p[t0 + k] != 0;
  }
}

// Each thread holds kItems consecutive outputs of the tile; they go out through shared memory so that one
// store instruction of a warp writes consecutive addresses (512 bytes with kVec, 128 without) instead of
// 32 strided pieces.
template <bool kVec>
__device__ __forceinline__ void store_tile(float* out, int64_t tile_start, int64_t n, const float (&x)[kItems],
                                           float4* stage) {
  stage[2 * threadIdx.x] = make_float4(x[0], x[1], x[2], x[3]);
  stage[2 * threadIdx.x + 1] = make_float4(x[4], x[5], x[6], x[7]);
  __syncthreads();
  if (kVec) {  // n and tile_start are multiples of 8: a float4 is wholly inside the row or wholly past it
#pragma unroll
    for (int j = 0; j < kItems / 4; ++j) {
      const int i = j * kThreads + threadIdx.x;  // float4 index in the tile
      if (tile_start + 4 * i < n) *reinterpret_cast<float4*>(out + tile_start + 4 * i) = stage[i];
    }
  } else {
    const float* flat = reinterpret_cast<const float*>(stage);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = j * kThreads + threadIdx.x;
      if (tile_start + i < n) out[tile_start + i] = flat[i];
    }
  }
  __syncthreads();  // the stage is rewritten by the next store
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) gae_kernel(const T* __restrict__ rewards, const T* __restrict__ values,
                                                       const uint8_t* __restrict__ mask, float* __restrict__ adv,
                                                       float* __restrict__ ret, int64_t T_len, float gamma, float lam) {
  __shared__ float warp_a[kWarps], warp_v[kWarps];  // state entering each warp (from its right)
  __shared__ Affine warp_map[kWarps];
  __shared__ float carry[2];
  __shared__ float4 stage[kThreads * kItems / 4];  // one tile of outputs, for coalesced stores
  const int64_t row = blockIdx.x;
  const T* r = rewards + row * T_len;
  const T* v = values + row * T_len;
  const uint8_t* m = mask + row * T_len;
  float* a_out = adv + row * T_len;
  float* r_out = ret + row * T_len;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float gl = gamma * lam;
  if (threadIdx.x == 0) carry[0] = carry[1] = 0.f;
  constexpr int kTile = kThreads * kItems;
  // tiles start at multiples of kTile from the row start (aligned vector loads), walked from the last one;
  // tokens past the row end are identities
  for (int64_t tile_start = (T_len - 1) / kTile * kTile; tile_start >= 0; tile_start -= kTile) {
    const int64_t first = tile_start + static_cast<int64_t>(threadIdx.x) * kItems;
    float rv[kItems], vv[kItems];
    bool ok[kItems];
    if (first < T_len) {
      load8<kVec>(r, first, T_len, rv);
      load8<kVec>(v, first, T_len, vv);
      load8_mask<kVec>(m, first, T_len, ok);
    } else {
#pragma unroll
      for (int k = 0; k < kItems; ++k) rv[k] = vv[k] = 0.f, ok[k] = false;
    }
    Affine mine = identity();
#pragma unroll
    for (int k = kItems - 1; k >= 0; --k) {
      if (ok[k]) mine = then(mine, Affine{gl, gamma, rv[k] - vv[k], 0.f, vv[k]});
    }
    // inclusive suffix scan inside the warp: lane l composes lanes l..31
    Affine suffix = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      Affine other = shfl_down(suffix, d);
      if (lane + d < 32) suffix = then(other, suffix);
    }
    Affine after = shfl_down(suffix, 1);  // lanes l+1..31
    if (lane == 31) after = identity();
    if (lane == 0) warp_map[warp] = suffix;
    __syncthreads();
    if (threadIdx.x == 0) {  // chain the warps from the right, starting at the carried state
      float A = carry[0], V = carry[1];
      for (int w = kWarps - 1; w >= 0; --w) {
        warp_a[w] = A;
        warp_v[w] = V;
        const Affine& f = warp_map[w];
        const float A2 = f.a * A + f.b * V + f.c;
        V = f.z * V + f.e;
        A = A2;
      }
      carry[0] = A;
      carry[1] = V;
    }
    __syncthreads();
    float A = after.a * warp_a[warp] + after.b * warp_v[warp] + after.c;
    float V = after.z * warp_v[warp] + after.e;
    float out[kItems];
#pragma unroll
    for (int k = kItems - 1; k >= 0; --k) {
      out[k] = 0.f;
      if (ok[k]) {
        out[k] = rv[k] + gamma * V - vv[k] + gl * A;
        A = out[k];
        V = vv[k];
      }
    }
    store_tile<kVec>(a_out, tile_start, T_len, out, stage);
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] += vv[k];
    store_tile<kVec>(r_out, tile_start, T_len, out, stage);  // its trailing barrier also guards carry/warp_*
  }
}

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

#include "whiten_kernels.h"  // Moments, the three whiten kernels, whiten_parts

template <typename T>
int gae_launch(const void* rewards, const void* values, const uint8_t* mask, float* adv, float* ret, int64_t B,
               int64_t T_len, float gamma, float lam, cudaStream_t stream) {
  if (B == 0 || T_len == 0) return 0;
  // vector loads need every row start 16-byte aligned: aligned bases and rows of a multiple of 8 tokens
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = T_len % kItems == 0 && aligned(rewards) && aligned(values) && aligned(adv) && aligned(ret) &&
                   reinterpret_cast<uintptr_t>(mask) % 8 == 0;
  const T* r = static_cast<const T*>(rewards);
  const T* v = static_cast<const T*>(values);
  if (vec) {
    gae_kernel<T, true><<<static_cast<unsigned>(B), kThreads, 0, stream>>>(r, v, mask, adv, ret, T_len, gamma, lam);
  } else {
    gae_kernel<T, false><<<static_cast<unsigned>(B), kThreads, 0, stream>>>(r, v, mask, adv, ret, T_len, gamma, lam);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int whiten_launch(const void* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N, float eps,
                  bool shift_mean, cudaStream_t stream) {
  if (N == 0) return 0;
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
    kernel<<<plan.blocks, kSegmentThreads, 0, stream>>>(scores, out, G, static_cast<int>(group_size), plan.width, mode,
                                                        eps);
    return static_cast<int>(cudaGetLastError());
  }
  const int64_t blocks = (G + kGroupWarps - 1) / kGroupWarps;
  group_kernel<<<static_cast<unsigned>(blocks), kGroupWarps * 32, 0, stream>>>(scores, out, perm, starts, G,
                                                                               group_size, mode, eps);
  return static_cast<int>(cudaGetLastError());
}

int whiten_partials(int64_t N) { return whiten_parts(N); }

int masked_whiten(int dtype, const void* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N,
                  float eps, bool shift_mean, cudaStream_t stream) {
  switch (dtype) {
    case kFloat32:
      return whiten_launch<float>(x, mask, out, part, num_parts, N, eps, shift_mean, stream);
    case kFloat16:
      return whiten_launch<__half>(x, mask, out, part, num_parts, N, eps, shift_mean, stream);
    case kBFloat16:
      return whiten_launch<__nv_bfloat16>(x, mask, out, part, num_parts, N, eps, shift_mean, stream);
    default:
      return -1;
  }
}

}  // namespace rlkernels_cuda
