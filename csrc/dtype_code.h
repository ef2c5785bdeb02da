// The Dtype code (advantages_cuda.h) of a tensor's scalar type, for the CUDA bindings (advantages_cuda_binding.cpp,
// logits_policy_binding.cpp); anything but float32, float16 and bfloat16 raises, naming the op.
#pragma once
#include <ATen/ATen.h>

#include "advantages_cuda.h"

inline int dtype_code(const at::Tensor& x, const char* op) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return rlkernels_cuda::kFloat32;
    case at::kHalf:
      return rlkernels_cuda::kFloat16;
    case at::kBFloat16:
      return rlkernels_cuda::kBFloat16;
    default:
      TORCH_CHECK(false, "rlkernels_csrc::", op, " (CUDA): unsupported dtype ", x.scalar_type());
  }
}
