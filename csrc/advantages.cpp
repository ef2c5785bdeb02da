// CPU kernels of the advantage ops and their registration as torch.ops.rlkernels_csrc.*.
//
// Registered through TORCH_LIBRARY (no pybind11), so the library is loaded with
// torch.ops.load_library and dispatches by device: the CPU kernels live here,
// the CUDA kernels in advantages_cuda.cu, bound in advantages_cuda_binding.cpp.
//
// Semantics are those of rlkernels.reference (gae, group_advantages,
// masked_whiten); the Python wrapper validates arguments and converts dtypes:
//   rewards/values/x: float32, float16 or bfloat16, any strides (read via strides);
//   mask: bool; scores: float32; perm/starts: int64.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gae_row_skew.h"
#include "gae_tile.h"
#include "gae_tile_sse.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace rlkernels {
namespace {

// GAE: tiles of kRows rows walked side by side (gae_tile.h; the SSE tile for float32 rows, gae_tile_sse.h).
constexpr int64_t kRows = 4;

template <typename scalar_t>
void gae_rows(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask, at::Tensor& adv,
              at::Tensor& ret, float gamma, float lam) {
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const scalar_t* r = rewards.data_ptr<scalar_t>();
  const scalar_t* v = values.data_ptr<scalar_t>();
  const bool* m = mask.data_ptr<bool>();
  float* a_out = adv.data_ptr<float>();
  float* r_out = ret.data_ptr<float>();
  const int64_t rs0 = rewards.stride(0), rs1 = rewards.stride(1);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1);
  const int64_t ms0 = mask.stride(0), ms1 = mask.stride(1);
  const float gl = gamma * lam;
  const int64_t tiles = (B + kRows - 1) / kRows;
  const int64_t elem = static_cast<int64_t>(sizeof(scalar_t));
  const int64_t skew = gae_row_skew(T, rs0 * elem, rs1 * elem, vs0 * elem, vs1 * elem, kRows);
  // float32 with contiguous tokens: the SSE tile (gae_tile_sse.h; same bits, measured speed-up there)
  const bool sse = RLKERNELS_GAE_SSE && std::is_same<scalar_t, float>::value && rs1 == 1 && vs1 == 1 && ms1 == 1;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t b0 = tile * kRows;
      if (b0 + kRows <= B && sse) {
#if RLKERNELS_GAE_SSE
        static_assert(kRows == 4, "the SSE tile walks 4 rows");
        gae_tile4_sse(reinterpret_cast<const float*>(r), reinterpret_cast<const float*>(v), m, a_out, r_out, b0, T,
                      rs0, vs0, ms0, gamma, gl, skew);
#endif
      } else if (b0 + kRows <= B) {
        gae_row_tile<scalar_t, kRows>(r, v, m, a_out, r_out, b0, T, rs0, rs1, vs0, vs1, ms0, ms1, gamma, gl, skew);
      } else {
        for (int64_t b = b0; b < B; ++b)  // the last rows, one at a time
          gae_row_tile<scalar_t, 1>(r, v, m, a_out, r_out, b, T, rs0, rs1, vs0, vs1, ms0, ms1, gamma, gl, 0);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                                           double gamma, double lam) {
  TORCH_CHECK(rewards.dim() == 2 && values.sizes() == rewards.sizes() && mask.sizes() == rewards.sizes(),
              "rlkernels_csrc::gae: rewards, values and mask must be [B, T] of one shape");
  TORCH_CHECK(values.scalar_type() == rewards.scalar_type(), "rlkernels_csrc::gae: rewards and values must share a dtype");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "rlkernels_csrc::gae: mask must be bool");
  auto opts = rewards.options().dtype(at::kFloat);
  at::Tensor adv = at::empty(rewards.sizes(), opts);
  at::Tensor ret = at::empty(rewards.sizes(), opts);
  if (rewards.numel() == 0) return {adv, ret};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rewards.scalar_type(), "rlkernels_gae_cpu", [&] {
    gae_rows<scalar_t>(rewards, values, mask, adv, ret, static_cast<float>(gamma), static_cast<float>(lam));
  });
  return {adv, ret};
}

// mode: 0 grpo, 1 dr_grpo, 2 rloo. Group g holds the positions perm[starts[g] .. starts[g+1])
// (perm empty: positions starts[g] .. starts[g+1] themselves).
// group_size > 0: contiguous groups of that size (perm and starts empty); 0: group g is perm[starts[g]:starts[g+1]]
// (the identity where perm is empty).
at::Tensor group_advantages_cpu(const at::Tensor& scores, const at::Tensor& perm, const at::Tensor& starts,
                                int64_t group_size, int64_t mode, double eps) {
  TORCH_CHECK(scores.dim() == 1 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "rlkernels_csrc::group_advantages: scores must be contiguous float32 [N]");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && perm.scalar_type() == at::kLong &&
                  perm.is_contiguous(),
              "rlkernels_csrc::group_advantages: perm and starts must be contiguous int64");
  TORCH_CHECK(mode >= 0 && mode <= 2, "rlkernels_csrc::group_advantages: unknown mode ", mode);
  const int64_t N = scores.size(0);
  const bool has_perm = perm.numel() > 0;
  TORCH_CHECK(!has_perm || perm.numel() == N, "rlkernels_csrc::group_advantages: perm must be [N]");
  TORCH_CHECK(group_size >= 0 && (group_size == 0 || (!has_perm && N % group_size == 0)),
              "rlkernels_csrc::group_advantages: group_size must be 0 (groups from starts) or divide N without a perm");
  TORCH_CHECK(group_size > 0 || starts.numel() >= 1, "rlkernels_csrc::group_advantages: starts must be [G + 1]");
  const int64_t G = group_size > 0 ? N / group_size : starts.numel() - 1;
  at::Tensor out = at::empty_like(scores);
  const float* s = scores.data_ptr<float>();
  const int64_t* p = perm.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t lo = group_size > 0 ? g * group_size : st[g];
      const int64_t hi = group_size > 0 ? lo + group_size : st[g + 1], n = hi - lo;
      auto at_ = [&](int64_t i) { return has_perm ? p[i] : i; };
      if (n <= 0) continue;
      const float first = s[at_(lo)];
      // The sums in double: the kernel is memory bound, and it makes the
      // statistics exact to float32 rounding for any group size.
      double sum = 0.0;
      bool constant = true;
      for (int64_t i = lo; i < hi; ++i) {
        const float x = s[at_(i)];
        sum += x;
        constant = constant && (x == first);  // NaN != NaN: a group holding NaN is never "constant"
      }
      const double mean = sum / static_cast<double>(n);
      double ssq = 0.0;
      for (int64_t i = lo; i < hi; ++i) {
        const double d = s[at_(i)] - mean;
        ssq += d * d;
      }
      const bool zero = constant || n == 1;
      const double stdev = n > 1 ? std::sqrt(ssq / static_cast<double>(n - 1)) : 0.0;
      const double scale = mode == 0 ? 1.0 / (stdev + eps) : (mode == 1 ? 1.0 : static_cast<double>(n) / (n - 1));
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t j = at_(i);
        o[j] = zero ? 0.f : static_cast<float>((s[j] - mean) * scale);
      }
    }
  });
  return out;
}

struct Moments {
  double n = 0.0, mean = 0.0, m2 = 0.0;
  // Chan et al.'s pairwise merge of (count, mean, sum of squared deviations).
  void merge(const Moments& o) {
    if (o.n == 0.0) return;
    const double total = n + o.n;
    const double delta = o.mean - mean;
    mean += delta * (o.n / total);
    m2 += o.m2 + delta * delta * (n * o.n / total);
    n = total;
  }
};

template <typename scalar_t>
at::Tensor masked_whiten_impl(const at::Tensor& x, const at::Tensor& mask, bool shift_mean, double eps) {
  const int64_t N = x.numel();
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const bool* mp = mask.data_ptr<bool>();
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  std::vector<Moments> partial(static_cast<size_t>(chunks));
  // Per chunk a two-pass (exact) mean and M2, then Chan merges across chunks.
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kChunk, hi = std::min(N, lo + kChunk);
      double n = 0.0, sum = 0.0;
      for (int64_t i = lo; i < hi; ++i)
        if (mp[i]) {
          n += 1.0;
          sum += static_cast<double>(static_cast<float>(xp[i]));
        }
      Moments mo;
      if (n > 0) {
        mo.n = n;
        mo.mean = sum / n;
        double m2 = 0.0;
        for (int64_t i = lo; i < hi; ++i)
          if (mp[i]) {
            const double d = static_cast<double>(static_cast<float>(xp[i])) - mo.mean;
            m2 += d * d;
          }
        mo.m2 = m2;
      }
      partial[c] = mo;
    }
  });
  Moments total;
  for (const auto& p : partial) total.merge(p);
  const double var = total.n > 1.0 ? total.m2 / (total.n - 1.0) : 0.0;
  // The mean stays in double: rounded to float32 first (x - float(mean)), shifted data
  // (1e6 + noise) would lose up to half an ulp of 1e6 (0.03) in every output.
  const double mean = total.mean;
  const double rstd = 1.0 / std::sqrt(var + eps);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const double y = (static_cast<double>(static_cast<float>(xp[i])) - mean) * rstd;
      op[i] = static_cast<float>(shift_mean ? y : y + mean);
    }
  });
  return out;
}

// `fused` picks between the CUDA kernels' two paths (advantages_cuda.cu); the CPU has one
at::Tensor masked_whiten_cpu(const at::Tensor& x, const at::Tensor& mask, bool shift_mean, double eps, bool /*fused*/) {
  TORCH_CHECK(x.is_contiguous() && mask.is_contiguous() && x.sizes() == mask.sizes(),
              "rlkernels_csrc::masked_whiten: x and mask must be contiguous and of one shape");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "rlkernels_csrc::masked_whiten: mask must be bool");
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rlkernels_whiten_cpu",
                                  [&] { out = masked_whiten_impl<scalar_t>(x, mask, shift_mean, eps); });
  return out;
}

}  // namespace

TORCH_LIBRARY(rlkernels_csrc, m) {
  m.def("gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam) -> (Tensor, Tensor)");
  m.def("group_advantages(Tensor scores, Tensor perm, Tensor starts, int group_size, int mode, float eps) -> Tensor");
  m.def("masked_whiten(Tensor x, Tensor mask, bool shift_mean, float eps, bool fused) -> Tensor");
  // logits_policy_loss's CUDA kernel (logits_policy_cuda.cu; CUDA only): 1 when it ran, 0 when it cannot take the call
  m.def("logits_policy(Tensor logits, Tensor labels, Tensor old_logp, Tensor adv, Tensor ref_logp, Tensor mask, "
        "Tensor weight, Tensor(a!) logp, Tensor(b!) entropy, Tensor(c!) part, Tensor(d!) d_logits, int T, "
        "float inv_temp, int ignore_index, float ratio_min, float ratio_max, float dual_clip, float kl_coef, "
        "float entropy_coef, bool on_policy, bool has_ref, int kl_estimator, bool has_entropy, bool entropy_grad, "
        "bool write_grad) -> int");
}

TORCH_LIBRARY_IMPL(rlkernels_csrc, CPU, m) {
  m.impl("gae", &gae_cpu);
  m.impl("group_advantages", &group_advantages_cpu);
  m.impl("masked_whiten", &masked_whiten_cpu);
}

}  // namespace rlkernels
