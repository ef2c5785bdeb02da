// gae's CUDA kernel (see advantages_cuda.cu's opening comment) and its launch. A header of its own, included by
// advantages_cuda.cu inside its namespace, so that the tests can also compile the kernel with the host compiler
// under a warp emulator (tests/cuda_emulated/) and check it on the CPU against the float64 truth. It includes
// nothing: the includer provides int64_t, uint8_t, uintptr_t, float4 / make_float4, kItems, items_below, load8 and
// load8_mask (vector_loads.h), __shfl_sync, __shfl_down_sync, __ballot_sync, __ffs, fmaf,
// __syncthreads, __shared__, blockIdx / threadIdx and the CUDA keywords (nvcc's own, or the emulator's).
#pragma once

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The advantage chain of a run of tokens as one affine map of the advantage entering it from the right (that of
// the next valid token after the run): A_first = a·A_in + c. A valid token maps A to gl·A + delta, a masked one
// passes it through (a = 1, c = 0).
struct Chain {
  float a, c;
};

// `left` (earlier tokens) after `right` (later ones): A = left.a·(right.a·A_in + right.c) + left.c
__device__ __forceinline__ Chain then(const Chain& left, const Chain& right) {
  return {left.a * right.a, fmaf(left.a, right.c, left.c)};
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
    const int below = items_below<kThreads * kItems>(tile_start, n);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = j * kThreads + threadIdx.x;
      if (i < below) out[tile_start + i] = flat[i];
    }
  }
  __syncthreads();  // the stage is rewritten by the next store
}

// Tile by tile from the row's end, in two steps. (1) Each token's "next value" (the value of the next valid token
// after it, or of the state carried from the tiles to the right, 0 past the row's end): within a thread by a sweep
// of its 8 tokens; across lanes by a ballot of the lanes holding a valid token and one shuffle from the nearest such
// lane to the right; across warps through shared memory. Then every valid token's TD error delta = r + gamma·next -
// v is known. (2) The advantages, A = delta + gl·A_next over valid tokens (masked ones transparent), as a suffix
// scan of two-component affine maps (Chain): composed over a thread's 8 tokens, across the warp by shuffles, across
// warps through shared memory from the carried advantage; each thread then replays its tokens from its incoming
// advantage. Before (one five-component map (A, V) per token, composed by every shuffle step), the tile loop took
// 63-81 SASS instructions per token on sm_90; the 16-bit ones were over their 5-per-byte budget.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) gae_kernel(const T* __restrict__ rewards, const T* __restrict__ values,
                                                       const uint8_t* __restrict__ mask, float* __restrict__ adv,
                                                       float* __restrict__ ret, int64_t T_len, float gamma, float lam) {
  __shared__ float warp_value[kWarps];  // value of each warp's earliest valid token
  __shared__ bool warp_any[kWarps];     // whether the warp holds a valid token
  __shared__ Chain warp_chain[kWarps];  // each warp's composed map
  __shared__ float carry[2][2];  // (advantage, value) entering a tile from the right; double-buffered by tile parity
  __shared__ float4 stage[kThreads * kItems / 4];  // one tile of outputs, for coalesced stores
  const int64_t row = blockIdx.x;
  const T* r = rewards + row * T_len;
  const T* v = values + row * T_len;
  const uint8_t* m = mask + row * T_len;
  float* a_out = adv + row * T_len;
  float* r_out = ret + row * T_len;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned later_lanes = ~((2u << lane) - 1u);  // lanes lane+1..31 (none for lane 31: 2u << 31 wraps to 0)
  const unsigned later_warps = ~((2u << warp) - 1u) & ((1u << kWarps) - 1u);
  const float gl = gamma * lam;
  if (threadIdx.x == 0) carry[0][0] = carry[0][1] = 0.f;
  constexpr int kTile = kThreads * kItems;
  int parity = 0;
  // tiles start at multiples of kTile from the row start (aligned vector loads), walked from the last one;
  // tokens past the row end are masked out
  for (int64_t tile_start = (T_len - 1) / kTile * kTile; tile_start >= 0; tile_start -= kTile, parity ^= 1) {
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
    // (1) next values
    float earliest = 0.f;  // value of the thread's earliest valid token
    bool any = false;
#pragma unroll
    for (int k = kItems - 1; k >= 0; --k) {
      earliest = ok[k] ? vv[k] : earliest;
      any = any || ok[k];
    }
    const unsigned valid_lanes = __ballot_sync(0xffffffffu, any);
    const unsigned right = valid_lanes & later_lanes;
    const float from_lane = __shfl_sync(0xffffffffu, earliest, right != 0u ? __ffs(right) - 1 : lane);
    const float warp_earliest = __shfl_sync(0xffffffffu, earliest, valid_lanes != 0u ? __ffs(valid_lanes) - 1 : 0);
    if (lane == 0) warp_value[warp] = warp_earliest, warp_any[warp] = valid_lanes != 0u;
    __syncthreads();
    const unsigned valid_warps = __ballot_sync(0xffffffffu, lane < kWarps && warp_any[lane]);  // bit w: warp w
    const unsigned right_warps = valid_warps & later_warps;
    const float tile_value = carry[parity][1];
    float next = right != 0u ? from_lane : (right_warps != 0u ? warp_value[__ffs(right_warps) - 1] : tile_value);
    float delta[kItems];
    Chain mine{1.f, 0.f};
#pragma unroll
    for (int k = kItems - 1; k >= 0; --k) {
      delta[k] = rv[k] + gamma * next - vv[k];
      next = ok[k] ? vv[k] : next;
      mine = ok[k] ? Chain{gl * mine.a, fmaf(gl, mine.c, delta[k])} : mine;
    }
    // (2) advantages: inclusive suffix scan inside the warp (lane l composes lanes l..31)
    Chain suffix = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const Chain other{__shfl_down_sync(0xffffffffu, suffix.a, d), __shfl_down_sync(0xffffffffu, suffix.c, d)};
      if (lane + d < 32) suffix = then(suffix, other);
    }
    Chain after{__shfl_down_sync(0xffffffffu, suffix.a, 1), __shfl_down_sync(0xffffffffu, suffix.c, 1)};
    if (lane == 31) after = Chain{1.f, 0.f};  // lanes l+1..31
    if (lane == 0) warp_chain[warp] = suffix;
    __syncthreads();
    float A = carry[parity][0];  // entering the warps to the right of this one, from the right
#pragma unroll
    for (int w = kWarps - 1; w > 0; --w)  // unrolled (a loop of `warp`-dependent length, nvcc unrolls 4x + 2x + 1x)
      if (w > warp) A = fmaf(warp_chain[w].a, A, warp_chain[w].c);
    if (threadIdx.x == 0) {  // the state entering the next tile (to the left): this whole tile applied
      const Chain& whole = warp_chain[0];
      carry[parity ^ 1][0] = fmaf(whole.a, A, whole.c);
      carry[parity ^ 1][1] = valid_warps != 0u ? warp_value[__ffs(valid_warps) - 1] : tile_value;
    }
    A = fmaf(after.a, A, after.c);  // entering this thread's tokens
    float out[kItems];
#pragma unroll
    for (int k = kItems - 1; k >= 0; --k) {
      out[k] = ok[k] ? fmaf(gl, A, delta[k]) : 0.f;
      A = ok[k] ? out[k] : A;
    }
    store_tile<kVec>(a_out, tile_start, T_len, out, stage);
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] += vv[k];
    store_tile<kVec>(r_out, tile_start, T_len, out, stage);  // its barriers also order the next tile's shared use
  }
}

// gae_kernel over B rows of T_len tokens on `launch(kernel, blocks, args...)` (a launch of kThreads threads per
// block on one stream, or the emulator's): the 16-byte path where every row start is 16-byte aligned (aligned
// bases, rows of a multiple of 8 tokens, the mask 8-byte aligned).
template <typename T, typename Launch>
void gae_passes(const T* rewards, const T* values, const uint8_t* mask, float* adv, float* ret, int64_t B,
                int64_t T_len, float gamma, float lam, Launch launch) {
  if (B == 0 || T_len == 0) return;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = T_len % kItems == 0 && aligned(rewards) && aligned(values) && aligned(adv) && aligned(ret) &&
                   reinterpret_cast<uintptr_t>(mask) % 8 == 0;
  launch(vec ? gae_kernel<T, true> : gae_kernel<T, false>, B, rewards, values, mask, adv, ret, T_len, gamma, lam);
}
