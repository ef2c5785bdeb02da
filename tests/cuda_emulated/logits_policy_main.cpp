// Runs csrc/logits_policy_kernel.h (logits_policy_loss's CUDA kernel) under the warp emulator, launched as
// logits_policy_cuda.cu launches it (a cluster of plan.ranks blocks per row):
//   logits_policy_emulated DTYPE O I V stride_outer stride_inner storage T max_chunk_bytes inv_temp ignore_index
//       ratio_min ratio_max dual_clip kl_coef entropy_coef on_policy has_ref kl_estimator has_entropy entropy_grad
//       write_grad
//     < logits storage (`storage` elements of DTYPE: f32, bf16 or f16, as their bytes; row (o, i) at o·stride_outer +
//       i·stride_inner) labels (N int64) old adv ref (N float32 each) mask (N bytes) weight (N / T float32)
//     > logp entropy (N float32 each) part (N·8 float32) d_logits (N·V of DTYPE, when write_grad)
// max_chunk_bytes: the plan's limit on a block's chunk (the extension's is kLogitsMaxChunkBytes), so that small rows
// take clusters of several blocks. Prints the plan's ranks and chunk on stderr (ranks 0: refused, nothing runs).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_warp_emulator.h"

inline float to_float(float x) { return x; }
#include "vector_loads.h"
#include "logits_policy_kernel.h"

template <typename T>
bool read(std::vector<T>& v, size_t n) {
  v.resize(n);
  return std::fread(v.data(), sizeof(T), n, stdin) == n;
}

template <typename T>
int run(char** argv) {
  const int64_t O = std::atoll(argv[2]), I = std::atoll(argv[3]), V = std::atoll(argv[4]);
  const int64_t stride_outer = std::atoll(argv[5]), stride_inner = std::atoll(argv[6]), storage = std::atoll(argv[7]);
  const int64_t T_len = std::atoll(argv[8]);
  const int max_chunk = std::atoi(argv[9]);
  const int64_t N = O * I;
  std::vector<T> logits;
  std::vector<int64_t> labels;
  std::vector<float> old_logp, adv, ref, weight;
  std::vector<uint8_t> mask;
  if (!read(logits, storage) || !read(labels, N) || !read(old_logp, N) || !read(adv, N) || !read(ref, N) ||
      !read(mask, N) || !read(weight, N / T_len))
    return 3;
  const LogitsPlan plan = logits_policy_plan(sizeof(T), V, max_chunk);
  std::fprintf(stderr, "%d %d\n", plan.ranks, plan.chunk);
  if (plan.ranks == 0) return 0;
  std::vector<float> logp(N, -7.f), entropy(N, -7.f), part(N * kPolicySlots, -7.f);
  const bool write_grad = std::atoi(argv[22]) != 0;
  std::vector<T> d_logits(write_grad ? N * V : 1);
  for (auto& g : d_logits) from_float(-7.f, &g);
  LogitsPolicyArgs<T> a;
  a.logits = logits.data(), a.labels = labels.data(), a.old_logp = old_logp.data(), a.adv = adv.data();
  a.ref_logp = ref.data(), a.mask = mask.data(), a.weight = weight.data(), a.logp = logp.data();
  a.entropy = entropy.data(), a.part = part.data(), a.d_logits = d_logits.data();
  a.stride_outer = stride_outer, a.stride_inner = stride_inner, a.inner = I, a.T_len = T_len, a.V = V;
  a.ignore_index = std::atoll(argv[11]), a.chunk = plan.chunk, a.ranks = plan.ranks;
  a.inv_temp = std::strtof(argv[10], nullptr), a.ratio_min = std::strtof(argv[12], nullptr);
  a.ratio_max = std::strtof(argv[13], nullptr), a.dual_clip = std::strtof(argv[14], nullptr);
  a.kl_coef = std::strtof(argv[15], nullptr), a.entropy_coef = std::strtof(argv[16], nullptr);
  a.on_policy = std::atoi(argv[17]) != 0, a.has_ref = std::atoi(argv[18]) != 0, a.kl_estimator = std::atoi(argv[19]);
  a.has_entropy = std::atoi(argv[20]) != 0, a.entropy_grad = std::atoi(argv[21]) != 0, a.write_grad = write_grad;
  emulated::launch_cluster(static_cast<unsigned>(N * plan.ranks), plan.ranks, kLogitsThreads, plan.shared_bytes,
                           logits_policy_kernel<T>, a);
  std::fwrite(logp.data(), sizeof(float), N, stdout);
  std::fwrite(entropy.data(), sizeof(float), N, stdout);
  std::fwrite(part.data(), sizeof(float), N * kPolicySlots, stdout);
  if (write_grad) std::fwrite(d_logits.data(), sizeof(T), N * V, stdout);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 23) return 2;
  if (std::strcmp(argv[1], "f32") == 0) return run<float>(argv);
  if (std::strcmp(argv[1], "bf16") == 0) return run<__nv_bfloat16>(argv);
  if (std::strcmp(argv[1], "f16") == 0) return run<__half>(argv);
  return 2;
}
