// CPU NF4 kernels: threaded (ATen's parallel_for) and vectorized versions of the scalar
// reference in quant/nf4_reference.h, with the same signatures and bit-identical results.
// Argument checks live in the binding (src/qlora/ops/nf4_ops.cpp).
#pragma once

#include <cstdint>

#include "quant/nf4_format.h"

namespace qlora::kernels {

// Returns false if any input is NaN or Inf.
bool nf4_block_absmax_cpu(nf4::Dtype d, const void* x, const nf4::Layout& layout, void* absmax);
void nf4_double_quantize_cpu(nf4::Dtype d, const void* absmax, float mean,
                             const nf4::Layout& layout, int8_t* scalers, void* factors);
void nf4_quantize_codes_cpu(nf4::Dtype d, const void* x, const void* absmax,
                            const nf4::Layout& layout, uint8_t* codes);
void nf4_dequantize_cpu(nf4::Dtype d, nf4::Dtype out_dtype, const uint8_t* codes,
                        const int8_t* scalers, const void* factors, float mean,
                        const nf4::Layout& layout, void* out);
// One NF4 tensor's buffers as the kernels that decode it read them (storage dtype `dtype`).
struct Nf4Operand {
  nf4::Dtype dtype = nf4::Dtype::BF16;
  const uint8_t* codes = nullptr;
  const int8_t* scalers = nullptr;
  const void* factors = nullptr;
  float mean = 0.0f;
  nf4::Layout layout;
};

// Blocks [b0, b1) alone, as `out_dtype` (F32 or BF16), into out[0, (b1 - b0) * block_size): on the
// calling thread, the values nf4_dequantize_cpu gives them. For kernels that decode a tile at a time.
void nf4_dequantize_blocks_cpu(const Nf4Operand& w, nf4::Dtype out_dtype, int64_t b0, int64_t b1, void* out);

}  // namespace qlora::kernels
