// GAE's CPU row loop, standalone (issue 14): why csrc/advantages.cpp skews the rows of a tile.
//   g++ -O3 -o /tmp/cpu_gae_rows bench/cpu_gae_rows.cpp && /tmp/cpu_gae_rows
// One thread, B=64 rows of T=2048 float32 tokens, right-padded masks; per variant the best of 300 runs and whether
// its outputs equal the first variant's bit for bit. A variant walks R rows side by side, row i running S·i tokens
// behind row 0 (S = 0: all rows at the same token, the kernel before the skew; R = 4, S = 16: the kernel now).
// The five arrays come from malloc, so their bases agree modulo 4 KiB, and rows T·4 bytes apart share L1 sets.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

// rows [b0, b0 + R) of GAE, the recursion of csrc/advantages.cpp's gae_row_tile (unit time stride)
template <int64_t R, int64_t S>
void rows(const float* r, const float* v, const bool* m, float* a_out, float* r_out, int64_t b0, int64_t T,
          float gamma, float gl) {
  float next_value[R], next_adv[R];
  for (int64_t i = 0; i < R; ++i) next_value[i] = next_adv[i] = 0.f;
  for (int64_t s = T - 1 + (R - 1) * S; s >= 0; --s) {
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = s - i * S;
      if (t < 0 || t >= T) continue;
      const int64_t k = (b0 + i) * T + t;
      const float vt = v[k], rt = r[k];
      const bool valid = m[k];
      const float step = (rt + gamma * next_value[i] - vt) + gl * next_adv[i];
      const float a = valid ? step : 0.f;
      next_value[i] = valid ? vt : next_value[i];
      next_adv[i] = valid ? step : next_adv[i];
      a_out[k] = a;
      r_out[k] = a + vt;
    }
  }
}

int main() {
  const int64_t B = 64, T = 2048;
  std::vector<float> r(B * T), v(B * T), a0(B * T), o0(B * T), a(B * T), o(B * T);
  std::vector<char> mc(B * T);
  std::mt19937 g(0);
  std::normal_distribution<float> n;
  for (auto& x : r) x = n(g);
  for (auto& x : v) x = n(g);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = T / 2 + g() % (T / 2);
    for (int64_t t = 0; t < T; ++t) mc[b * T + t] = t < L;
  }
  const bool* m = reinterpret_cast<const bool*>(mc.data());
  bool first = true;
  auto bench = [&](const char* name, auto tile, int64_t R) {
    auto run = [&] { for (int64_t b0 = 0; b0 < B; b0 += R) tile(r.data(), v.data(), m, a.data(), o.data(), b0, T, 0.99f, 0.99f * 0.95f); };
    run();
    double best = 1e9;
    for (int k = 0; k < 300; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    if (first) a0 = a, o0 = o, first = false;
    const bool same = std::memcmp(a.data(), a0.data(), 4 * B * T) == 0 && std::memcmp(o.data(), o0.data(), 4 * B * T) == 0;
    std::printf("%-24s %8.1f us  %.2f ns/token  %s\n", name, best, best * 1e3 / (B * T), same ? "same bits" : "DIFFERENT");
  };
  bench("4 rows, no skew", rows<4, 0>, 4);
  bench("4 rows, skew 16 (now)", rows<4, 16>, 4);
  bench("2 rows, no skew", rows<2, 0>, 2);
  bench("8 rows, no skew", rows<8, 0>, 8);
  bench("8 rows, skew 16", rows<8, 16>, 8);
  bench("1 row", rows<1, 0>, 1);
}
