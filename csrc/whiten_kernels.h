// masked_whiten's CUDA kernels: per-block partial moments (whiten_partial_kernel), one block merging them
// (whiten_merge_kernel, with its overflow rescue), and the normalisation (whiten_apply_kernel); launched by
// advantages_cuda.cu's whiten_launch with whiten_parts(N) blocks. A header of its own, included by
// advantages_cuda.cu inside its namespace, so that the tests can also compile the kernels with the host compiler
// under a warp emulator (tests/cuda_emulated/) and check them on the CPU against the float64 truth. It includes
// nothing: the includer provides int64_t, uint8_t, to_float(T), isfinite, rsqrtf, fmaxf, approx_rcp, __shfl_xor_sync,
// __syncthreads, __shared__, blockIdx / threadIdx / blockDim / gridDim and the CUDA keywords (nvcc's own, or the
// emulator's), and kMaxWhitenParts (advantages_cuda.h).
#pragma once

constexpr int kWhitenThreads = 256;

// Blocks of the statistics and apply passes for N elements: one per 4 strides of the block, at most
// kMaxWhitenParts (the size of `part` is 4 * that + 5) and at most `resident`, the blocks of the statistics
// kernel the device holds at once (SMs x blocks per SM; the apply kernel holds at least as many). Both passes are
// grid-stride loops, so a grid past one wave gains nothing and loses much: its last blocks ran in a second round
// on a fraction of the SMs (1024 blocks where an H100/H200 holds 6 x 132 = 792 of the 36-register statistics
// kernel: 232 blocks, each with a full share, on under a third of the machine).
inline int whiten_parts(int64_t N, int resident = kMaxWhitenParts) {
  const int cap = resident < 1 ? 1 : (resident < kMaxWhitenParts ? resident : kMaxWhitenParts);
  const int64_t blocks = (N + kWhitenThreads * 4 - 1) / (kWhitenThreads * 4);
  return static_cast<int>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

// Moments of a share of the masked-in values, relative to a pivot k (a masked-in value of
// the share): mean = k + mu, m2 = sum of squared deviations. Shifted data (1e6 + noise)
// would otherwise keep its mean as a float32 near 1e6, rounded to ~0.03 at every Welford
// step and merge, and every deviation and output would inherit that error; x - k is exact
// (Sterbenz) for data near k, and a shift of all data only moves k.
struct Moments {
  float n, k, mu, m2;
};

// Chan et al.'s merge; y's mean is re-expressed relative to x's pivot: (y.k - x.k) + y.mu.
__device__ __forceinline__ Moments merge(const Moments& x, const Moments& y) {
  if (y.n == 0.f) return x;
  if (x.n == 0.f) return y;
  const float n = x.n + y.n;
  const float delta = (y.k - x.k) + (y.mu - x.mu);
  const float frac = y.n / n;
  return {n, x.k, x.mu + delta * frac, x.m2 + y.m2 + delta * delta * x.n * frac};
}

__device__ Moments block_merge(Moments mo) {
  __shared__ Moments per_warp[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    Moments o{__shfl_xor_sync(0xffffffffu, mo.n, d), __shfl_xor_sync(0xffffffffu, mo.k, d),
              __shfl_xor_sync(0xffffffffu, mo.mu, d), __shfl_xor_sync(0xffffffffu, mo.m2, d)};
    mo = merge(mo, o);
  }
  if (lane == 0) per_warp[warp] = mo;
  __syncthreads();
  Moments total{0.f, 0.f, 0.f, 0.f};
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total = merge(total, per_warp[w]);
  __syncthreads();
  return total;
}

// Welford's update of a thread's moments by one value xi, on xi - k (k: the thread's first masked-in one), when
// `in` (masked in). Branch-free: a masked-out value is replaced by the running mean, so its delta is exactly 0 and
// every field keeps its value (NaN/inf there never reach them). delta / n is delta times the hardware's approximate
// reciprocal of the count (one MUFU.RCP, ~1 ulp; the count is >= 1) rather than IEEE's division (~10 instructions
// with its slow-path call): Welford's stability does not rest on the mean update's last bit. With IEEE division
// and a branch per mask the unrolled loop took 148 SASS instructions per 4 values on sm_90 (37 per value, against
// the 25 that 2x headroom under a float32 value's 5 bytes allows).
__device__ __forceinline__ void welford(Moments& mo, float xi, bool in) {
  const bool first = in && mo.n == 0.f;
  mo.k = first ? xi : mo.k;
  const float n = in ? mo.n + 1.f : mo.n;
  const float yi = in ? xi - mo.k : mo.mu;
  const float delta = yi - mo.mu;
  mo.mu += delta * approx_rcp(fmaxf(n, 1.f));
  mo.m2 += delta * (yi - mo.mu);
  mo.n = n;
}

// Grid-stride loops take kUnroll strides per iteration: every load of the group is issued before the first value
// is used (the mask and x unconditionally), so a thread has kUnroll of each in flight. With one stride per
// iteration the x load waited for its mask (a conditional load) and each iteration for the last: on an H200 the
// statistics pass moved its bytes at 38 % of the DRAM bandwidth (Nsight Compute, B=1024 T=4096 float32). The values
// are consumed in the same order as before, so the results are the same bits.
constexpr int kUnroll = 4;

// The moments of the masked-in x·scale at i = first, first + stride, ... below N, merged over the block.
template <typename T>
__device__ Moments block_moments(const T* __restrict__ x, const uint8_t* __restrict__ mask, int64_t first,
                                 int64_t stride, int64_t N, float scale) {
  Moments mo{0.f, 0.f, 0.f, 0.f};
  int64_t i = first;
  for (; i + (kUnroll - 1) * stride < N; i += kUnroll * stride) {
    uint8_t m[kUnroll];
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      m[u] = mask[i + u * stride];
      v[u] = to_float(x[i + u * stride]) * scale;  // read whether masked in or not: not used where it is not
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) welford(mo, v[u], m[u] != 0);
  }
  for (; i < N; i += stride) welford(mo, to_float(x[i]) * scale, mask[i] != 0);
  return block_merge(mo);
}

template <typename T>
__global__ void __launch_bounds__(kWhitenThreads)
    whiten_partial_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask, float* __restrict__ part, int64_t N) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const Moments mo = block_moments(x, mask, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, stride, N, 1.f);
  if (threadIdx.x == 0) {
    part[4 * blockIdx.x + 0] = mo.n;
    part[4 * blockIdx.x + 1] = mo.k;
    part[4 * blockIdx.x + 2] = mo.mu;
    part[4 * blockIdx.x + 3] = mo.m2;
  }
}

constexpr float kRescueDown = 0x1p-100f, kRescueUp = 0x1p100f;

// One block: the partials merged into stats[5] = (count, k, mean - k, M2, scale), the moments of x·scale.
// Rescue: float32 squares overflow past deviations of ~1.8e19 (and merges of means ~1e15 apart over ~1e9
// entries), leaving the mean or M2 inf/NaN; then this block reads x once more and forms the moments of
// x·2^-100 (exact scaling; the deviations that overflowed stay far above float32's smallest normal there).
// Finite data never takes it; masked-in NaN/inf do, and give NaN as before.
template <typename T>
__global__ void __launch_bounds__(kWhitenThreads)
    whiten_merge_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask, const float* __restrict__ part,
                        float* __restrict__ stats, int num_parts, int64_t N) {
  Moments mo{0.f, 0.f, 0.f, 0.f};
  for (int j = threadIdx.x; j < num_parts; j += blockDim.x)
    mo = merge(mo, Moments{part[4 * j], part[4 * j + 1], part[4 * j + 2], part[4 * j + 3]});
  mo = block_merge(mo);
  float scale = 1.f;
  if (!isfinite(mo.k + mo.mu) || !isfinite(mo.m2)) {  // the same on every thread: block_merge's result is shared
    mo = block_moments(x, mask, threadIdx.x, blockDim.x, N, kRescueDown);
    scale = kRescueDown;
  }
  if (threadIdx.x == 0) {
    stats[0] = mo.n;
    stats[1] = mo.k;
    stats[2] = mo.mu;
    stats[3] = mo.m2;
    stats[4] = scale;
  }
}

template <typename T>
__global__ void __launch_bounds__(kWhitenThreads)
    whiten_apply_kernel(const T* __restrict__ x, float* __restrict__ out, const float* __restrict__ stats, int64_t N,
                        float eps, bool shift_mean) {
  const float n = stats[0], k = stats[1], mu = stats[2], m2 = stats[3], scale = stats[4];
  const float var = n > 1.f ? m2 / (n - 1.f) : 0.f;
  const float rstd = rsqrtf(var + eps * scale * scale);  // the rescue's eps·2^-200 is 0: negligible beside var
  const float mean = (k + mu) * (scale == 1.f ? 1.f : kRescueUp);  // rounded only where added back
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < N; i += kUnroll * stride) {  // kUnroll loads in flight (see kUnroll)
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = to_float(x[i + u * stride]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float y = ((v[u] * scale - k) - mu) * rstd;
      out[i + u * stride] = shift_mean ? y : y + mean;
    }
  }
  for (; i < N; i += stride) {
    const float y = ((to_float(x[i]) * scale - k) - mu) * rstd;
    out[i] = shift_mean ? y : y + mean;
  }
}

// The three passes in order on `launch(kernel, blocks, args...)` (a kernel launch of kWhitenThreads threads per block
// on one stream, or the emulator's): `part` holds [num_parts, 4] partial moments, then the [5] merged statistics.
template <typename T, typename Launch>
void whiten_passes(const T* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N, float eps,
                   bool shift_mean, Launch launch) {
  float* stats = part + 4 * num_parts;
  launch(whiten_partial_kernel<T>, num_parts, x, mask, part, N);
  launch(whiten_merge_kernel<T>, 1, x, mask, static_cast<const float*>(part), stats, num_parts, N);
  launch(whiten_apply_kernel<T>, num_parts, x, out, static_cast<const float*>(stats), N, eps, shift_mean);
}
