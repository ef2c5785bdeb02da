// Answers asked of the CUDA runtime once per device and kept (device attributes, occupancy, a kernel's attributes):
// shared by the CUDA launchers (advantages_cuda.cu, logits_policy_cuda.cu). Include at global scope.
#pragma once
#include <atomic>

#include <cuda_runtime.h>

namespace rlkernels_cuda {

constexpr int kMaxDevices = 64;

// The current device, or -1 when the runtime cannot say or it is past kMaxDevices (the error cleared: it must not
// surface as a later launch's)
inline int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

// ask(device) -- an int >= 0 -- once per device, kept in `cache` (kMaxDevices zero-initialised entries: v is kept as
// v + 1); `unknown` where the current device is not known. Concurrent first calls may both ask (the same answer).
template <typename Ask>
int once_per_device(std::atomic<int>* cache, Ask ask, int unknown) {
  const int device = current_device();
  if (device < 0) return unknown;
  int known = cache[device].load(std::memory_order_relaxed);
  if (known == 0) {
    known = ask(device) + 1;
    cache[device].store(known, std::memory_order_relaxed);
  }
  return known - 1;
}

// A device attribute, 0 where the query fails (the error cleared)
inline int device_attribute(cudaDeviceAttr attribute, int device) {
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return value;
}

}  // namespace rlkernels_cuda
