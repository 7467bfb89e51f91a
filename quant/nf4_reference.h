// Scalar reference of NF4 quantize/dequantize on raw buffers: the definition every kernel
// (kernels/*_cpu.cpp, kernels/*.cu) is compared against. Slow and obviously correct; the
// arithmetic is spelled out in quant/nf4_format.h, the conversions are quant/nf4_dtype.h's.
#pragma once

#include <cstdint>

#include "quant/nf4_dtype.h"

namespace qlora::nf4 {

// absmax[b] (dtype d, layout.n_blocks() entries) = max |x| over block b; elements past
// layout.numel count as 0. Returns false if any of the numel inputs is NaN or Inf.
bool block_absmax_reference(Dtype d, const void* x, const Layout& layout, void* absmax);

// Double quantization: scalers (layout.n_blocks()) and factors (layout.n_groups(), dtype d)
// from the absmax scalers and their mean (a value of dtype d); groups [g_begin, g_end) only
// (g_end < 0: to the last group), so the CPU kernel can run it in parallel.
void double_quantize_reference(Dtype d, const void* absmax, float mean, const Layout& layout,
                               int8_t* scalers, void* factors, int64_t g_begin = 0,
                               int64_t g_end = -1);

// Packed codes (layout.code_bytes()): even element in the high nibble.
void quantize_codes_reference(Dtype d, const void* x, const void* absmax, const Layout& layout,
                              uint8_t* codes);

// The dequantized scaler of block b: (scalers[b] / factors[g]) + mean, rounded to d each op.
inline float dequantized_scaler(Dtype d, const int8_t* scalers, const void* factors, float mean,
                                const Layout& layout, int64_t b) {
  const float f = load_as_float(d, factors, b / layout.scaler_block_size);
  return round_to(d, round_to(d, static_cast<float>(scalers[b]) / f) + mean);
}

// out[i] for i < layout.numel in out_dtype: computed in d, then converted.
void dequantize_reference(Dtype d, Dtype out_dtype, const uint8_t* codes, const int8_t* scalers,
                          const void* factors, float mean, const Layout& layout, void* out);

}  // namespace qlora::nf4
