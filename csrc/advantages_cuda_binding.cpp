// Registers the CUDA kernels of advantages_cuda.cu as the CUDA implementations
// of torch.ops.rlkernels_csrc.* (the schemas are defined in advantages.cpp).
// Compiled only when torch has CUDA (CUDAExtension / JIT build with nvcc).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "advantages_cuda.h"
#include "dtype_code.h"

namespace {

void check(int code, const char* what) {
  TORCH_CHECK(code == 0, "rlkernels_csrc::", what, " (CUDA) failed: ",
              code < 0 ? "unsupported dtype" : cudaGetErrorString(static_cast<cudaError_t>(code)));
}

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                                            double gamma, double lam) {
  TORCH_CHECK(rewards.dim() == 2 && values.sizes() == rewards.sizes() && mask.sizes() == rewards.sizes(),
              "rlkernels_csrc::gae: rewards, values and mask must be [B, T] of one shape");
  TORCH_CHECK(values.scalar_type() == rewards.scalar_type() && mask.scalar_type() == at::kBool,
              "rlkernels_csrc::gae: rewards and values must share a dtype; mask must be bool");
  c10::cuda::CUDAGuard guard(rewards.device());
  at::Tensor r = rewards.contiguous(), v = values.contiguous(), m = mask.contiguous();
  auto opts = r.options().dtype(at::kFloat);
  at::Tensor adv = at::empty(r.sizes(), opts), ret = at::empty(r.sizes(), opts);
  check(rlkernels_cuda::gae(dtype_code(r, "gae"), r.data_ptr(), v.data_ptr(), reinterpret_cast<const uint8_t*>(m.data_ptr<bool>()),
                            adv.data_ptr<float>(), ret.data_ptr<float>(), r.size(0), r.size(1), static_cast<float>(gamma),
                            static_cast<float>(lam), c10::cuda::getCurrentCUDAStream()),
        "gae");
  return {adv, ret};
}

at::Tensor group_advantages_cuda(const at::Tensor& scores, const at::Tensor& perm, const at::Tensor& starts,
                                 int64_t group_size, int64_t mode, double eps) {
  TORCH_CHECK(scores.dim() == 1 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "rlkernels_csrc::group_advantages: scores must be contiguous float32 [N]");
  TORCH_CHECK(perm.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && perm.is_contiguous() &&
                  starts.is_contiguous(),
              "rlkernels_csrc::group_advantages: perm and starts must be contiguous int64");
  TORCH_CHECK(mode >= 0 && mode <= 2, "rlkernels_csrc::group_advantages: unknown mode ", mode);
  const int64_t N = scores.size(0);
  TORCH_CHECK(perm.numel() == 0 || perm.numel() == N, "rlkernels_csrc::group_advantages: perm must be [N]");
  TORCH_CHECK(group_size >= 0 && (group_size == 0 || (perm.numel() == 0 && N % group_size == 0)),
              "rlkernels_csrc::group_advantages: group_size must be 0 (groups from starts) or divide N without a perm");
  TORCH_CHECK(group_size > 0 || starts.numel() >= 1, "rlkernels_csrc::group_advantages: starts must be [G + 1]");
  c10::cuda::CUDAGuard guard(scores.device());
  at::Tensor out = at::empty_like(scores);
  const int64_t G = group_size > 0 ? N / group_size : starts.numel() - 1;
  check(rlkernels_cuda::group_advantages(scores.data_ptr<float>(), out.data_ptr<float>(),
                                         perm.numel() > 0 ? perm.data_ptr<int64_t>() : nullptr,
                                         group_size > 0 ? nullptr : starts.data_ptr<int64_t>(), G, group_size,
                                         static_cast<int>(mode), static_cast<float>(eps),
                                         c10::cuda::getCurrentCUDAStream()),
        "group_advantages");
  return out;
}

at::Tensor masked_whiten_cuda(const at::Tensor& x, const at::Tensor& mask, bool shift_mean, double eps, bool fused) {
  TORCH_CHECK(x.sizes() == mask.sizes() && mask.scalar_type() == at::kBool,
              "rlkernels_csrc::masked_whiten: mask must be bool of the shape of x");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), mc = mask.contiguous();
  const int64_t N = xc.numel();
  const int parts = rlkernels_cuda::whiten_partials(dtype_code(xc, "masked_whiten"), N);
  // [parts, 4]: count, pivot, mean - pivot, M2 per block; then [5] the merged statistics and their scale
  at::Tensor part = at::empty({4 * parts + 5}, xc.options().dtype(at::kFloat));
  at::Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kFloat));
  check(rlkernels_cuda::masked_whiten(dtype_code(xc, "masked_whiten"), xc.data_ptr(), reinterpret_cast<const uint8_t*>(mc.data_ptr<bool>()),
                                      out.data_ptr<float>(), part.data_ptr<float>(), parts, N, static_cast<float>(eps),
                                      shift_mean, fused, c10::cuda::getCurrentCUDAStream()),
        "masked_whiten");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlkernels_csrc, CUDA, m) {
  m.impl("gae", &gae_cuda);
  m.impl("group_advantages", &group_advantages_cuda);
  m.impl("masked_whiten", &masked_whiten_cuda);
}
