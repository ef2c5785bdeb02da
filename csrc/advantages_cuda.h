// Host entry points of the CUDA advantage kernels (raw pointers, no torch types).
// Each returns 0 or a cudaError_t value (-1: unsupported dtype). Shapes: [B, T]
// contiguous for gae; [N] for group_advantages and masked_whiten.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace rlkernels_cuda {

enum Dtype { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
constexpr int kMaxWhitenParts = 1024;

int gae(int dtype, const void* rewards, const void* values, const uint8_t* mask, float* adv, float* ret, int64_t B,
        int64_t T, float gamma, float lam, cudaStream_t stream);

// group_size > 0: G contiguous groups of group_size (perm, starts == nullptr); else group g holds
// perm[starts[g] .. starts[g+1]) (perm == nullptr: the positions themselves); mode 0 grpo, 1 dr_grpo, 2 rloo
int group_advantages(const float* scores, float* out, const int64_t* perm, const int64_t* starts, int64_t G,
                     int64_t group_size, int mode, float eps, cudaStream_t stream);

// number of partial moments masked_whiten may use for N elements of `dtype` on the current device: the larger of its
// two paths' one-wave grids (the size of `part` is 4 * that + 5: count, pivot, mean - pivot, M2 of each share, then
// the merged statistics and the scale they are of)
int whiten_partials(int dtype, int64_t N);

// fused: one cooperative kernel where it can run (aligned memory, a device with cooperative launches), else (and
// with fused false) the three passes; `part` serves both
int masked_whiten(int dtype, const void* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N,
                  float eps, bool shift_mean, bool fused, cudaStream_t stream);

}  // namespace rlkernels_cuda
