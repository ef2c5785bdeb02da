// Registers logits_policy_cuda.cu's kernel as the CUDA implementation of torch.ops.rlkernels_csrc.logits_policy
// (the schema is defined in advantages.cpp). Compiled only when torch has CUDA (CUDAExtension / JIT build with nvcc).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "dtype_code.h"
#include "logits_policy_cuda.h"

namespace {

// Returns 1 when the kernel ran, 0 when it cannot take the call (nothing was written: the caller takes another path)
int64_t logits_policy_cuda(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& old_logp,
                           const at::Tensor& adv, const at::Tensor& ref_logp, const at::Tensor& mask,
                           const at::Tensor& weight, at::Tensor& logp, at::Tensor& entropy, at::Tensor& part,
                           at::Tensor& d_logits, int64_t T, double inv_temp, int64_t ignore_index, double ratio_min,
                           double ratio_max, double dual_clip, double kl_coef, double entropy_coef, bool on_policy,
                           bool has_ref, int64_t kl_estimator, bool has_entropy, bool entropy_grad, bool write_grad) {
  TORCH_CHECK(logits.dim() == 3 && logits.stride(2) == 1, "rlkernels_csrc::logits_policy: logits must be [O, I, V] "
              "with unit last stride");
  const int64_t N = logits.size(0) * logits.size(1), V = logits.size(2);
  // every tensor on the logits' device: the kernel reads and writes them all there (the dispatcher picks this
  // CUDA kernel when any argument is a CUDA tensor)
  const at::Tensor* others[] = {&labels, &old_logp, &adv, &ref_logp, &mask, &weight, &logp, &entropy, &part, &d_logits};
  for (const at::Tensor* t : others)
    TORCH_CHECK(t->device() == logits.device(), "rlkernels_csrc::logits_policy: every tensor must be on the logits' "
                "device ", logits.device(), ", got one on ", t->device());
  auto flat = [N](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.numel() == N && t.is_contiguous() && t.scalar_type() == type, "rlkernels_csrc::logits_policy: ",
                name, " must be contiguous [N] of ", type);
  };
  flat(labels, at::kLong, "labels");
  flat(adv, at::kFloat, "adv");
  flat(old_logp, at::kFloat, "old_logp");
  flat(ref_logp, at::kFloat, "ref_logp");
  flat(mask, at::kByte, "mask");
  flat(logp, at::kFloat, "logp");
  flat(entropy, at::kFloat, "entropy");
  TORCH_CHECK(T >= 1 && N % T == 0 && weight.numel() == N / T && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "rlkernels_csrc::logits_policy: weight must be contiguous float32 [N / T]");
  TORCH_CHECK(part.numel() == N * 8 && part.is_contiguous() && part.scalar_type() == at::kFloat,
              "rlkernels_csrc::logits_policy: part must be contiguous float32 [N, 8]");
  TORCH_CHECK(!write_grad || (d_logits.numel() == N * V && d_logits.is_contiguous() &&
                              d_logits.scalar_type() == logits.scalar_type()),
              "rlkernels_csrc::logits_policy: d_logits must be contiguous [N, V] of the logits' dtype");
  TORCH_CHECK(kl_estimator >= 0 && kl_estimator <= 3, "rlkernels_csrc::logits_policy: unknown kl_estimator ",
              kl_estimator);
  c10::cuda::CUDAGuard guard(logits.device());
  rlkernels_cuda::LogitsPolicyCall call{};
  call.logits = logits.data_ptr();
  call.labels = labels.data_ptr<int64_t>();
  call.old_logp = old_logp.data_ptr<float>(), call.adv = adv.data_ptr<float>();
  call.ref_logp = ref_logp.data_ptr<float>(), call.mask = mask.data_ptr<uint8_t>();
  call.weight = weight.data_ptr<float>(), call.logp = logp.data_ptr<float>();
  call.entropy = entropy.data_ptr<float>(), call.part = part.data_ptr<float>();
  call.d_logits = write_grad ? d_logits.data_ptr() : logits.data_ptr();  // never written without write_grad
  call.N = N, call.V = V, call.stride_outer = logits.stride(0), call.stride_inner = logits.stride(1);
  call.inner = logits.size(1), call.T_len = T, call.ignore_index = ignore_index;
  call.inv_temp = static_cast<float>(inv_temp), call.ratio_min = static_cast<float>(ratio_min);
  call.ratio_max = static_cast<float>(ratio_max), call.dual_clip = static_cast<float>(dual_clip);
  call.kl_coef = static_cast<float>(kl_coef), call.entropy_coef = static_cast<float>(entropy_coef);
  call.on_policy = on_policy, call.has_ref = has_ref, call.has_entropy = has_entropy;
  call.entropy_grad = entropy_grad, call.write_grad = write_grad, call.kl_estimator = static_cast<int>(kl_estimator);
  const int code = rlkernels_cuda::logits_policy(dtype_code(logits, "logits_policy"), call, c10::cuda::getCurrentCUDAStream());
  if (code == rlkernels_cuda::kLogitsRefused) return 0;
  TORCH_CHECK(code == 0, "rlkernels_csrc::logits_policy (CUDA) failed: ",
              code < 0 ? "unsupported dtype" : cudaGetErrorString(static_cast<cudaError_t>(code)));
  return 1;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlkernels_csrc, CUDA, m) { m.impl("logits_policy", &logits_policy_cuda); }
