// Runs csrc/whiten_kernels.h's three passes (whiten_passes, whiten_parts blocks) under the warp emulator:
//   whiten_emulated N shift_mean eps offset [resident] < x (N float32) mask (N bytes) > outputs (N float32)
// `offset`: x, mask and the outputs start that many elements into their allocations; `resident`: the blocks one
// wave holds (the extension asks the occupancy calculator; default: no limit below the cap). Prints the blocks
// used on stderr. Used by tests/test_advantages.py.
#include <cstdio>
#include <cstdlib>

#include "cuda_warp_emulator.h"

// csrc/advantages_cuda.h caps the blocks at 1024; 8 here, so that the tests reach the cap, and grid-stride loops
// of many strides per thread, at sizes the emulator runs in seconds (a block is 256 host threads)
constexpr int kMaxWhitenParts = 8;
inline float to_float(float x) { return x; }
#include "whiten_kernels.h"

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) return 2;
  const int64_t N = std::atoll(argv[1]);
  const bool shift_mean = std::atoi(argv[2]) != 0;
  const float eps = static_cast<float>(std::atof(argv[3]));
  const int offset = std::atoi(argv[4]);
  std::vector<float> x(offset + N), out(offset + N, -7.f);  // exactly the memory the passes may touch
  std::vector<uint8_t> mask(offset + N);
  if (std::fread(x.data() + offset, sizeof(float), N, stdin) != static_cast<size_t>(N)) return 3;
  if (std::fread(mask.data() + offset, 1, N, stdin) != static_cast<size_t>(N)) return 3;
  const int parts = argc == 6 ? whiten_parts(N, std::atoi(argv[5])) : whiten_parts(N);
  std::vector<float> part(4 * parts + 5);
  whiten_passes(static_cast<const float*>(x.data() + offset), static_cast<const uint8_t*>(mask.data() + offset),
                out.data() + offset, part.data(), parts, N, eps, shift_mean,
                [](auto kernel, int blocks, auto... args) { emulated::launch(blocks, kWhitenThreads, kernel, args...); });
  std::fprintf(stderr, "%d\n", parts);
  std::fwrite(out.data() + offset, sizeof(float), N, stdout);
  return 0;
}
