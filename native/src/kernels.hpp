// Writing a packed allowed-token bitmask into a logits row in place (CPU).
//
// Memory-bound like logits.fill_(-inf): a word with no allowed token becomes 32 stores of the
// -inf bit pattern, a word with all tokens allowed is skipped, mixed words go bit by bit.
#pragma once

#include <cstdint>

namespace mo {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

template <typename T>
inline void apply_row(T* __restrict logits, const uint32_t* __restrict mask, int64_t cols, T neg_inf) {
  const int64_t full = cols / 32;
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t bits = mask[w];
    if (bits == 0xFFFFFFFFu) continue;
    T* p = logits + w * 32;
    if (bits == 0) {
      for (int j = 0; j < 32; ++j) p[j] = neg_inf;
    } else {
      for (int j = 0; j < 32; ++j)
        if (!((bits >> j) & 1u)) p[j] = neg_inf;
    }
  }
  const int64_t rest = cols - full * 32;
  if (rest) {
    const uint32_t bits = mask[full];
    T* p = logits + full * 32;
    for (int64_t j = 0; j < rest; ++j)
      if (!((bits >> j) & 1u)) p[j] = neg_inf;
  }
}

// logits: rows of `cols` elements, `row_stride` elements apart; mask: rows of `mask_stride` words.
// Defined in kernels.cpp with an AVX2 clone picked at load time (the wheel stays portable).
void apply_rows(void* logits, int dtype, int64_t row_begin, int64_t row_end, int64_t cols, int64_t row_stride,
                const uint32_t* mask, int64_t mask_stride);

}  // namespace mo
