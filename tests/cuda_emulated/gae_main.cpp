// Runs csrc/gae_kernel.h's kernel (float32 inputs, launched by gae_passes) under the warp emulator:
//   gae_emulated B T gamma lam offset < rewards (B*T float32) values (B*T float32) mask (B*T bytes)
//     > advantages (B*T float32) returns (B*T float32)
// `offset`: every array starts that many elements into its allocation (1: misaligned, the scalar path). Prints 1
// on stderr where the launch took the 16-byte path. Used by tests/test_advantages.py.
#include <cstdio>
#include <cstdlib>

#include "cuda_warp_emulator.h"

inline float to_float(float x) { return x; }
#include "vector_loads.h"
#include "gae_kernel.h"

int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const int64_t B = std::atoll(argv[1]), T_len = std::atoll(argv[2]);
  const float gamma = static_cast<float>(std::atof(argv[3])), lam = static_cast<float>(std::atof(argv[4]));
  const int offset = std::atoi(argv[5]);
  const int64_t N = B * T_len;
  std::vector<float> r(offset + N), v(offset + N), adv(offset + N, -7.f), ret(offset + N, -7.f);
  std::vector<uint8_t> m(offset + N);
  if (std::fread(r.data() + offset, sizeof(float), N, stdin) != static_cast<size_t>(N)) return 3;
  if (std::fread(v.data() + offset, sizeof(float), N, stdin) != static_cast<size_t>(N)) return 3;
  if (std::fread(m.data() + offset, 1, N, stdin) != static_cast<size_t>(N)) return 3;
  bool vec = false;
  gae_passes(static_cast<const float*>(r.data() + offset), static_cast<const float*>(v.data() + offset),
             static_cast<const uint8_t*>(m.data() + offset), adv.data() + offset, ret.data() + offset, B, T_len, gamma,
             lam, [&vec](auto kernel, int64_t blocks, auto... args) {
               vec = kernel == gae_kernel<float, true>;
               emulated::launch(static_cast<unsigned>(blocks), kThreads, kernel, args...);
             });
  std::fprintf(stderr, "%d\n", vec ? 1 : 0);
  std::fwrite(adv.data() + offset, sizeof(float), N, stdout);
  std::fwrite(ret.data() + offset, sizeof(float), N, stdout);
  return 0;
}
