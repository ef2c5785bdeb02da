// Runs csrc/group_segment_kernel.h's kernel, launched by its own plan, under the warp emulator:
//   group_segment_emulated G group_size mode eps offset < scores (N = G * group_size float32) > outputs
// `offset` places the scores that many floats into their allocation (1: misaligned, so the plan refuses the
// 16-byte path). Prints the plan (usable vec width blocks) on stderr. Used by tests/test_advantages.py.
#include <cstdio>
#include <cstdlib>

#include "cuda_warp_emulator.h"
#include "group_segment_kernel.h"

int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const int64_t G = std::atoll(argv[1]), group_size = std::atoll(argv[2]);
  const int mode = std::atoi(argv[3]), offset = std::atoi(argv[5]);
  const float eps = static_cast<float>(std::atof(argv[4]));
  const int64_t N = G * group_size;
  std::vector<float> scores(offset + N), out(offset + N, -7.f);  // exactly the memory a launch may touch
  if (std::fread(scores.data() + offset, sizeof(float), N, stdin) != static_cast<size_t>(N)) return 3;
  const SegmentPlan plan = plan_group_segments(G, group_size, scores.data() + offset, out.data() + offset);
  std::fprintf(stderr, "%d %d %d %u\n", plan.usable, plan.vec, plan.width, plan.blocks);
  if (!plan.usable) return 4;
  auto kernel = plan.vec ? group_segment_kernel<true> : group_segment_kernel<false>;
  emulated::launch(plan.blocks, kSegmentThreads, kernel, static_cast<const float*>(scores.data() + offset),
                   out.data() + offset, G, static_cast<int>(group_size), plan.width,
                   group_constants(mode, group_size, eps));
  std::fwrite(out.data() + offset, sizeof(float), N, stdout);
  return 0;
}
