#include "kernels.hpp"
#include "clones.hpp"

namespace mo {


MO_CLONES void apply_rows(void* logits, int dtype, int64_t row_begin, int64_t row_end, int64_t cols,
                          int64_t row_stride, const uint32_t* mask, int64_t mask_stride) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint32_t* m = mask + r * mask_stride;
    switch (dtype) {
      case kFloat32:
        apply_row<uint32_t>(static_cast<uint32_t*>(logits) + r * row_stride, m, cols, 0xFF800000u);
        break;
      case kBFloat16:
        apply_row<uint16_t>(static_cast<uint16_t*>(logits) + r * row_stride, m, cols, uint16_t(0xFF80u));
        break;
      default:
        apply_row<uint16_t>(static_cast<uint16_t*>(logits) + r * row_stride, m, cols, uint16_t(0xFC00u));
        break;
    }
  }
}

}  // namespace mo
