// masked_whiten's CUDA kernels. The default path is ONE cooperative kernel (whiten_fused_kernel): every block
// forms the partial moments of its share, a grid barrier, every block merges all the partials itself (the same
// order everywhere, so the same bits), then normalizes its own share, which it read a moment ago (from L1/L2): x and
// the mask are read from DRAM once and the output written once, in one launch. It needs the whole chunks 16-byte
// aligned in x and in the output and a device that runs cooperative launches; otherwise, and with
// RLKERNELS_WHITEN=passes, the three passes: per-block partial moments (whiten_partial_kernel), one block merging
// them (whiten_merge_kernel, with its overflow rescue), and the normalisation (whiten_apply_kernel). Launched by
// advantages_cuda.cu's whiten_launch with whiten_parts(N) blocks. A header of its own, included by
// advantages_cuda.cu inside its namespace, so that the tests can also compile the kernels with the host compiler
// under a warp emulator (tests/cuda_emulated/) and check them on the CPU against the float64 truth. It includes
// nothing: the includer provides int64_t, uint8_t, uintptr_t, float4 / make_float4, kItems / load8 / load8_mask
// (vector_loads.h), to_float(T), isfinite, rsqrtf, fmaxf, fmaf, approx_rcp, __ldcg, __shfl_xor_sync, grid_sync() (a
// barrier of every thread of a cooperative launch's grid, its memory fences included), __syncthreads, __shared__,
// blockIdx / threadIdx / blockDim / gridDim and the CUDA keywords (nvcc's own, or the emulator's), and
// kMaxWhitenParts (advantages_cuda.h). __shared__ state never lives across a grid_sync() (the emulator runs one
// block at a time between them).
#pragma once

constexpr int kWhitenThreads = 256;

// Blocks of a whitening grid for N elements: one per 4 strides of the block, at most kMaxWhitenParts (the size of
// `part` is 4 * that + 5) and at most `resident`, the blocks of the path's kernels the device holds at once (SMs x
// blocks per SM: the fused kernel's grid must be resident at once; the passes' statistics kernel holds no more than
// the apply kernel). Every loop is grid-stride, so a grid past one wave gains nothing and loses much: its last blocks
// ran in a second round on a fraction of the SMs (1024 blocks where an H100/H200 then held 6 x 132 = 792 of the
// statistics kernel: 232 blocks, each with a full share, on under a third of the machine).
inline int whiten_parts(int64_t N, int resident = kMaxWhitenParts) {
  const int cap = resident < 1 ? 1 : (resident < kMaxWhitenParts ? resident : kMaxWhitenParts);
  const int64_t blocks = (N + kWhitenThreads * 4 - 1) / (kWhitenThreads * 4);
  return static_cast<int>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

// Moments of a share of the masked-in values, relative to a pivot k (a masked-in value of
// the share): mean = k + mu, m2 = sum of squared deviations. Shifted data (1e6 + noise)
// would otherwise keep its mean as a float32 near 1e6, rounded to ~0.03 at every chunk
// and merge, and every deviation and output would inherit that error; x - k is exact
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

// One chunk of kItems consecutive values v (in[u]: masked in; in_count of them) added to a thread's moments `mo`,
// relative to its pivot mo.k: kPivoted, when mo.k already is one (a masked-in value of the thread's); else, while
// mo.n is 0, the chunk's first masked-in value becomes it. Two passes
// over registers -- the chunk's count and sum of v - k, its mean (the sum times the hardware's approximate reciprocal
// of the count: one MUFU.RCP, ~1 ulp, where IEEE division costs ~10 instructions and a slow-path call), then its
// squared deviations from that mean -- and one Chan merge into `mo` per chunk. Branch-free: a masked-out value is
// selected away (0 in the sum and the deviations), so NaN/inf there never reach any field. Welford's update per
// value (a reciprocal and a merge for every value) cost 21.25 SASS instructions per value on sm_90 whatever the
// dtype: over the 15 that 2x headroom under a 16-bit value's 3 bytes (value and mask) allows.
template <bool kPivoted>
__device__ __forceinline__ void add_chunk(Moments& mo, const float (&v)[kItems], const bool (&in)[kItems],
                                          int in_count) {
  float k = mo.k;
  if (!kPivoted) {
    float first = 0.f;
#pragma unroll
    for (int u = kItems - 1; u >= 0; --u) first = in[u] ? v[u] : first;
    k = mo.n == 0.f ? first : mo.k;
  }
  float y[kItems], sum = 0.f;
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    y[u] = in[u] ? v[u] - k : 0.f;
    sum += y[u];
  }
  const float count = static_cast<float>(in_count);
  const float mean = sum * approx_rcp(fmaxf(count, 1.f));  // relative to k; an empty chunk's: 0, with no weight
  float m2 = 0.f;
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    const float d = in[u] ? y[u] - mean : 0.f;
    m2 = fmaf(d, d, m2);
  }
  const float n = mo.n + count;
  const float delta = mean - mo.mu;
  mo.mu += delta * (count * approx_rcp(fmaxf(n, 1.f)));
  mo.m2 += m2 + delta * (mean - mo.mu) * count;  // delta^2 * n_old * count / n: mean - new mu = delta * n_old / n
  mo.n = n;
  mo.k = k;
}

// x·scale and the mask at elements t0 .. t0 + kItems - 1 that lie in [0, N), element by element (a partial chunk:
// zeros, masked out, outside); returns how many are masked in.
template <typename T>
__device__ __forceinline__ int load_partial(const T* __restrict__ x, const uint8_t* __restrict__ mask, int64_t t0,
                                            int64_t N, float scale, float (&v)[kItems], bool (&in)[kItems]) {
  int count = 0;
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    const int64_t i = t0 + u;
    const bool inside = i >= 0 && i < N;
    v[u] = inside ? to_float(x[i]) * scale : 0.f;
    in[u] = inside && mask[i] != 0;
    count += in[u];
  }
  return count;
}

// The moments of the masked-in x·scale, merged over the block. The elements from `head` on (mask + head is 8-byte
// aligned) are cut into whole chunks of kItems (chunk c: elements head + kItems·c ..), taken by the block's threads
// at c = first, first + stride, ...: a whole chunk's mask is one 8-byte load, its x one or two 16-byte loads with
// kVec (x + head 16-byte aligned), else kItems loads (a warp reads 32 consecutive chunks). The partial chunks -- the
// `head` elements before the first whole one (first == 0 takes them) and the last < kItems after the last (the
// thread whose c reaches the count of whole chunks) -- are read element by element. A thread's chunks up to its
// first masked-in value (its pivot) are read by a loop of their own that only looks for it, so that the main loop
// does not.
template <bool kVec, typename T>
__device__ Moments block_moments(const T* __restrict__ x, const uint8_t* __restrict__ mask, int64_t head,
                                 int64_t first, int64_t stride, int64_t N, float scale) {
  Moments mo{0.f, 0.f, 0.f, 0.f};
  float v[kItems];
  bool in[kItems];
  const int64_t whole = N > head ? (N - head) / kItems : 0;
  int64_t c = first;
  const T* xc = x + head + first * kItems;  // chunk c's elements
  const uint8_t* mc = mask + head + first * kItems;
  const int64_t step = stride * kItems;
  auto load_whole = [&]() {
    const int count = load8_mask<true>(mc, 0, kItems, in);  // n = kItems: all inside (no bounds checks)
    load8<kVec>(xc, 0, kItems, v);
#pragma unroll
    for (int u = 0; u < kItems; ++u) v[u] *= scale;  // read whether masked in or not: selected away where not
    return count;
  };
  for (; c < whole; c += stride, xc += step, mc += step) {  // the pivot
    if (load_whole() > 0) {
#pragma unroll
      for (int u = kItems - 1; u >= 0; --u) mo.k = in[u] ? v[u] : mo.k;
      break;  // its chunk is read again below (from L1) and added with the rest
    }
  }
  for (; c < whole; c += stride, xc += step, mc += step) {
    const int count = load_whole();
    add_chunk<true>(mo, v, in, count);
  }
  if (c == whole && head + whole * kItems < N) {
    const int count = load_partial(x, mask, head + whole * kItems, N, scale, v, in);
    add_chunk<false>(mo, v, in, count);
  }
  if (first == 0 && head > 0) {
    const int count = load_partial(x, mask, head - kItems, N, scale, v, in);
    add_chunk<false>(mo, v, in, count);
  }
  return block_merge(mo);
}

// Where the statistics pass's whole chunks start: the first element at which the mask is 8-byte aligned.
inline int whiten_head(const uint8_t* mask) {
  return static_cast<int>((8 - reinterpret_cast<uintptr_t>(mask) % 8) % 8);
}

// Thread 0 writes the block's moments to its slot of `part` ([num_parts, 4]: count, pivot, mean - pivot, M2).
__device__ __forceinline__ void publish(float* part, const Moments& mo) {
  if (threadIdx.x == 0) {
    part[4 * blockIdx.x + 0] = mo.n;
    part[4 * blockIdx.x + 1] = mo.k;
    part[4 * blockIdx.x + 2] = mo.mu;
    part[4 * blockIdx.x + 3] = mo.m2;
  }
}

// The partial moments merged by one block's threads (thread j takes parts j, j + blockDim, ..., then block_merge):
// one fixed order, so every block that runs it gets the same bits. Read through L2 (__ldcg), never a stale L1 line:
// the fused kernel writes `part` again during its rescue, after every block has read it once.
__device__ Moments merge_parts(const float* part, int num_parts) {
  Moments mo{0.f, 0.f, 0.f, 0.f};
  for (int j = threadIdx.x; j < num_parts; j += blockDim.x)
    mo = merge(mo, Moments{__ldcg(part + 4 * j), __ldcg(part + 4 * j + 1), __ldcg(part + 4 * j + 2),
                           __ldcg(part + 4 * j + 3)});
  return block_merge(mo);
}

// Rescue: float32 squares overflow past deviations of ~1.8e19 (and merges of means ~1e15 apart over ~1e9
// entries), leaving the mean or M2 inf/NaN; then x is read once more to form the moments of x·2^-100 (exact
// scaling; the deviations that overflowed stay far above float32's smallest normal there). Finite data never takes
// it; masked-in NaN/inf do, and give NaN as before.
constexpr float kRescueDown = 0x1p-100f, kRescueUp = 0x1p100f;

__device__ __forceinline__ bool overflowed(const Moments& mo) { return !isfinite(mo.k + mo.mu) || !isfinite(mo.m2); }

// The output of value v from the merged moments of x·scale: ((v·scale - k) - mu)·rstd, plus the mean where it is
// kept (shift_mean false). Both paths normalise through these two.
struct Normalisation {
  float scale, k, mu, rstd, mean;
  bool shift_mean;
};

__device__ __forceinline__ Normalisation normalisation(const Moments& mo, float scale, float eps, bool shift_mean) {
  const float var = mo.n > 1.f ? mo.m2 / (mo.n - 1.f) : 0.f;
  const float rstd = rsqrtf(var + eps * scale * scale);  // the rescue's eps·2^-200 is 0: negligible beside var
  const float mean = (mo.k + mo.mu) * (scale == 1.f ? 1.f : kRescueUp);  // rounded only where added back
  return {scale, mo.k, mo.mu, rstd, mean, shift_mean};
}

__device__ __forceinline__ float normalise(const Normalisation& z, float v) {
  const float y = ((v * z.scale - z.k) - z.mu) * z.rstd;
  return z.shift_mean ? y : y + z.mean;
}

// ---------------------------------------------------------------- the fused path: one cooperative kernel

// out = normalise(x) over the chunks block_moments gave this thread (whole chunks first, first + stride, ...; the
// partial chunks before the first and after the last whole one element by element): the values it has just read,
// from L1 or L2. A whole chunk: one (16-bit) or two (float32) 16-byte loads and two 16-byte stores; x + head and
// out + head are 16-byte aligned (whiten_fusable), so the stores of a warp's 32 consecutive chunks are 1 KiB of
// whole sectors.
template <typename T>
__device__ void apply_chunks(const T* __restrict__ x, float* __restrict__ out, int64_t head, int64_t first,
                             int64_t stride, int64_t N, const Normalisation& z) {
  const int64_t whole = N > head ? (N - head) / kItems : 0;
  int64_t c = first;
#pragma unroll 1  // unrolled, nvcc computes the trip count by a 64-bit division call; each chunk is 4 loads in flight
  for (; c < whole; c += stride) {
    const int64_t t0 = head + c * kItems;
    float v[kItems];
    load8<true>(x, t0, N, v);
    float4* o = reinterpret_cast<float4*>(out + t0);
    o[0] = make_float4(normalise(z, v[0]), normalise(z, v[1]), normalise(z, v[2]), normalise(z, v[3]));
    o[1] = make_float4(normalise(z, v[4]), normalise(z, v[5]), normalise(z, v[6]), normalise(z, v[7]));
  }
  if (c == whole) {  // the one thread whose chunks reach the count of whole chunks: the last partial one
#pragma unroll 1
    for (int64_t i = head + whole * kItems; i < N; ++i) out[i] = normalise(z, to_float(x[i]));
  }
  if (first == 0) {  // the head before the first whole chunk
#pragma unroll 1
    for (int64_t i = 0; i < head && i < N; ++i) out[i] = normalise(z, to_float(x[i]));
  }
}

// The whole op in one launch of num_parts blocks, all resident at once (a cooperative launch): the partial moments
// of the block's chunks into `part`, a grid barrier, every block merging all of them (merge_parts: the same result
// in every block, so every block takes the rescue or none; the rescue is the grid's, its first pass again at
// 2^-100 between two more barriers), then the block's own chunks normalised. DRAM sees x and the mask read once and
// the output written once (the second read of x hits L1/L2: a block's share of 16 MiB over 792 blocks is 21 KiB);
// the three passes read x twice and pay two more launches and a one-block merge between them (an H200, B=1024
// T=4096 float32, under ncu: 10.3 + 4.2 + 9.9 us).
// (5 blocks an SM: ptxas then takes 48 registers on sm_80 and sm_90 with no spill; left to itself it took 40 on sm_90
// but squeezed sm_80 into 32 with a spill)
template <typename T>
__global__ void __launch_bounds__(kWhitenThreads, 5)
    whiten_fused_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask, float* __restrict__ out,
                        float* part, int64_t N, int head, float eps, bool shift_mean) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int num_parts = static_cast<int>(gridDim.x);
  publish(part, block_moments<true>(x, mask, head, first, stride, N, 1.f));
  grid_sync();
  Moments mo = merge_parts(part, num_parts);
  float scale = 1.f;
  if (overflowed(mo)) {
    grid_sync();  // every block has read the partials before any block overwrites its own
    publish(part, block_moments<true>(x, mask, head, first, stride, N, kRescueDown));
    grid_sync();
    mo = merge_parts(part, num_parts);
    scale = kRescueDown;
  }
  apply_chunks(x, out, head, first, stride, N, normalisation(mo, scale, eps, shift_mean));
}

// ---------------------------------------------------------------- the three passes

template <typename T, bool kVec>
__global__ void __launch_bounds__(kWhitenThreads)
    whiten_partial_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask, float* __restrict__ part,
                          int64_t N, int head) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  publish(part,
          block_moments<kVec>(x, mask, head, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, stride, N,
                              1.f));
}

// One block: the partials merged into stats[5] = (count, k, mean - k, M2, scale), the moments of x·scale; the
// rescue (see kRescueDown) by this block alone.
template <typename T>
__global__ void __launch_bounds__(kWhitenThreads)
    whiten_merge_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask, const float* __restrict__ part,
                        float* __restrict__ stats, int num_parts, int64_t N, int head) {
  Moments mo = merge_parts(part, num_parts);
  float scale = 1.f;
  if (overflowed(mo)) {  // the same on every thread: block_merge's result is shared
    mo = block_moments<false>(x, mask, head, threadIdx.x, blockDim.x, N, kRescueDown);
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

// The apply pass's grid-stride loop takes kUnroll strides per iteration: every load of the group is issued before
// the first value is used, so a thread has kUnroll in flight. With one stride per iteration each iteration waited
// for the last: on an H200 the statistics pass, written that way then, moved its bytes at 38 % of the DRAM bandwidth
// (Nsight Compute, B=1024 T=4096 float32).
constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kWhitenThreads)
    whiten_apply_kernel(const T* __restrict__ x, float* __restrict__ out, const float* __restrict__ stats, int64_t N,
                        float eps, bool shift_mean) {
  const Normalisation z = normalisation(Moments{stats[0], stats[1], stats[2], stats[3]}, stats[4], eps, shift_mean);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < N; i += kUnroll * stride) {  // kUnroll loads in flight (see kUnroll)
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = to_float(x[i + u * stride]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) out[i + u * stride] = normalise(z, v[u]);
  }
  for (; i < N; i += stride) out[i] = normalise(z, to_float(x[i]));
}

// ---------------------------------------------------------------- host side

// Whether the fused kernel takes these pointers: its whole chunks start 16-byte aligned in x (its loads) and in out
// (its stores). Contiguous tensors from the caching allocator at offset 0 always do.
template <typename T>
inline bool whiten_fusable(const T* x, const uint8_t* mask, const float* out) {
  const int head = whiten_head(mask);
  return reinterpret_cast<uintptr_t>(x + head) % 16 == 0 && reinterpret_cast<uintptr_t>(out + head) % 16 == 0;
}

// The fused kernel, num_parts blocks, on `launch_cooperative(kernel, blocks, args...)` (a launch of kWhitenThreads
// threads per block with every block resident at once; returns whether it launched). False, with nothing run, where
// the pointers do not suit it (whiten_fusable) or the launch was refused: then the passes do the work.
template <typename T, typename LaunchCooperative>
bool whiten_fused(const T* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N, float eps,
                  bool shift_mean, LaunchCooperative launch_cooperative) {
  if (!whiten_fusable(x, mask, out)) return false;
  return launch_cooperative(whiten_fused_kernel<T>, num_parts, x, mask, out, part, N, whiten_head(mask), eps,
                            shift_mean);
}

// The three passes in order on `launch(kernel, blocks, args...)` (a kernel launch of kWhitenThreads threads per block
// on one stream, or the emulator's): `part` holds [num_parts, 4] partial moments, then the [5] merged statistics.
template <typename T, typename Launch>
void whiten_passes(const T* x, const uint8_t* mask, float* out, float* part, int num_parts, int64_t N, float eps,
                   bool shift_mean, Launch launch) {
  float* stats = part + 4 * num_parts;
  const int head = whiten_head(mask);
  const bool vec = reinterpret_cast<uintptr_t>(x + head) % 16 == 0;  // x and mask offset alike from aligned bases
  launch(vec ? whiten_partial_kernel<T, true> : whiten_partial_kernel<T, false>, num_parts, x, mask, part, N, head);
  launch(whiten_merge_kernel<T>, 1, x, mask, static_cast<const float*>(part), stats, num_parts, N, head);
  launch(whiten_apply_kernel<T>, num_parts, x, out, static_cast<const float*>(stats), N, eps, shift_mean);
}
