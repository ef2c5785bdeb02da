// Loads of kItems = 8 consecutive elements a thread, shared by gae_kernel.h and whiten_kernels.h. A header of its
// own that includes nothing (the includer provides int64_t, uint8_t, float4, uint2, uint4, __half, __nv_bfloat16,
// to_float(T), __uint_as_float, __popc and the CUDA keywords, nvcc's own or tests/cuda_emulated/'s), so that the
// kernels using it also run under the warp emulator.
#pragma once

constexpr int kItems = 8;

// How many of elements t0..t0+count-1 lie below n, as an int (0..count): the element-by-element paths compare
// each index against it in 32 bits instead of t0 + index against n in 64 (two instructions each).
template <int count = kItems>
__device__ __forceinline__ int items_below(int64_t t0, int64_t n) {
  const int64_t left = n - t0;
  return left < 0 ? 0 : (left < count ? static_cast<int>(left) : count);
}

// Elements t0..t0+7 of p as float: one 16-byte load per 4 floats or per 8 halves when kVec (p + t0 16-byte
// aligned and all 8 below n: the caller's promise); else one element at a time, 0 at and past n.
template <bool kVec>
__device__ __forceinline__ void load8(const float* p, int64_t t0, int64_t n, float (&out)[kItems]) {
  if (kVec) {
    const float4 a = *reinterpret_cast<const float4*>(p + t0), b = *reinterpret_cast<const float4*>(p + t0 + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    const int below = items_below(t0, n);
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = k < below ? p[t0 + k] : 0.f;
  }
}

// Two 16-bit floats packed in a 32-bit word as floats: half through the hardware conversion, bfloat16 (float32's
// upper half) as bits: a shift for the low one and a mask for the high one, one instruction each where the
// conversion nvcc emits for the high half takes two (PRMT, SHL).
__device__ __forceinline__ void widen2(unsigned w, const __half*, float& lo, float& hi) {
  const __half* h = reinterpret_cast<const __half*>(&w);
  lo = to_float(h[0]);
  hi = to_float(h[1]);
}
__device__ __forceinline__ void widen2(unsigned w, const __nv_bfloat16*, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

template <bool kVec, typename H>  // H: __half or __nv_bfloat16
__device__ __forceinline__ void load8(const H* p, int64_t t0, int64_t n, float (&out)[kItems]) {
  if (kVec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + t0);
    widen2(raw.x, p, out[0], out[1]);
    widen2(raw.y, p, out[2], out[3]);
    widen2(raw.z, p, out[4], out[5]);
    widen2(raw.w, p, out[6], out[7]);
  } else {
    const int below = items_below(t0, n);
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = k < below ? to_float(p[t0 + k]) : 0.f;
  }
}

// Mask bytes t0..t0+7 of p as bools (nonzero: true), returning how many are true: one 8-byte load when kVec (p + t0
// 8-byte aligned, all 8 below n), the count by population counts of the two words (3 instructions a word mark
// each nonzero byte's top bit, whatever its value); else one byte at a time, false at and past n.
__device__ __forceinline__ int nonzero_bytes(unsigned w) {
  return __popc((((w & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w) & 0x80808080u);
}

template <bool kVec>
__device__ __forceinline__ int load8_mask(const uint8_t* p, int64_t t0, int64_t n, bool (&out)[kItems]) {
  if (kVec) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p + t0);
#pragma unroll
    for (int k = 0; k < kItems; ++k) out[k] = ((k < 4 ? raw.x >> (8 * k) : raw.y >> (8 * (k - 4))) & 0xffu) != 0;
    return nonzero_bytes(raw.x) + nonzero_bytes(raw.y);
  } else {
    const int below = items_below(t0, n);
    int count = 0;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      out[k] = k < below && p[t0 + k] != 0;
      count += out[k];
    }
    return count;
  }
}
