// logits_policy_loss's CUDA kernel (csrc/logits_policy_kernel.h) on raw pointers: no torch headers, so this file
// compiles standalone (nvcc -c); bound in logits_policy_binding.cpp. A cluster of `ranks` blocks per token row,
// each holding `chunk` columns of the row in shared memory (Hopper's thread block clusters and distributed shared
// memory; before Hopper only rows that fit one block's chunk run here).
#include <atomic>

#include <cooperative_groups.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "logits_policy_cuda.h"
#include "per_device.h"  // once_per_device, device_attribute

namespace rlkernels_cuda {
namespace {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_float(float g, float* p) { *p = g; }
__device__ __forceinline__ void from_float(float g, __half* p) { *p = __float2half_rn(g); }
__device__ __forceinline__ void from_float(float g, __nv_bfloat16* p) { *p = __float2bfloat16_rn(g); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() { cooperative_groups::this_cluster().sync(); }
__device__ __forceinline__ int cluster_rank() {
  return static_cast<int>(cooperative_groups::this_cluster().block_rank());
}
template <typename P>
__device__ __forceinline__ P* cluster_remote(P* p, int rank) {
  return cooperative_groups::this_cluster().map_shared_rank(p, static_cast<unsigned>(rank));
}
#else
// Before Hopper: no clusters; the host launches only clusters of one block there
__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
__device__ __forceinline__ int cluster_rank() { return 0; }
template <typename P>
__device__ __forceinline__ P* cluster_remote(P* p, int) {
  return p;
}
#endif

__device__ __forceinline__ void* dynamic_shared() {
  extern __shared__ uint4 logits_policy_smem[];
  return logits_policy_smem;
}

#include "vector_loads.h"  // widen2
#include "logits_policy_kernel.h"  // LogitsPolicyArgs, logits_policy_kernel

// Whether the current device is Hopper or later (clusters), once per device
bool has_clusters() {
  static std::atomic<int> cached[kMaxDevices];
  const auto hopper = [](int device) { return device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 9; };
  return once_per_device(cached, hopper, 0) != 0;
}

// The dynamic shared memory a block of the kernel may use on the current device, once per device and dtype: the
// largest plan's (kLogitsMaxChunkBytes + 16) or, on a device that opts in to less (a Turing GPU: 64 KB a block), all
// it allows beside the kernel's static shared memory -- the attribute raised to it; 0 where it cannot be raised
// (every plan is then refused: another path runs)
template <typename T>
int shared_memory_limit() {
  static std::atomic<int> cached[kMaxDevices];
  return once_per_device(cached, [](int device) {
    const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaFuncAttributes attributes{};
    int limit = 0;
    if (cudaFuncGetAttributes(&attributes, logits_policy_kernel<T>) == cudaSuccess) {
      const int room = optin - static_cast<int>(attributes.sharedSizeBytes);
      limit = room < kLogitsMaxChunkBytes + 16 ? room : kLogitsMaxChunkBytes + 16;
      if (limit <= 0 ||
          cudaFuncSetAttribute(logits_policy_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, limit) !=
              cudaSuccess)
        limit = 0;
    }
    cudaGetLastError();  // a failed query or setting must not surface as a later launch's error
    return limit;
  }, 0);
}

// Whether clusters of `ranks` blocks run this kernel on the current device, once per device, dtype and ranks (after
// shared_memory_limit): its code was compiled for sm_90 or later (cudaFuncAttributes::ptxVersion, the virtual
// architecture, as cub::PtxVersion reads it: an extension built for an older one only, "8.0+PTX", runs on Hopper as
// that PTX compiled by the driver -- the kernel's pre-Hopper branch, which has no clusters and would give every
// block rank 0: wrong results, no error), and at least one such cluster with the largest chunk fits the device
// (cudaOccupancyMaxActiveClusters: MPS or a green context may leave too few SMs; the launch would fail with
// cudaErrorInvalidClusterSize, here the caller takes another path instead)
template <typename T>
bool clusters_fit(int ranks) {
  static std::atomic<int> cached[kLogitsMaxRanks + 1][kMaxDevices];
  if (ranks < 2 || ranks > kLogitsMaxRanks) return false;
  return once_per_device(cached[ranks], [ranks](int) {
    cudaFuncAttributes attributes{};
    bool fits = false;
    if (cudaFuncGetAttributes(&attributes, logits_policy_kernel<T>) == cudaSuccess && attributes.ptxVersion >= 90) {
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(static_cast<unsigned>(ranks));
      config.blockDim = dim3(kLogitsThreads);
      config.dynamicSmemBytes = kLogitsMaxChunkBytes + 16;
      cudaLaunchAttribute cluster{};
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = static_cast<unsigned>(ranks);
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = 1;
      config.attrs = &cluster;
      config.numAttrs = 1;
      int clusters = 0;
      fits = cudaOccupancyMaxActiveClusters(&clusters, logits_policy_kernel<T>, &config) == cudaSuccess && clusters > 0;
    }
    cudaGetLastError();
    return fits ? 1 : 0;
  }, 0) != 0;
}

template <typename T>
int launch(const LogitsPolicyCall& call, cudaStream_t stream) {
  const LogitsPlan plan = logits_policy_plan(static_cast<int>(sizeof(T)), call.V);
  if (plan.ranks == 0 || (plan.ranks > 1 && !has_clusters())) return kLogitsRefused;
  if (call.N == 0) return 0;  // (before the division by inner, which is 0 for logits of shape [O, 0, V])
  // every row start 16-byte aligned: the base, and each stride that moves it
  const auto aligned = [](uint64_t bytes) { return bytes % 16 == 0; };
  const int64_t outer = (call.N + call.inner - 1) / call.inner;
  if (!aligned(reinterpret_cast<uintptr_t>(call.logits)) || !aligned(reinterpret_cast<uintptr_t>(call.d_logits)) ||
      (outer > 1 && !aligned(static_cast<uint64_t>(call.stride_outer) * sizeof(T))) ||
      (call.inner > 1 && !aligned(static_cast<uint64_t>(call.stride_inner) * sizeof(T))))
    return kLogitsRefused;
  if (call.N * plan.ranks > INT32_MAX) return kLogitsRefused;
  if (plan.shared_bytes > shared_memory_limit<T>()) return kLogitsRefused;
  if (plan.ranks > 1 && !clusters_fit<T>(plan.ranks)) return kLogitsRefused;
  LogitsPolicyArgs<T> a;
  a.logits = static_cast<const T*>(call.logits);
  a.labels = call.labels, a.old_logp = call.old_logp, a.adv = call.adv, a.ref_logp = call.ref_logp;
  a.mask = call.mask, a.weight = call.weight, a.logp = call.logp, a.entropy = call.entropy, a.part = call.part;
  a.d_logits = static_cast<T*>(call.d_logits);
  a.stride_outer = call.stride_outer, a.stride_inner = call.stride_inner, a.inner = call.inner;
  a.T_len = call.T_len, a.V = call.V, a.ignore_index = call.ignore_index;
  a.chunk = plan.chunk, a.ranks = plan.ranks;
  a.inv_temp = call.inv_temp, a.ratio_min = call.ratio_min, a.ratio_max = call.ratio_max;
  a.dual_clip = call.dual_clip, a.kl_coef = call.kl_coef, a.entropy_coef = call.entropy_coef;
  a.on_policy = call.on_policy, a.has_ref = call.has_ref, a.has_entropy = call.has_entropy;
  a.entropy_grad = call.entropy_grad, a.write_grad = call.write_grad, a.kl_estimator = call.kl_estimator;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(call.N * plan.ranks));
  config.blockDim = dim3(kLogitsThreads);
  config.dynamicSmemBytes = plan.shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  if (plan.ranks > 1) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(plan.ranks);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  const cudaError_t error = cudaLaunchKernelEx(&config, logits_policy_kernel<T>, a);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return static_cast<int>(error);
  }
  return 0;
}

}  // namespace

int logits_policy(int dtype, const LogitsPolicyCall& call, cudaStream_t stream) {
  switch (dtype) {
    case kFloat32:
      return launch<float>(call, stream);
    case kFloat16:
      return launch<__half>(call, stream);
    case kBFloat16:
      return launch<__nv_bfloat16>(call, stream);
    default:
      return -1;
  }
}

}  // namespace rlkernels_cuda
