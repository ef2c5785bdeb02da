// How far apart in time the rows of one GAE tile walk (csrc/gae_tile.h's gae_row_tile), free of ATen so
// that bench/cpu_gae_rows.cpp measures the very rule the extension uses.
//
// A tile walks R rows side by side, row i running skew·i tokens behind row 0, so at any step row i's element
// sits i·(row_bytes - skew·token_bytes) bytes from row 0's in every array. Rows a multiple of 4 KiB apart (T = 1024,
// 2048, ... float32 tokens) put all R rows of the four float arrays into one 64-byte-line set of the L1 cache
// (bits 6-11 of the address; 4R lines in an 8- or 12-way set: a conflict miss per access), and rows 4 KiB + 64
// bytes apart do the same once skewed by 16 tokens (the fixed skew this replaced). Measured with
// bench/cpu_gae_rows.cpp (one thread, B = 64, R = 4, arrays whose bases agree modulo 4 KiB;
// bench/results/cpu-gae-rows-2026-11-24.txt): 1.32-1.61 ns per token wherever the rule's skew ran, 7.5-8.5 ns
// where all rows shared a set (T = 1024, 2048, 4096 unskewed; T = 1040, 2064, 4112 skewed by 16). So the skew
// is the smallest that puts the rows of each array pairwise a line apart modulo 4 KiB, 0 when they already are
// (a skewed walk costs ·skew idle steps). Inside torch the tensors' bases rarely agree modulo 4 KiB, and
// B = 64, T = 2048 or 2064 took 70-120 us on two threads with either skew: the rule makes that independent of where
// the allocator puts them.
#pragma once

#include <cstdint>

namespace rlkernels {

// whether rows i·(row_bytes - skew·token_bytes) bytes apart, i < rows, are pairwise at least a line apart modulo
// 4 KiB: then no two of them ever fall into one L1 set at once
inline bool gae_rows_spread(int64_t row_bytes, int64_t token_bytes, int64_t skew, int64_t rows) {
  constexpr int64_t kPage = 4096, kLine = 64;
  const int64_t step = ((row_bytes - skew * token_bytes) % kPage + kPage) % kPage;
  for (int64_t k = 1; k < rows; ++k) {  // rows i and i + k
    const int64_t d = k * step % kPage;
    if (d < kLine || d > kPage - kLine) return false;
  }
  return true;
}

// The skew (tokens) for a tile of `rows` rows: rewards and values rows rs0/vs0 bytes apart with tokens rs1/vs1
// bytes apart, float32 outputs of T tokens per row.
inline int64_t gae_row_skew(int64_t T, int64_t rs0, int64_t rs1, int64_t vs0, int64_t vs1, int64_t rows) {
  for (int64_t skew = 0; skew < 64; ++skew)
    if (gae_rows_spread(T * 4, 4, skew, rows) && gae_rows_spread(rs0, rs1, skew, rows) &&
        gae_rows_spread(vs0, vs1, skew, rows))
      return skew;
  return 16;  // strides no skew below 64 tokens spreads together: one line (of float32) per row
}

}  // namespace rlkernels
