// Runs csrc/whiten_kernels.h under the warp emulator as advantages_cuda.cu's whiten_launch does (whiten_parts blocks):
// the fused cooperative kernel where it takes the memory, else the three passes:
//   whiten_emulated DTYPE N shift_mean eps x_offset mask_offset resident fused
//     < x (N elements of DTYPE: f32, bf16 or f16, as their bytes) mask (N bytes) > outputs (N float32)
// `x_offset` / `mask_offset`: x (and the outputs) and the mask start that many elements into their allocations
// (alike: the 16-byte path after a head of elements; different: x element by element); `resident`: the blocks one
// wave holds (the extension asks the occupancy calculator; -1: no limit below the cap); `fused`: 0 takes the passes
// (RLKERNELS_WHITEN=passes). Prints the blocks, the statistics kernel's variant (1: 16-byte loads of x; -1: the
// passes did not run), its head and whether the fused kernel ran (1) on stderr. Used by tests/test_advantages.py.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>

#include "cuda_warp_emulator.h"

// csrc/advantages_cuda.h caps the blocks at 1024; 8 here, so that the tests reach the cap, and grid-stride loops
// of many strides per thread, at sizes the emulator runs in seconds (a block is 256 host threads)
constexpr int kMaxWhitenParts = 8;
inline float to_float(float x) { return x; }
#include "vector_loads.h"
#include "whiten_kernels.h"

template <typename T>
int run(int64_t N, bool shift_mean, float eps, int x_offset, int mask_offset, int resident, bool fused) {
  // 16-byte aligned allocations of exactly the memory the passes may touch (AddressSanitizer sees any access past
  // it), so that the offsets alone decide the alignment the kernels see
  auto alloc = [](size_t bytes) {
    return std::unique_ptr<void, void (*)(void*)>(::operator new(bytes, std::align_val_t{16}),
                                                  [](void* p) { ::operator delete(p, std::align_val_t{16}); });
  };
  auto x_store = alloc(sizeof(T) * (x_offset + N)), mask_store = alloc(mask_offset + N),
       out_store = alloc(sizeof(float) * (x_offset + N));
  T* x = static_cast<T*>(x_store.get()) + x_offset;
  uint8_t* mask = static_cast<uint8_t*>(mask_store.get()) + mask_offset;
  float* out = static_cast<float*>(out_store.get()) + x_offset;
  for (int64_t i = 0; i < N; ++i) out[i] = -7.f;
  if (std::fread(x, sizeof(T), N, stdin) != static_cast<size_t>(N)) return 3;
  if (std::fread(mask, 1, N, stdin) != static_cast<size_t>(N)) return 3;
  const int parts = resident >= 0 ? whiten_parts(N, resident) : whiten_parts(N);
  std::vector<float> part(4 * parts + 5);
  int vec = -1;
  const bool ran_fused =
      fused && whiten_fused(static_cast<const T*>(x), static_cast<const uint8_t*>(mask), out, part.data(), parts, N,
                            eps, shift_mean, [](auto kernel, int blocks, auto... args) {
                              return emulated::launch_cooperative(blocks, kWhitenThreads, kernel, args...);
                            });
  if (!ran_fused)
    whiten_passes(static_cast<const T*>(x), static_cast<const uint8_t*>(mask), out, part.data(), parts, N, eps,
                  shift_mean, [&vec](auto kernel, int blocks, auto... args) {
                    if constexpr (std::is_same_v<decltype(kernel), decltype(&whiten_partial_kernel<T, true>)>)
                      if (kernel == &whiten_partial_kernel<T, true> || kernel == &whiten_partial_kernel<T, false>)
                        vec = kernel == &whiten_partial_kernel<T, true>;
                    emulated::launch(blocks, kWhitenThreads, kernel, args...);
                  });
  std::fprintf(stderr, "%d %d %d %d\n", parts, vec, whiten_head(static_cast<const uint8_t*>(mask)),
               static_cast<int>(ran_fused));
  std::fwrite(out, sizeof(float), N, stdout);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 9) return 2;
  const char* dtype = argv[1];
  const int64_t N = std::atoll(argv[2]);
  const bool shift_mean = std::atoi(argv[3]) != 0;
  const float eps = static_cast<float>(std::atof(argv[4]));
  const int x_offset = std::atoi(argv[5]), mask_offset = std::atoi(argv[6]);
  const int resident = std::atoi(argv[7]);
  const bool fused = std::atoi(argv[8]) != 0;
  if (std::strcmp(dtype, "f32") == 0) return run<float>(N, shift_mean, eps, x_offset, mask_offset, resident, fused);
  if (std::strcmp(dtype, "bf16") == 0)
    return run<__nv_bfloat16>(N, shift_mean, eps, x_offset, mask_offset, resident, fused);
  if (std::strcmp(dtype, "f16") == 0) return run<__half>(N, shift_mean, eps, x_offset, mask_offset, resident, fused);
  return 2;
}
