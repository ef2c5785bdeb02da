// logits_policy_loss's CUDA kernel (ratio="token"): the logits read from DRAM once and d_logits written once.
//
// A thread block cluster per token row: block r of the cluster copies its chunk of the row (columns
// [r·chunk, min(V, (r+1)·chunk)), 16-byte vectors) into its shared memory while folding it into per-thread running
// statistics (max logit, Σ 2^u, Σ 2^u·u with u = (x - max)·log2(e)/T, the online log-sum-exp of softmax.py's
// _online_row_stats); the block's statistics are merged across its threads, published in its shared memory and,
// after a cluster barrier, merged by every block of the cluster over all ranks in rank order (the same bits in
// every block), the label's logit read from the shared memory of the block that holds it. Every block then forms
// the token's loss term and its coefficients dL/dlogp and dL/dentropy (the policy kernel's per-token math,
// losses._token_policy_terms, times the sequence's aggregation weight) and, after a second cluster barrier (no
// block's shared memory is read after it), writes its chunk's d_logits from its shared memory. DRAM traffic: the
// logits once, d_logits once: the two-pass memory bound. A row of V = 151936 bf16 (297 KB) is 4 blocks of 74 KB.
//
// The same per-row semantics as the Triton one-kernel row (fused_policy._logits_policy_kernel): ignored rows
// (label == ignore_index) read nothing and give 0; a label outside [0, V) gives NaN log-prob, entropy and
// gradient; a NaN or +inf logit poisons its row; rows whose coefficients are 0 (masked out, clipped, ignored) get
// d_logits exactly 0 whatever their logits hold. The host (logits_policy_cuda.cu) launches it only where every
// row start, the chunk boundaries and d_logits' rows are 16-byte aligned (V a multiple of 16 / sizeof(T)).
//
// Includes nothing: the includer provides vector_loads.h (widen2), int64_t, uint4, __half, __nv_bfloat16,
// to_float(T), from_float(float, T*) (round to nearest), __uint_as_float, exp2f, log1pf, expf, expm1f, fabsf,
// fmaxf, fminf, __shfl_xor_sync, __syncthreads, __shared__, and the cluster: cluster_sync() (a barrier of every
// thread of the cluster, shared memory writes before it visible after it), cluster_rank(), cluster_remote(p, rank)
// (the address of p's counterpart in the shared memory of the cluster's block `rank`) and dynamic_shared() (this
// block's dynamic shared memory, 16-byte aligned) -- nvcc's own (logits_policy_cuda.cu) or tests/cuda_emulated/'s.
#pragma once

constexpr int kLogitsThreads = 256;  // threads of a block
constexpr int kLogitsUnroll = 4;  // 16-byte loads a thread keeps in flight in the copy loop
constexpr int kPolicySlots = 8;  // losses.NSLOTS: mask, loss, clipped, -log-ratio, ratio, kl, entropy, values
constexpr float kLowest = -3.4028234663852886e38f;  // a running max that has seen nothing
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
// The cluster of a row: the fewest blocks (at most kLogitsMaxRanks, a portable cluster) whose chunks of whole 16-byte
// vectors hold at most kLogitsMaxChunkBytes each, so that at least two blocks fit an SM's 227 KB of shared memory
// (one loads its chunk while another writes its d_logits). ranks = 0: the row is too long (or V not a multiple of
// 16 / elem_bytes): not this kernel.
constexpr int kLogitsMaxChunkBytes = 80 * 1024;
constexpr int kLogitsMaxRanks = 8;
struct LogitsPlan {
  int ranks = 0, chunk = 0;  // blocks per row, columns per block
  int shared_bytes = 0;  // dynamic shared memory of a block: the chunk, then its published statistics
};
inline LogitsPlan logits_policy_plan(int elem_bytes, int64_t V, int max_chunk_bytes = kLogitsMaxChunkBytes) {
  LogitsPlan plan;
  const int vec = 16 / elem_bytes;
  if (V <= 0 || V % vec != 0) return plan;
  const int64_t vectors = V / vec;
  for (int ranks = 1; ranks <= kLogitsMaxRanks; ++ranks) {
    const int64_t per_block = (vectors + ranks - 1) / ranks;
    if (per_block * 16 <= max_chunk_bytes) {
      plan.ranks = static_cast<int>((vectors + per_block - 1) / per_block);
      plan.chunk = static_cast<int>(per_block * vec);
      plan.shared_bytes = static_cast<int>(per_block * 16 + 16);
      return plan;
    }
  }
  return plan;
}

enum KlEstimator { kKlK1 = 0, kKlK2 = 1, kKlK3 = 2, kKlAbs = 3 };  // reference.KL_ESTIMATORS' order

template <typename T>
struct LogitsPolicyArgs {
  const T* logits;  // rows at (row / inner)·stride_outer + (row % inner)·stride_inner elements, unit last stride
  const int64_t* labels;  // [N]
  const float* old_logp;  // [N] (not read when on_policy)
  const float* adv;  // [N]
  const float* ref_logp;  // [N] (read only when has_ref)
  const uint8_t* mask;  // [N] 0/1
  const float* weight;  // [B] each sequence's aggregation weight (row / T)
  float* logp;  // [N] out
  float* entropy;  // [N] out (0 unless has_entropy)
  float* part;  // [N, kPolicySlots] out: the token's sums, the loss already times its weight
  T* d_logits;  // [N, V] out, contiguous (not written unless write_grad)
  int64_t stride_outer, stride_inner, inner, T_len, V;
  int64_t ignore_index;
  int chunk;  // columns of a block (a multiple of 16 / sizeof(T)); the cluster has ceil(V / chunk) blocks
  int ranks;  // blocks of a cluster
  float inv_temp, ratio_min, ratio_max, dual_clip, kl_coef, entropy_coef;  // dual_clip inf when off
  bool on_policy, has_ref, has_entropy, entropy_grad, write_grad;
  int kl_estimator;  // KlEstimator
};

// A thread's (or a block's) online statistics of some logits, base 2: max x, Σ 2^u and Σ 2^u·u, u = (x - m)·c
struct RowStats {
  float m = kLowest, s = 0.f, w = 0.f;
};

// u = (x - m)·c clamped below at -1e4 (2^u is 0 there either way, and 2^u·u stays 0·finite at a -inf logit); NaN
// stays NaN (a comparison, not fmaxf, which would drop it)
__device__ __forceinline__ float shifted_exponent(float x, float m, float c) {
  const float u = (x - m) * c;
  return u < -1.0e4f ? -1.0e4f : u;
}

// Re-centre stats on a max m_new >= st.m: Σ 2^u' u' = α(w + step·s), α = 2^step, step = (m - m_new)·c
__device__ __forceinline__ void recentre(RowStats& st, float m_new, float c) {
  const float step = fmaxf((st.m - m_new) * c, -1.0e4f);
  const float alpha = exp2f(step);
  st.w = alpha * (st.w + step * st.s);
  st.s = alpha * st.s;
  st.m = m_new;
}

// Fold `count` logits x[0..count) (float32) into st
template <int count>
__device__ __forceinline__ void fold(RowStats& st, const float (&x)[count], float c) {
  float m_new = st.m;
#pragma unroll
  for (int k = 0; k < count; ++k) m_new = fmaxf(m_new, x[k]);
  recentre(st, m_new, c);
#pragma unroll
  for (int k = 0; k < count; ++k) {
    const float u = shifted_exponent(x[k], m_new, c);
    const float e = exp2f(u);
    st.s += e;
    st.w += e * u;
  }
}

// A 16-byte vector of T as floats, and back (round to nearest)
__device__ __forceinline__ void widen(const uint4 v, const float*, float (&x)[4]) {
  x[0] = __uint_as_float(v.x), x[1] = __uint_as_float(v.y), x[2] = __uint_as_float(v.z), x[3] = __uint_as_float(v.w);
}
template <typename H>  // __half or __nv_bfloat16: vector_loads.h's widen2, from registers (no 16-bit loads)
__device__ __forceinline__ void widen(const uint4 v, const H* type, float (&x)[8]) {
  widen2(v.x, type, x[0], x[1]);
  widen2(v.y, type, x[2], x[3]);
  widen2(v.z, type, x[4], x[5]);
  widen2(v.w, type, x[6], x[7]);
}
template <typename T, int count>
__device__ __forceinline__ uint4 narrow(const float (&g)[count]) {
  uint4 v;
  T* out = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int k = 0; k < count; ++k) from_float(g[k], out + k);
  return v;
}

// The block's statistics merged over its threads, in every thread: the block max first, then each thread's sums
// re-centred on it (softmax.py's merge of its tile rows). `scratch`: kLogitsThreads / 32 RowStats.
__device__ __forceinline__ RowStats block_stats(RowStats st, float c, RowStats* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float m = st.m;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if (lane == 0) scratch[warp].m = m;
  __syncthreads();
  m = scratch[0].m;
#pragma unroll
  for (int k = 1; k < kLogitsThreads / 32; ++k) m = fmaxf(m, scratch[k].m);
  const float step = fmaxf((st.m - m) * c, -1.0e4f);
  const float f = exp2f(step);
  float s = f * st.s, w = f * (st.w + step * st.s);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, d);
    w += __shfl_xor_sync(0xffffffffu, w, d);
  }
  __syncthreads();  // every thread has read the maxima before they are overwritten
  if (lane == 0) scratch[warp].s = s, scratch[warp].w = w;
  __syncthreads();
  RowStats out;
  out.m = m, out.s = 0.f, out.w = 0.f;
#pragma unroll
  for (int k = 0; k < kLogitsThreads / 32; ++k) out.s += scratch[k].s, out.w += scratch[k].w;
  __syncthreads();  // the scratch may be reused
  return out;
}

// The KL estimate of d = logp - ref and its derivative in logp (losses._kl_and_grad)
__device__ __forceinline__ void kl_and_grad(float d, int estimator, float& kl, float& g) {
  if (estimator == kKlK1) {
    kl = d, g = 1.f;
  } else if (estimator == kKlK2) {
    kl = 0.5f * d * d, g = d;
  } else if (estimator == kKlK3) {
    const float e = expf(-d);
    // Σ_k c_k d^k by Horner, c_k = (-1)^k / (k + 2)!, k = 0..8 (losses._K3_COEFFS, below |d| = 1: _K3_BELOW)
    float t = 1.f / 3628800;
    t = t * d - 1.f / 362880, t = t * d + 1.f / 40320, t = t * d - 1.f / 5040, t = t * d + 1.f / 720;
    t = t * d - 1.f / 120, t = t * d + 1.f / 24, t = t * d - 1.f / 6, t = t * d + 0.5f;
    const bool small = fabsf(d) < 1.f;
    kl = small ? d * d * t : e + d - 1.f;
    g = small ? d - kl : 1.f - e;
  } else {
    kl = fabsf(d), g = d > 0.f ? 1.f : (d < 0.f ? -1.f : 0.f);
  }
}

// One token's policy terms (losses._token_policy_terms with the token ratio, then the entropy bonus), from inputs
// already 0 where m == 0. Returns the loss term x; sets g = dx/dlogp (times m), and the metrics.
__device__ __forceinline__ float token_policy(float lp, float old, float adv, float m, float ref, float e,
                                              const float ratio_min, const float ratio_max, const float dual_clip,
                                              const float kl_coef, const float entropy_coef, bool has_ref,
                                              bool has_entropy, int estimator, float& g, float& log_ratio, float& r,
                                              float& clipped, float& kl) {
  log_ratio = lp - old;
  r = expf(log_ratio);
  // the clipped surrogate max(-A·r, -A·clip(r)), the unclipped branch on ties; the dual clip where A < 0
  const float r_clipped = fminf(fmaxf(r, ratio_min), ratio_max);
  const float pg_unclipped = -adv * r, pg_clipped = -adv * r_clipped;
  const bool is_clipped = pg_clipped > pg_unclipped;
  float pg = is_clipped ? pg_clipped : pg_unclipped;
  float dpg = is_clipped ? 0.f : -adv;
  const float dual_bound = (adv < 0.f ? -adv : 1.f) * dual_clip;  // never 0·inf
  const bool dual = adv < 0.f && dual_bound < pg;
  pg = dual ? dual_bound : pg;
  dpg = dual ? 0.f : dpg;
  clipped = is_clipped ? 1.f : 0.f;
  float x = pg;
  g = (dpg == 0.f ? 0.f : dpg * r) * m;  // exactly 0 where the clip set the value (r may be inf there)
  kl = 0.f;
  if (has_ref) {
    float dkl;
    kl_and_grad(lp - ref, estimator, kl, dkl);
    x += kl_coef * kl;
    g += kl_coef * dkl * m;
  }
  if (has_entropy) x -= entropy_coef * e;
  return x;
}

template <typename T>
__global__ void __launch_bounds__(kLogitsThreads) logits_policy_kernel(const LogitsPolicyArgs<T> a) {
  constexpr int kVec = 16 / sizeof(T);  // logits per 16-byte vector
  using Lanes = float[kVec];
  __shared__ RowStats scratch[kLogitsThreads / 32];
  const int rank = cluster_rank();
  const int64_t row = blockIdx.x / a.ranks;
  const int64_t col0 = static_cast<int64_t>(rank) * a.chunk;
  const int64_t left = a.V - col0;
  const int vectors = static_cast<int>((left < a.chunk ? (left > 0 ? left : 0) : a.chunk) / kVec);  // of this block
  // the block's shared memory: its chunk of the row, then its published statistics (RowStats)
  uint4* held = static_cast<uint4*>(dynamic_shared());
  RowStats* published = reinterpret_cast<RowStats*>(held + a.chunk / kVec);
  const T* row_ptr = a.logits + (row / a.inner) * a.stride_outer + (row % a.inner) * a.stride_inner;
  const uint4* source = reinterpret_cast<const uint4*>(row_ptr + col0);
  const int64_t label = a.labels[row];
  const bool valid = label != a.ignore_index;
  const bool in_range = label >= 0 && label < a.V;
  const float c = a.inv_temp * kLog2e;

  // 1. copy the chunk into shared memory, folding it into this thread's statistics (ignored rows read nothing)
  RowStats st;
  if (valid) {
    int i = threadIdx.x;
    for (; i + (kLogitsUnroll - 1) * kLogitsThreads < vectors; i += kLogitsUnroll * kLogitsThreads) {
      uint4 v[kLogitsUnroll];
#pragma unroll
      for (int k = 0; k < kLogitsUnroll; ++k) v[k] = source[i + k * kLogitsThreads];
#pragma unroll
      for (int k = 0; k < kLogitsUnroll; ++k) {
        held[i + k * kLogitsThreads] = v[k];
        Lanes x;
        widen(v[k], static_cast<const T*>(nullptr), x);
        fold(st, x, c);
      }
    }
    for (; i < vectors; i += kLogitsThreads) {
      const uint4 v = source[i];
      held[i] = v;
      Lanes x;
      widen(v, static_cast<const T*>(nullptr), x);
      fold(st, x, c);
    }
  }
  const RowStats mine = block_stats(st, c, scratch);
  if (threadIdx.x == 0) *published = mine;
  cluster_sync();  // every block's statistics and chunk are in its shared memory

  // 2. the row's statistics from every rank (rank order: the same bits in every block), the label's logit
  RowStats row_st;
  for (int r = 0; r < a.ranks; ++r) row_st.m = fmaxf(row_st.m, cluster_remote(published, r)->m);
  float s = 0.f, w = 0.f;
  for (int r = 0; r < a.ranks; ++r) {
    const RowStats p = *cluster_remote(published, r);
    const float step = fmaxf((p.m - row_st.m) * c, -1.0e4f);
    const float f = exp2f(step);
    s += f * p.s;
    w += f * (p.w + step * p.s);
  }
  float x_y = 0.f;
  if (valid && in_range) {
    const int owner = static_cast<int>(label / a.chunk);
    const T* owner_row = reinterpret_cast<const T*>(cluster_remote(held, owner));
    x_y = to_float(owner_row[label - static_cast<int64_t>(owner) * a.chunk]);
  }
  cluster_sync();  // no block reads another's shared memory after this: any block may finish

  // the row's log-prob and entropy (softmax._row_forward)
  float x_max = row_st.m;
  w *= kLn2;  // base 2 -> natural: Σ e^(z - m)(z - m)
  if (!valid) s = 1.f;
  x_max = valid && x_max != -INFINITY && s != 0.f ? x_max : 0.f;  // a row of only -inf logits: shift 0
  const float log_s = log1pf(s - 1.f);  // s >= 1 (the max logit's own term is 1): exact near 1, no fast-math log
  float ent = log_s - w / s;
  const float logp_raw = (x_y - x_max) * a.inv_temp - log_s;
  float logp = logp_raw > 0.f ? 0.f : logp_raw;
  ent = ent < 0.f ? 0.f : ent;
  if (valid && !in_range) {  // a label out of [0, V): NaN, nothing raises on a GPU
    logp = ent = x_max = s = NAN;
  }
  if (!valid) logp = ent = 0.f;

  // 3. the token's loss term and coefficients, its inputs 0 where masked out
  const float m = a.mask[row] != 0 ? 1.f : 0.f;
  const bool keep = m != 0.f;
  const float lp = keep ? logp : 0.f;
  const float old = a.on_policy ? lp : (keep ? a.old_logp[row] : 0.f);
  const float adv = keep ? a.adv[row] : 0.f;
  const float ref = a.has_ref && keep ? a.ref_logp[row] : 0.f;
  const float e = keep ? ent : 0.f;
  float g, log_ratio, r, clipped, kl;
  const float x = token_policy(lp, old, adv, m, ref, e, a.ratio_min, a.ratio_max, a.dual_clip, a.kl_coef,
                               a.entropy_coef, a.has_ref, a.has_entropy, a.kl_estimator, g, log_ratio, r, clipped,
                               kl);
  const float weight = a.weight[row / a.T_len];
  if (rank == 0 && threadIdx.x == 0) {
    a.logp[row] = logp;
    a.entropy[row] = a.has_entropy ? ent : 0.f;
    float* part = a.part + row * kPolicySlots;
    part[0] = m, part[1] = weight * (x * m), part[2] = clipped * m, part[3] = -log_ratio * m, part[4] = r * m;
    part[5] = kl * m, part[6] = e * m, part[7] = 0.f;
  }
  if (!a.write_grad) return;

  // 4. d_logits of the chunk from shared memory (softmax._row_dlogits): 2^u (a + b·u), g_y at the label
  const float c_lp = valid ? weight * g : 0.f;
  const float c_ent = a.entropy_grad && valid ? weight * (-a.entropy_coef * m) : 0.f;
  uint4* out = reinterpret_cast<uint4*>(a.d_logits + row * a.V + col0);
  if (!(valid && (c_lp != 0.f || c_ent != 0.f))) {  // zeros, whatever the logits hold
    const uint4 zero = {0u, 0u, 0u, 0u};
    for (int i = threadIdx.x; i < vectors; i += kLogitsThreads) out[i] = zero;
    return;
  }
  const float inv_s = 1.f / s;
  const float p_y = expf(logp_raw);
  const float g_y = (c_lp * -expm1f(logp_raw) - c_ent * (p_y > 0.f ? p_y * (logp_raw + ent) : 0.f)) * a.inv_temp;
  const float ca = -(c_lp + c_ent * (ent - log_s)) * a.inv_temp * inv_s;
  const float cb = -c_ent * kLn2 * a.inv_temp * inv_s;
  for (int i = threadIdx.x; i < vectors; i += kLogitsThreads) {
    Lanes xv, gv;
    widen(held[i], static_cast<const T*>(nullptr), xv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float u = shifted_exponent(xv[k], x_max, c);
      gv[k] = exp2f(u) * (ca + cb * u);
    }
    out[i] = narrow<T>(gv);
  }
  // the label's entry, by the thread that wrote its vector (program order: this store lands after that one)
  const int64_t label_col = label - col0;
  if (valid && in_range && label_col >= 0 && label_col < static_cast<int64_t>(vectors) * kVec &&
      static_cast<unsigned>((label_col / kVec) % kLogitsThreads) == threadIdx.x) {
    from_float(g_y, a.d_logits + row * a.V + label);
  }
}
