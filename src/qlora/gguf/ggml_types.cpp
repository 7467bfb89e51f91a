#include "qlora/gguf/ggml_types.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cctype>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "qlora/gguf/kquants.h"

namespace qlora::gguf {
namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::F32, "f32", 1, 4, 0, "f32"},
    {GgmlType::F16, "f16", 1, 2, 1, "f16"},
    {GgmlType::BF16, "bf16", 1, 2, 32, "bf16"},
    {GgmlType::Q8_0, "q8_0", 32, 34, 7, "q8_0"},
    {GgmlType::Q4_0, "q4_0", 32, 18, 2, "q4_0"},
    {GgmlType::Q4_K, "q4_K", 256, 144, 15, "q4_k_m"},
    {GgmlType::Q5_K, "q5_K", 256, 176, 17, "q5_k_m"},
    {GgmlType::Q6_K, "q6_K", 256, 210, 18, "q6_k"},
    {GgmlType::Q5_0, "q5_0", 32, 22, 8, nullptr},
    {GgmlType::Q5_1, "q5_1", 32, 24, 9, nullptr},
    {GgmlType::MXFP4, "mxfp4", 32, 17, 38, nullptr},
};

void put_half(float v, uint8_t* out) {
  const uint16_t bits = c10::Half(v).x;  // round to nearest even, as numpy's astype(float16)
  std::memcpy(out, &bits, 2);
}

// The value of largest magnitude (the first of equal magnitudes), as ggml finds it: +0 when every
// element is a zero of either sign.
float signed_absmax(const float* x, int n) {
  float amax = 0.0f, mx = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      mx = x[i];
    }
  }
  return mx;
}

// Q8_0: d = max|x| / 127 (as fp16), q = round-half-away(x / d).
void q8_0_block(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(d, out);
  for (int i = 0; i < 32; ++i) out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[i] * id)));
}

// Q4_0 (levels 16) and Q5_0 (levels 32): d = (the value of largest magnitude) / -(levels / 2), as
// fp16 at the block's start; q = min(levels - 1, trunc(x / d + levels / 2 + 0.5)).
void symmetric_codes(const float* x, float levels, uint8_t* out, uint8_t* q) {
  const float d = signed_absmax(x, 32) / -(levels / 2);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(d, out);
  for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(std::min(levels - 1, std::trunc(x[i] * id + (levels / 2 + 0.5f))));
}

// Q4_0: elements i and i + 16 share byte i (low, high nibble).
void q4_0_block(const float* x, uint8_t* out) {
  uint8_t q[32];
  symmetric_codes(x, 16.0f, out, q);
  for (int i = 0; i < 16; ++i) out[2 + i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
}

// 32 five-bit codes: the low nibbles of elements i and i + 16 share byte i (low, high), the fifth
// bits go to a little-endian u32 (bit i: element i).
void pack_5bit(const uint8_t* q, uint8_t* qh, uint8_t* qs) {
  uint32_t high = 0;
  for (int i = 0; i < 16; ++i) {
    qs[i] = static_cast<uint8_t>((q[i] & 0x0F) | ((q[i + 16] & 0x0F) << 4));
    high |= static_cast<uint32_t>((q[i] >> 4) & 1u) << i;
    high |= static_cast<uint32_t>((q[i + 16] >> 4) & 1u) << (i + 16);
  }
  std::memcpy(qh, &high, 4);
}

// Q5_0: five-bit codes (pack_5bit) after the scale.
void q5_0_block(const float* x, uint8_t* out) {
  uint8_t q[32];
  symmetric_codes(x, 32.0f, out, q);
  pack_5bit(q, out + 2, out + 6);
}

// Q5_1: d = (max - min) / 31 and m = min (both as fp16), q = trunc((x - min) / d + 0.5) from the
// fp32 min and d.
void q5_1_block(const float* x, uint8_t* out) {
  float lo = FLT_MAX, hi = -FLT_MAX;
  for (int i = 0; i < 32; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float d = (hi - lo) / 31.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(d, out);
  put_half(lo, out + 2);
  uint8_t q[32];
  for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(std::trunc((x[i] - lo) * id + 0.5f));
  pack_5bit(q, out + 4, out + 8);
}

bool same_name(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

}  // namespace

const GgmlTypeInfo& type_info(GgmlType type) {
  for (const auto& t : kTypes)
    if (t.type == type) return t;
  throw std::logic_error("unknown ggml type " + std::to_string(static_cast<uint32_t>(type)));
}

std::string type_names() {
  std::string out;
  for (const auto& t : kTypes)
    if (t.option) out += (out.empty() ? "" : ", ") + std::string(t.option);
  return out;
}

GgmlType type_from_name(std::string_view name) {
  for (const auto& t : kTypes)
    if (t.option && same_name(name, t.option)) return t.type;
  throw std::invalid_argument("GGUF type '" + std::string(name) + "' is not one qlora writes: " + type_names());
}

bool is_quantized(GgmlType type) { return type_info(type).block > 1; }

uint64_t row_bytes(GgmlType type, int64_t n) {
  const GgmlTypeInfo& t = type_info(type);
  if (n % t.block != 0)
    throw std::invalid_argument(std::string(t.name) + " rows hold whole blocks of " + std::to_string(t.block));
  return static_cast<uint64_t>(n / t.block * t.block_bytes);
}

void encode_row(GgmlType type, const float* x, int64_t n, uint8_t* out) {
  row_bytes(type, n);  // checks the block
  const GgmlTypeInfo& t = type_info(type);
  const auto blocks = [&](void (*block)(const float*, uint8_t*)) {
    for (int64_t b = 0; b < n / t.block; ++b) block(x + t.block * b, out + t.block_bytes * b);
  };
  switch (type) {
    case GgmlType::F32: std::memcpy(out, x, static_cast<size_t>(n) * 4); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) put_half(x[i], out + 2 * i);
      return;
    case GgmlType::BF16:
      // c10's rounding is ggml_compute_fp32_to_bf16's (nearest even) for every non-NaN; a NaN
      // becomes 0x7fc0 where ggml keeps its sign and payload bits (both quiet).
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = c10::BFloat16(x[i]).x;
        std::memcpy(out + 2 * i, &b, 2);
      }
      return;
    case GgmlType::Q8_0: return blocks(q8_0_block);
    case GgmlType::Q4_0: return blocks(q4_0_block);
    case GgmlType::Q5_0: return blocks(q5_0_block);
    case GgmlType::Q5_1: return blocks(q5_1_block);
    case GgmlType::Q4_K: return blocks(encode_q4_k);
    case GgmlType::Q5_K: return blocks(encode_q5_k);
    case GgmlType::Q6_K: return blocks(encode_q6_k);
    case GgmlType::MXFP4: break;
  }
  throw std::invalid_argument(std::string("GGUF: ") + t.name + " is copied from an MXFP4 checkpoint, never encoded from floats");
}

}  // namespace qlora::gguf
