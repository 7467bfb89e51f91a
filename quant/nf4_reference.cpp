#include "quant/nf4_reference.h"

#include <algorithm>
#include <cmath>

namespace qlora::nf4 {

bool block_absmax_reference(Dtype d, const void* x, const Layout& layout, void* absmax) {
  bool finite = true;
  for (int64_t b = 0; b < layout.n_blocks(); ++b) {
    float m = 0.0f;
    const int64_t end = std::min(layout.numel, (b + 1) * layout.block_size);
    for (int64_t i = b * layout.block_size; i < end; ++i) {
      const float v = std::fabs(load_as_float(d, x, i));
      finite &= std::isfinite(v);
      m = std::max(m, v);
    }
    store_from_float(d, absmax, b, m);
  }
  return finite;
}

void double_quantize_reference(Dtype d, const void* absmax, float mean, const Layout& layout,
                               int8_t* scalers, void* factors, int64_t g_begin,
                               int64_t g_end) {
  const int64_t n_real = layout.n_real_blocks();
  if (g_end < 0) g_end = layout.n_groups();
  for (int64_t g = g_begin; g < g_end; ++g) {
    const int64_t b0 = g * layout.scaler_block_size, b1 = b0 + layout.scaler_block_size;
    auto s_of = [&](int64_t b) {
      return b < n_real ? round_to(d, load_as_float(d, absmax, b) - mean) : 0.0f;
    };
    float smax = 0.0f;
    for (int64_t b = b0; b < b1; ++b) smax = std::max(smax, std::fabs(s_of(b)));
    // torchao: 256 / (2 * absmax) is evaluated as reciprocal(2 * absmax) * 256.
    const float recip = round_to(d, 1.0f / round_to(d, 2.0f * smax));
    const float factor = round_to(d, recip * 256.0f);
    store_from_float(d, factors, g, factor);
    for (int64_t b = b0; b < b1; ++b) {
      if (smax == 0.0f) {
        scalers[b] = 0;  // torchao would compute 0 * inf = NaN here
        continue;
      }
      const float q = std::nearbyint(round_to(d, s_of(b) * factor));
      scalers[b] = static_cast<int8_t>(std::clamp(q, -128.0f, 127.0f));
    }
  }
}

void quantize_codes_reference(Dtype d, const void* x, const void* absmax, const Layout& layout,
                              uint8_t* codes) {
  auto code_of = [&](int64_t i) -> uint8_t {
    if (i >= layout.numel) return kZeroCode;
    const float a = load_as_float(d, absmax, i / layout.block_size);
    if (a == 0.0f) return kZeroCode;
    return nearest_code_reference(d, round_to(d, load_as_float(d, x, i) / a));
  };
  for (int64_t j = 0; j < layout.code_bytes(); ++j)
    codes[j] = static_cast<uint8_t>(code_of(2 * j) << 4 | code_of(2 * j + 1));
}

void dequantize_reference(Dtype d, Dtype out_dtype, const uint8_t* codes, const int8_t* scalers,
                          const void* factors, float mean, const Layout& layout, void* out) {
  const auto& cb = codebook(d);
  for (int64_t i = 0; i < layout.numel; ++i) {
    const float s = dequantized_scaler(d, scalers, factors, mean, layout, i / layout.block_size);
    const uint8_t byte = codes[i / 2];
    const int code = (i % 2 == 0) ? byte >> 4 : byte & 15;
    const float v = round_to(d, cb[code] * s);
    store_from_float(out_dtype, out, i, round_to(out_dtype, v));
  }
}

}  // namespace qlora::nf4
