// GAE's CPU row loop, standalone (issue 14): how csrc/advantages.cpp skews the rows of a tile, and why; and the
// SSE tile it runs for float32 rows. Both tiles are the extension's own code, included here (csrc/gae_tile.h's
// scalar gae_row_tile, given strides at run time as the extension does; csrc/gae_tile_sse.h).
//   g++ -O3 -o /tmp/cpu_gae_rows bench/cpu_gae_rows.cpp && /tmp/cpu_gae_rows
// One thread, B=64 rows of T float32 tokens, right-padded masks; per T and skew rule the best of 100 runs (ns per
// token) and whether its outputs equal the unskewed walk's bit for bit. A tile walks R = 4 rows side by side, row
// i running S·i tokens behind row 0: "S=0" (all rows at the same token), "S=16" (the fixed skew of 2026-11-23),
// "rule" (csrc/gae_row_skew.h, included here: the extension's own rule, S printed); then the SSE tile with S=0
// and with the rule's S (both also checked bit for bit against the scalar walk). The five arrays come from
// malloc, so their bases agree modulo 4 KiB, as torch's page-aligned large tensors do.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../csrc/gae_row_skew.h"
#include "../csrc/gae_tile.h"
#include "../csrc/gae_tile_sse.h"

int main() {
  const int64_t B = 64;
  constexpr int64_t R = 4;
  for (int64_t T : {512, 528, 1024, 1040, 2040, 2048, 2056, 2064, 2112, 3000, 4096, 4112}) {
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
    // prints the best of 100 timed runs of `run` (ns per token) and whether its outputs equal the unskewed
    // scalar walk's (the first one timed, which keeps its outputs as the reference)
    auto bench = [&](auto run, bool reference) {
      run();
      double best = 1e9;
      for (int k = 0; k < 100; ++k) {
        const auto t0 = std::chrono::steady_clock::now();
        run();
        best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      if (reference) a0 = a, o0 = o;
      const bool same = std::memcmp(a.data(), a0.data(), 4 * B * T) == 0 && std::memcmp(o.data(), o0.data(), 4 * B * T) == 0;
      std::printf("  %5.2f%s", best * 1e3 / (B * T), same ? "" : " DIFFERENT");
    };
    auto scalar = [&](int64_t S) {
      return [&, S] {
        for (int64_t b0 = 0; b0 < B; b0 += R)
          rlkernels::gae_row_tile<float, R>(r.data(), v.data(), m, a.data(), o.data(), b0, T, T, 1, T, 1, T, 1, 0.99f,
                                            0.99f * 0.95f, S);
      };
    };
    auto sse = [&](int64_t S) {
      return [&, S] {
        for (int64_t b0 = 0; b0 < B; b0 += R)
          rlkernels::gae_tile4_sse(r.data(), v.data(), m, a.data(), o.data(), b0, T, T, T, T, 0.99f, 0.99f * 0.95f, S);
      };
    };
    const int64_t rule = rlkernels::gae_row_skew(T, 4 * T, 4, 4 * T, 4, R);
    std::printf("T=%5ld  ns/token:  S=0", static_cast<long>(T));
    bench(scalar(0), true);
    std::printf("   S=16");
    bench(scalar(16), false);
    std::printf("   rule (S=%2ld)", static_cast<long>(rule));
    bench(scalar(rule), false);
    std::printf("   sse S=0");
    bench(sse(0), false);
    std::printf("   sse rule");
    bench(sse(rule), false);
    std::printf("\n");
  }
}
