// gae's CUDA kernel (see advantages_cuda.cu's opening comment) and its launch. A header of its own, included by
// advantages_cuda.cu inside its namespace, so that the tests can also compile the kernel with the host compiler
// under a warp emulator (tests/cuda_emulated/) and check it on the CPU against the float64 truth. It includes
// nothing: the includer provides int64_t, uint8_t, uintptr_t, float4 / make_float4, kItems, load8 and load8_mask
// (vector_loads.h), __shfl_down_sync, __syncthreads, __shared__, blockIdx / threadIdx and the CUDA keywords
// (nvcc's own, or the emulator's).
#pragma once

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

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
