// GAE's CPU recursion, scalar: one token's step, and a tile of R rows walked side by side. Free of ATen (the
// element type is a template parameter) so that csrc/gae_tile_sse.h reuses the step and bench/cpu_gae_rows.cpp
// times the very loop csrc/advantages.cpp runs.
//
// On a CPU the sequential loop is the work-optimal scan; parallelism comes from the rows. One row alone is
// latency-bound (each token's advantage waits on the previous one's multiply-add), so a tile walks R rows side by
// side: R independent dependency chains per time step, written without branches (a select per state), which the
// core overlaps.
#pragma once

#include <cstdint>

namespace rlkernels {

// One token of the reverse recursion, last token first: delta = r + gamma·V_next - v, A = delta + gamma·lambda·A_next
// (gl = gamma·lambda). A masked token is transparent: it returns 0 and leaves the carried value and advantage of the
// row's next valid token as they were. The SSE tile does the same operations in the same order, lane-wise.
inline float gae_step(float rt, float vt, bool valid, float gamma, float gl, float& next_value, float& next_adv) {
  const float step = (rt + gamma * next_value - vt) + gl * next_adv;
  next_value = valid ? vt : next_value;
  next_adv = valid ? step : next_adv;
  return valid ? step : 0.f;
}

// Rows b0..b0+R-1 of GAE over T tokens, inputs read through their strides (elements), outputs [B, T] contiguous
// float32. Row i runs skew·i tokens behind row 0 (gae_row_skew.h: rows that would share an L1 set are spread).
template <typename scalar_t, int64_t R>
void gae_row_tile(const scalar_t* r, const scalar_t* v, const bool* m, float* a_out, float* r_out, int64_t b0, int64_t T,
                  int64_t rs0, int64_t rs1, int64_t vs0, int64_t vs1, int64_t ms0, int64_t ms1, float gamma, float gl,
                  int64_t skew) {
  float next_value[R], next_adv[R];  // the value and advantage of each row's next valid token (0 past the end)
  for (int64_t i = 0; i < R; ++i) next_value[i] = next_adv[i] = 0.f;
  for (int64_t s = T - 1 + (R - 1) * skew; s >= 0; --s) {
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = s - i * skew;
      if (t < 0 || t >= T) continue;
      const int64_t b = b0 + i;
      const float vt = static_cast<float>(v[b * vs0 + t * vs1]);
      const float rt = static_cast<float>(r[b * rs0 + t * rs1]);
      const float a = gae_step(rt, vt, m[b * ms0 + t * ms1], gamma, gl, next_value[i], next_adv[i]);
      a_out[b * T + t] = a;
      r_out[b * T + t] = a + vt;
    }
  }
}

}  // namespace rlkernels
