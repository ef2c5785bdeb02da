// group_advantages' CUDA kernel for contiguous groups of up to 256 scores, and the statistics every group kernel
// shares. A header of its own, included by advantages_cuda.cu inside its namespace, so that the tests can also
// compile it with the host compiler under a warp emulator (tests/cuda_emulated/) and check the kernel and its
// launch plan on the CPU against the float64 truth (tests/test_advantages.py). It includes nothing: the includer
// provides int64_t, uintptr_t, float4 / make_float4, __shfl_sync / __shfl_xor_sync, sqrt, fmax, fma,
// blockIdx / threadIdx and the CUDA keywords (nvcc's own, or the emulator's).
#pragma once

// The statistics in double, as the CPU kernel keeps them (the op is memory bound): exact to float32 rounding
// for any group size, and scores up to float32's 3.4e38 neither overflow the sum nor the squared deviations.
// (They were float32 with power-of-two scaling past 2^32: on an H100, groups of 6000 huge scores came out with
// 18 float32 ulps of error, from the float32 sum of ~190 scores per lane.)
// The scale of (s - mean) for n scores: grpo 1/(std + eps) with the unbiased std, dr_grpo 1, rloo n/(n-1)
// (s - (Σs - s)/(n-1) = n/(n-1)·(s - mean)).
__device__ __forceinline__ double group_scale(int mode, double n, double ssq, float eps) {
  if (mode == 0) return 1.0 / (sqrt(ssq / fmax(n - 1.0, 1.0)) + static_cast<double>(eps));
  if (mode == 1) return 1.0;
  return n / fmax(n - 1.0, 1.0);
}

// What group_segment_kernel needs of the mode and the group size, formed once on the host: 1/n and 1/max(n - 1, 1)
// (multiplied, where a double division costs each thread ~20 instructions and a slow-path call), and the scale
// itself where it does not depend on the group (dr_grpo 1, rloo n/(n-1)); mode 0 (grpo) forms its own. The same
// rule as group_scale above, which group_kernel keeps (its group sizes vary, and forming these constants per group
// there made sm_90 spill around the float64 divisions' slow-path calls).
struct GroupConstants {
  int mode;
  float eps;
  double inv_n, inv_dof, fixed_scale;
};

inline GroupConstants group_constants(int mode, int64_t group_size, float eps) {
  const double n = static_cast<double>(group_size), dof = n > 1.0 ? n - 1.0 : 1.0;
  return {mode, eps, 1.0 / n, 1.0 / dof, mode == 1 ? 1.0 : n / dof};
}

constexpr int kSegmentThreads = 256;
constexpr int kSegmentItems = 8;  // consecutive scores per lane: two 16-byte loads where aligned

// Contiguous groups of group_size <= 32 * kSegmentItems = 256 scores: a group takes a segment of `width` lanes
// (the power of two >= ceil(group_size / 8)); segment k of a warp holds group warp * (32 / width) + k, and lane p
// of it the group's scores [8p, 8p + 8) (those past group_size: nothing). The same statistics as group_kernel, in
// double, summed over the lane's scores, then over the segment's lanes by shuffles.
// Why 8 per lane: with one score per lane (before), each thread's double shuffles, divide and square root cost
// ~250 SASS instructions per score (2^20 scores in groups of 16 took 15.2 us on an H200 against a 2 us memory
// bound); 8 per lane pays them once per 8 scores, and 2^20 scores take 2^17 threads (under one wave on 132 SMs).
// kVec: 16-byte loads and stores (the caller checks group_size % 4 == 0 and 16-byte aligned pointers, so each
// half of a lane's 8 scores is wholly inside its group or wholly past it).
template <bool kVec>
__global__ void __launch_bounds__(kSegmentThreads, 5)  // sm_90: 42 / 38 registers (kVec false / true), no spills
    group_segment_kernel(const float* __restrict__ s, float* __restrict__ out, int64_t G, int group_size, int width,
                         GroupConstants c) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kSegmentThreads + threadIdx.x;
  const int lane = threadIdx.x & 31;
  const int pos = (lane & (width - 1)) * kSegmentItems;  // the lane's first score within its group
  const int64_t g = (thread >> 5) * (32 / width) + lane / width;
  const bool group_ok = g < G;
  const int64_t i = g * group_size + pos;
  float x[kSegmentItems];  // 0 where not in the group
  // in[k]: score k of the lane is in its group (kVec: group_size % 4 == 0, so each half is wholly in or out)
  const int inside = group_ok ? group_size - pos : 0;
  bool in[kSegmentItems];
#pragma unroll
  for (int k = 0; k < kSegmentItems; ++k) in[k] = (kVec ? k & ~3 : k) < inside;
  if (kVec) {
#pragma unroll
    for (int h = 0; h < kSegmentItems; h += 4) {
      const float4 v = in[h] ? *reinterpret_cast<const float4*>(s + i + h) : make_float4(0.f, 0.f, 0.f, 0.f);
      x[h] = v.x, x[h + 1] = v.y, x[h + 2] = v.z, x[h + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kSegmentItems; ++k) x[k] = in[k] ? s[i + k] : 0.f;
  }
  const float first = __shfl_sync(0xffffffffu, x[0], 0, width);  // the segment's lane 0: the group's first score
  double xd[kSegmentItems], sum = 0.0;
  int differ = 0;
#pragma unroll
  for (int k = 0; k < kSegmentItems; ++k) {
    xd[k] = static_cast<double>(x[k]);
    sum += xd[k];  // 0 where not in the group
    differ |= in[k] && (x[k] != first);  // NaN != NaN: a group with NaN is never constant
  }
  for (int d = width >> 1; d > 0; d >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, d, width);
    differ |= __shfl_xor_sync(0xffffffffu, differ, d, width);
  }
  const double mean = sum * c.inv_n;
  double ssq = 0.0;
#pragma unroll
  for (int k = 0; k < kSegmentItems; ++k) {
    const double dev = in[k] ? xd[k] - mean : 0.0;
    ssq = fma(dev, dev, ssq);
  }
  for (int d = width >> 1; d > 0; d >>= 1) ssq += __shfl_xor_sync(0xffffffffu, ssq, d, width);
  const bool zero = differ == 0 || group_size < 2;
  const double scale = c.mode == 0 ? 1.0 / (sqrt(ssq * c.inv_dof) + static_cast<double>(c.eps)) : c.fixed_scale;
  float y[kSegmentItems];
#pragma unroll
  for (int k = 0; k < kSegmentItems; ++k) y[k] = zero ? 0.f : static_cast<float>((xd[k] - mean) * scale);
  if (kVec) {
#pragma unroll
    for (int h = 0; h < kSegmentItems; h += 4)
      if (in[h]) *reinterpret_cast<float4*>(out + i + h) = make_float4(y[h], y[h + 1], y[h + 2], y[h + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < kSegmentItems; ++k)
      if (in[k]) out[i + k] = y[k];
  }
}

// How group_advantages launches group_segment_kernel for G contiguous groups of group_size scores: usable (group
// sizes 1..256), the 16-byte path (vec), the lanes per group (width) and the blocks of kSegmentThreads threads.
struct SegmentPlan {
  bool usable, vec;
  int width;
  unsigned blocks;
};

inline SegmentPlan plan_group_segments(int64_t G, int64_t group_size, const void* scores, const void* out) {
  SegmentPlan plan{false, false, 1, 0};
  if (group_size < 1 || group_size > 32 * kSegmentItems) return plan;
  const int lanes = static_cast<int>((group_size + kSegmentItems - 1) / kSegmentItems);
  while (plan.width < lanes) plan.width <<= 1;
  const int64_t groups_per_block = (kSegmentThreads / 32) * (32 / plan.width);
  plan.blocks = static_cast<unsigned>((G + groups_per_block - 1) / groups_per_block);
  plan.vec = group_size % 4 == 0 && reinterpret_cast<uintptr_t>(scores) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(out) % 16 == 0;
  plan.usable = true;
  return plan;
}
