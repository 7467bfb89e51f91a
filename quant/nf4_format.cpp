#include "quant/nf4_format.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "quant/nf4_dtype.h"

namespace qlora::nf4 {

namespace {

// torchao's codebook exactly as its source writes it (Python floats, 4 decimals).
constexpr double kCodebookSource[kNumCodes] = {
    -1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
    0.0796,  0.1609,  0.2461,  0.3379,  0.4407,  0.5626,  0.7230,  1.0000};

std::array<float, kNumCodes> make_codebook(Dtype d) {
  std::array<float, kNumCodes> cb{};
  for (int i = 0; i < kNumCodes; ++i) cb[i] = round_to(d, static_cast<float>(kCodebookSource[i]));
  return cb;
}

// Total order of floats as integers, so we can binary-search over representable values.
int64_t order_key(float f) {
  const int32_t u = static_cast<int32_t>(float_to_bits(f));
  return u >= 0 ? int64_t{u} : -int64_t{u & 0x7fffffff};
}
float from_order_key(int64_t k) {
  return k >= 0 ? bits_to_float(static_cast<uint32_t>(k))
                : bits_to_float(static_cast<uint32_t>(-k) | 0x80000000u);
}

std::array<float, kNumCodes - 1> make_thresholds(Dtype d) {
  std::array<float, kNumCodes - 1> t{};
  if (d == Dtype::F32) {
    // Smallest float v in (cb[k], cb[k+1]] whose code is > k; the code is monotone in v.
    const auto& cb = codebook(d);
    for (int k = 0; k < kNumCodes - 1; ++k) {
      int64_t lo = order_key(cb[k]), hi = order_key(cb[k + 1]);  // code(lo) <= k < code(hi)
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        (nearest_code_reference(d, from_order_key(mid)) > k ? hi : lo) = mid;
      }
      t[k] = from_order_key(hi);
    }
    return t;
  }
  // 16-bit dtypes: walk every representable value in [-1, 1] in increasing order.
  std::vector<float> values;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float v = load_as_float(d, &bits, 0);
    if (v >= -1.0f && v <= 1.0f && !(v == 0.0f && std::signbit(v))) values.push_back(v);
  }
  std::sort(values.begin(), values.end());
  int code = 0;
  for (float v : values) {
    const int c = nearest_code_reference(d, v);
    if (c < code) throw std::logic_error("nf4: code is not monotone in v");
    while (code < c) t[code++] = v;
  }
  if (code != kNumCodes - 1) throw std::logic_error("nf4: not every code is reachable");
  return t;
}

}  // namespace

const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::BF16: return "bfloat16";
    case Dtype::F16: return "float16";
    default: return "float32";
  }
}

Layout Layout::make(int64_t numel, int64_t block_size, int64_t scaler_block_size) {
  if (numel < 1) throw std::invalid_argument("nf4: cannot quantize an empty tensor");
  if (block_size < 2 || block_size % 2 != 0)
    throw std::invalid_argument("nf4: block_size must be even and >= 2, got " +
                                std::to_string(block_size));
  if (scaler_block_size < 1)
    throw std::invalid_argument("nf4: scaler_block_size must be >= 1, got " +
                                std::to_string(scaler_block_size));
  Layout l;
  l.numel = numel;
  l.block_size = block_size;
  l.scaler_block_size = scaler_block_size;
  const int64_t g = l.group_numel();
  l.padded_numel = (numel + g - 1) / g * g;
  return l;
}

const std::array<float, kNumCodes>& codebook(Dtype d) {
  static const std::array<float, kNumCodes> f32 = make_codebook(Dtype::F32);
  static const std::array<float, kNumCodes> bf16 = make_codebook(Dtype::BF16);
  static const std::array<float, kNumCodes> f16 = make_codebook(Dtype::F16);
  return d == Dtype::BF16 ? bf16 : d == Dtype::F16 ? f16 : f32;
}

uint8_t nearest_code_reference(Dtype d, float v) {
  const auto& cb = codebook(d);
  uint8_t best = 0;
  float best_diff = round_to(d, std::fabs(v - cb[0]));
  for (int i = 1; i < kNumCodes; ++i) {
    const float diff = round_to(d, std::fabs(v - cb[i]));
    if (diff < best_diff) {  // strict: the first index wins ties, as torch's min(dim) does
      best_diff = diff;
      best = static_cast<uint8_t>(i);
    }
  }
  return best;
}

const std::array<float, kNumCodes - 1>& code_thresholds(Dtype d) {
  static const auto f32 = make_thresholds(Dtype::F32);
  static const auto bf16 = make_thresholds(Dtype::BF16);
  static const auto f16 = make_thresholds(Dtype::F16);
  return d == Dtype::BF16 ? bf16 : d == Dtype::F16 ? f16 : f32;
}

}  // namespace qlora::nf4
