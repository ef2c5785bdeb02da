// GAE's CPU fast path: four float32 rows with unit token stride, one per SSE lane, free of ATen so that
// bench/cpu_gae_rows.cpp measures the very code the extension runs (csrc/advantages.cpp uses it for float32
// inputs whose tokens are contiguous; everything else takes the scalar tile there).
//
// The scalar tile spends about 4 cycles per token: per row and token, three loads, address arithmetic, two
// multiply-adds, three selects and two stores, for R rows. Here lane i of a 128-bit register holds row i: each
// row's next four tokens are loaded as one 16-byte vector, four such vectors (rows 0..3) are transposed so that
// register k holds token k of every row, the recursion steps through k = 3..0 once for all four rows, and the
// outputs are transposed back and stored as 16-byte vectors. The arithmetic is gae_step's (gae_tile.h), operation
// for operation ((r + gamma·next_value - v) + gamma·lambda·next_adv; a select per state), so both paths give the
// same bits. Measured side by side (bench/cpu_gae_rows.cpp, one thread, B = 64, T = 512-4112, both skewed by
// csrc/gae_row_skew.h's rule; bench/results/cpu-gae-rows-2026-11-26.txt, four runs on a machine whose speed
// varied): 0.89-1.30 ns per token against 1.22-2.77 for the scalar tile; in each line (the two timed back to
// back) 1.05-2.33x faster, median 2.0x over the 48 lines. Those runs timed a unit-stride copy of the scalar loop; timed
// against gae_tile.h's gae_row_tile itself, the extension's scalar tile, it is 1.98-3.07 ns per token with the skew
// rule against 0.94-1.25 for this tile (two runs, same file).
//
// Lane i runs skew·i tokens behind lane 0, as in the scalar tile (rows a multiple of 4 KiB apart would otherwise
// share an L1 set: 1.7-1.8 ns per token at T = 2048 and 4096 unskewed). The tokens a lane has before the others
// start (its head, at the end of the row) and after they stop (its tail) are walked one row at a time.
#pragma once

#include <cstdint>
#include <cstring>

#include "gae_tile.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define RLKERNELS_GAE_SSE 1
#else
#define RLKERNELS_GAE_SSE 0
#endif

namespace rlkernels {

// One row's GAE over tokens [t_lo, t_hi), last token first, carrying the value and advantage of the row's next
// valid token. r, v, m, a_out, r_out point at the row's token 0 (unit token stride).
inline void gae_row_range(const float* r, const float* v, const bool* m, float* a_out, float* r_out, int64_t t_lo,
                          int64_t t_hi, float gamma, float gl, float& next_value, float& next_adv) {
  for (int64_t t = t_hi - 1; t >= t_lo; --t) {
    const float a = gae_step(r[t], v[t], m[t], gamma, gl, next_value, next_adv);
    a_out[t] = a;
    r_out[t] = a + v[t];
  }
}

#if RLKERNELS_GAE_SSE
// Rows b0..b0+3 of GAE over T tokens. Row b of rewards/values/mask starts at r + b·rs0 (elements; likewise vs0,
// ms0), row b of the outputs at a_out + b·T. Lane i runs `skew` · i tokens behind lane 0.
inline void gae_tile4_sse(const float* r, const float* v, const bool* m, float* a_out, float* r_out, int64_t b0,
                          int64_t T, int64_t rs0, int64_t vs0, int64_t ms0, float gamma, float gl, int64_t skew) {
  const float* rr[4];
  const float* vr[4];
  const bool* mr[4];
  float* ar[4];
  float* orow[4];
  for (int i = 0; i < 4; ++i) {
    rr[i] = r + (b0 + i) * rs0;
    vr[i] = v + (b0 + i) * vs0;
    mr[i] = m + (b0 + i) * ms0;
    ar[i] = a_out + (b0 + i) * T;
    orow[i] = r_out + (b0 + i) * T;
  }
  // Vector step j covers tokens [end_i - 4(j+1), end_i - 4j) of row i, end_i = top - skew·i.
  const int64_t top = T - T % 4;
  const int64_t steps = top >= 4 + 3 * skew ? (top - 3 * skew) / 4 : 0;
  alignas(16) float next_value[4] = {0.f, 0.f, 0.f, 0.f}, next_adv[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; i < 4; ++i) {  // heads (the whole row when there are no vector steps)
    const int64_t end = steps ? top - skew * i : 0;
    gae_row_range(rr[i], vr[i], mr[i], ar[i], orow[i], end, T, gamma, gl, next_value[i], next_adv[i]);
  }
  if (steps == 0) return;
  __m128 nv = _mm_load_ps(next_value), na = _mm_load_ps(next_adv);  // [4 rows]
  const __m128 vgamma = _mm_set1_ps(gamma), vgl = _mm_set1_ps(gl);
  const __m128i zero = _mm_setzero_si128(), all_ones = _mm_set1_epi32(-1);
  for (int64_t j = 0; j < steps; ++j) {
    int64_t lo[4];  // the first token of this step, per row
    for (int i = 0; i < 4; ++i) lo[i] = top - skew * i - 4 * (j + 1);
    // [4 rows] of 4 tokens each, transposed into [4 tokens] of 4 rows each
    __m128 r0 = _mm_loadu_ps(rr[0] + lo[0]), r1 = _mm_loadu_ps(rr[1] + lo[1]);
    __m128 r2 = _mm_loadu_ps(rr[2] + lo[2]), r3 = _mm_loadu_ps(rr[3] + lo[3]);
    __m128 v0 = _mm_loadu_ps(vr[0] + lo[0]), v1 = _mm_loadu_ps(vr[1] + lo[1]);
    __m128 v2 = _mm_loadu_ps(vr[2] + lo[2]), v3 = _mm_loadu_ps(vr[3] + lo[3]);
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
    _MM_TRANSPOSE4_PS(v0, v1, v2, v3);
    // the mask: lane i holds row i's 4 bools (byte k = token k); torch's bools are 0 or 1
    int32_t mask_words[4];
    for (int i = 0; i < 4; ++i) std::memcpy(&mask_words[i], mr[i] + lo[i], 4);
    const __m128i mask_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mask_words));
    const __m128 rt[4] = {r0, r1, r2, r3}, vt[4] = {v0, v1, v2, v3};
    __m128 adv[4], ret[4];  // [4 tokens] of 4 rows
    for (int k = 3; k >= 0; --k) {
      const __m128i byte_k = _mm_and_si128(mask_bytes, _mm_set1_epi32(static_cast<int32_t>(0xffu << (8 * k))));
      const __m128 valid = _mm_castsi128_ps(_mm_xor_si128(_mm_cmpeq_epi32(byte_k, zero), all_ones));
      const __m128 step = _mm_add_ps(_mm_sub_ps(_mm_add_ps(rt[k], _mm_mul_ps(vgamma, nv)), vt[k]), _mm_mul_ps(vgl, na));
      const __m128 a = _mm_and_ps(valid, step);  // 0 where masked
      nv = _mm_or_ps(_mm_and_ps(valid, vt[k]), _mm_andnot_ps(valid, nv));
      na = _mm_or_ps(a, _mm_andnot_ps(valid, na));
      adv[k] = a;
      ret[k] = _mm_add_ps(a, vt[k]);
    }
    _MM_TRANSPOSE4_PS(adv[0], adv[1], adv[2], adv[3]);
    _MM_TRANSPOSE4_PS(ret[0], ret[1], ret[2], ret[3]);
    for (int i = 0; i < 4; ++i) {
      _mm_storeu_ps(ar[i] + lo[i], adv[i]);
      _mm_storeu_ps(orow[i] + lo[i], ret[i]);
    }
  }
  _mm_store_ps(next_value, nv);
  _mm_store_ps(next_adv, na);
  for (int i = 0; i < 4; ++i) {  // tails
    const int64_t rest = top - skew * i - 4 * steps;
    gae_row_range(rr[i], vr[i], mr[i], ar[i], orow[i], 0, rest, gamma, gl, next_value[i], next_adv[i]);
  }
}
#endif

}  // namespace rlkernels
