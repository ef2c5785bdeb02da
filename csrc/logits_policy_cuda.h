// Host entry point of logits_policy_loss's CUDA kernel (raw pointers, no torch types): see logits_policy_cuda.cu.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "advantages_cuda.h"  // Dtype

namespace rlkernels_cuda {

constexpr int kLogitsRefused = -2;  // the kernel cannot take this call (alignment, size, device): nothing ran

// One call's tensors and options, as fused_policy._logits_csrc_token passes them (shapes there)
struct LogitsPolicyCall {
  const void* logits;  // rows at (row / inner)·stride_outer + (row % inner)·stride_inner elements, unit last stride
  const int64_t* labels;
  const float *old_logp, *adv, *ref_logp;
  const uint8_t* mask;
  const float* weight;
  float *logp, *entropy, *part;
  void* d_logits;  // [N, V] contiguous, the logits' dtype
  int64_t N, V, stride_outer, stride_inner, inner, T_len, ignore_index;
  float inv_temp, ratio_min, ratio_max, dual_clip, kl_coef, entropy_coef;
  bool on_policy, has_ref, has_entropy, entropy_grad, write_grad;
  int kl_estimator;
};

// 0: ran; kLogitsRefused: not launched (the caller takes another path); -1: unsupported dtype; else a cudaError_t
int logits_policy(int dtype, const LogitsPolicyCall& call, cudaStream_t stream);

}  // namespace rlkernels_cuda
