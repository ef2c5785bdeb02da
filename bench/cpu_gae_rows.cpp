// GAE's CPU row loop, standalone (issue 14): why csrc/advantages.cpp skews the rows of a tile.
//   g++ -O3 -o /tmp/cpu_gae_rows bench/cpu_gae_rows.cpp && /tmp/cpu_gae_rows
// One thread, B=64 rows of T=2048 float32 tokens, right-padded masks; each variant's best of 300 runs, and whether
// its outputs equal v0's bit for bit. v0 is the kernel as it was (4 rows side by side at the same token); v1 the
// same with hoisted row pointers (2, 4, 8 rows); "skew" runs row i kSkew·i tokens behind row 0 (the kernel now);
// v2 one row at a time. The five arrays come from malloc, so their bases agree modulo 4 KiB and rows T·4 bytes
// apart share L1 sets: unskewed tiles of 4 or 8 rows thrash, skewed ones do not.
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cstring>
using namespace std;
constexpr int64_t kRows = 4;
// variant 0: current
template <int64_t R>
void tile0(const float* r, const float* v, const bool* m, float* a_out, float* r_out, int64_t b0, int64_t T,
           int64_t rs0, int64_t rs1, int64_t vs0, int64_t vs1, int64_t ms0, int64_t ms1, float gamma, float gl) {
  float next_value[R], next_adv[R];
  for (int64_t i = 0; i < R; ++i) next_value[i] = next_adv[i] = 0.f;
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int64_t i = 0; i < R; ++i) {
      const int64_t b = b0 + i;
      const float vt = v[b * vs0 + t * vs1];
      const float rt = r[b * rs0 + t * rs1];
      const bool valid = m[b * ms0 + t * ms1];
      const float step = (rt + gamma * next_value[i] - vt) + gl * next_adv[i];
      const float a = valid ? step : 0.f;
      next_value[i] = valid ? vt : next_value[i];
      next_adv[i] = valid ? step : next_adv[i];
      a_out[b * T + t] = a;
      r_out[b * T + t] = a + vt;
    }
  }
}
// variant 1: row pointers hoisted, restrict, unit time stride specialised
template <int64_t R>
void tile1(const float* __restrict r, const float* __restrict v, const bool* __restrict m, float* __restrict a_out,
           float* __restrict r_out, int64_t b0, int64_t T, int64_t rs0, int64_t vs0, int64_t ms0, float gamma, float gl) {
  const float* rp[R]; const float* vp[R]; const bool* mp[R]; float* ap[R]; float* op[R];
  float nv[R], na[R];
  for (int64_t i = 0; i < R; ++i) {
    rp[i] = r + (b0 + i) * rs0; vp[i] = v + (b0 + i) * vs0; mp[i] = m + (b0 + i) * ms0;
    ap[i] = a_out + (b0 + i) * T; op[i] = r_out + (b0 + i) * T; nv[i] = na[i] = 0.f;
  }
  for (int64_t t = T - 1; t >= 0; --t) {
#pragma GCC unroll 8
    for (int64_t i = 0; i < R; ++i) {
      const float vt = vp[i][t], rt = rp[i][t];
      const bool valid = mp[i][t];
      const float step = (rt + gamma * nv[i] - vt) + gl * na[i];
      const float a = valid ? step : 0.f;
      nv[i] = valid ? vt : nv[i];
      na[i] = valid ? step : na[i];
      ap[i][t] = a;
      op[i][t] = a + vt;
    }
  }
}
template <int64_t R, int64_t S>
void tile3(const float* __restrict r, const float* __restrict v, const bool* __restrict m, float* __restrict a_out,
           float* __restrict r_out, int64_t b0, int64_t T, int64_t rs0, int64_t vs0, int64_t ms0, float gamma, float gl) {
  float nv[R], na[R];
  for (int64_t i = 0; i < R; ++i) nv[i] = na[i] = 0.f;
  for (int64_t s = T - 1 + (R - 1) * S; s >= 0; --s) {
#pragma GCC unroll 8
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = s - i * S;
      if (t < 0 || t >= T) continue;
      const int64_t b = b0 + i;
      const float vt = v[b * vs0 + t], rt = r[b * rs0 + t];
      const bool valid = m[b * ms0 + t];
      const float step = (rt + gamma * nv[i] - vt) + gl * na[i];
      const float a = valid ? step : 0.f;
      nv[i] = valid ? vt : nv[i];
      na[i] = valid ? step : na[i];
      a_out[b * T + t] = a;
      r_out[b * T + t] = a + vt;
    }
  }
}
// variant 2: one row at a time, blocks of 64 tokens: delta pass (vectorizable over time) then the scan
void row2(const float* __restrict r, const float* __restrict v, const bool* __restrict m, float* __restrict a,
          float* __restrict o, int64_t T, float gamma, float gl) {
  // assume the next valid value: for a right-padded mask, nv = v[t+1] when valid[t+1], else carried
  float nv = 0.f, na = 0.f;
  constexpr int64_t K = 64;
  float d[K];
  for (int64_t hi = T; hi > 0; hi -= K) {
    const int64_t lo = hi > K ? hi - K : 0;
    // first pass: delta with the next valid value (needs carry: do scalar)
    for (int64_t t = hi - 1; t >= lo; --t) {
      const bool valid = m[t];
      const float dt = r[t] + gamma * nv - v[t];
      d[t - lo] = dt;
      nv = valid ? v[t] : nv;
    }
    for (int64_t t = hi - 1; t >= lo; --t) {
      const bool valid = m[t];
      const float step = d[t - lo] + gl * na;
      const float aa = valid ? step : 0.f;
      na = valid ? step : na;
      a[t] = aa;
      o[t] = aa + v[t];
    }
  }
}
int main() {
  const int64_t B = 64, T = 2048;
  std::vector<float> r(B * T), v(B * T), a(B * T), o(B * T), a2(B * T), o2(B * T);
  std::vector<char> mc(B * T);
  std::mt19937 g(0); std::normal_distribution<float> n;
  for (auto& x : r) x = n(g);
  for (auto& x : v) x = n(g);
  for (int64_t b = 0; b < B; ++b) { int64_t L = T / 2 + g() % (T / 2); for (int64_t t = 0; t < T; ++t) mc[b * T + t] = t < L; }
  const bool* m = reinterpret_cast<const bool*>(mc.data());
  auto bench = [&](const char* name, auto f) {
    f(); double best = 1e9;
    for (int k = 0; k < 300; ++k) { auto s = std::chrono::steady_clock::now(); f(); auto e = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double, std::micro>(e - s).count()); }
    printf("%-10s %8.1f us  %.2f ns/token\n", name, best, best * 1e3 / (B * T));
  };
  bench("v0", [&] { for (int64_t b0 = 0; b0 < B; b0 += kRows) tile0<kRows>(r.data(), v.data(), m, a.data(), o.data(), b0, T, T, 1, T, 1, T, 1, 0.99f, 0.99f * 0.95f); });
  bench("v1 R4", [&] { for (int64_t b0 = 0; b0 < B; b0 += 4) tile1<4>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  printf("v1 equal: %d\n", memcmp(a.data(), a2.data(), 4 * B * T) == 0 && memcmp(o.data(), o2.data(), 4 * B * T) == 0);
  bench("v1 R8", [&] { for (int64_t b0 = 0; b0 < B; b0 += 8) tile1<8>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  bench("v1 R2", [&] { for (int64_t b0 = 0; b0 < B; b0 += 2) tile1<2>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  bench("skew R4 S16", [&] { for (int64_t b0 = 0; b0 < B; b0 += 4) tile3<4, 16>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  printf("skew equal: %d\n", memcmp(a.data(), a2.data(), 4 * B * T) == 0 && memcmp(o.data(), o2.data(), 4 * B * T) == 0);
  bench("skew R4 S40", [&] { for (int64_t b0 = 0; b0 < B; b0 += 4) tile3<4, 40>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  bench("skew R8 S16", [&] { for (int64_t b0 = 0; b0 < B; b0 += 8) tile3<8, 16>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  bench("skew R8 S24", [&] { for (int64_t b0 = 0; b0 < B; b0 += 8) tile3<8, 24>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  bench("skew R2 S16", [&] { for (int64_t b0 = 0; b0 < B; b0 += 2) tile3<2, 16>(r.data(), v.data(), m, a2.data(), o2.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f); });
  bench("v2 row", [&] { for (int64_t b = 0; b < B; ++b) row2(r.data() + b * T, v.data() + b * T, m + b * T, a2.data() + b * T, o2.data() + b * T, T, 0.99f, 0.99f * 0.95f); });
  printf("v2 equal: %d\n", memcmp(a.data(), a2.data(), 4 * B * T) == 0 && memcmp(o.data(), o2.data(), 4 * B * T) == 0);
}
