#include "qlora/gguf/ggml_types.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace qlora::gguf {
namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::F32, "f32", 1, 4, 0},   {GgmlType::F16, "f16", 1, 2, 1},     {GgmlType::BF16, "bf16", 1, 2, 32},
    {GgmlType::Q8_0, "q8_0", 32, 34, 7}, {GgmlType::Q4_0, "q4_0", 32, 18, 2},
};

void put_half(float v, uint8_t* out) {
  const uint16_t bits = c10::Half(v).x;  // round to nearest even, as numpy's astype(float16)
  std::memcpy(out, &bits, 2);
}

// ggml_compute_fp32_to_bf16: round to nearest even, NaN made quiet.
uint16_t bf16_bits(float v) {
  uint32_t n;
  std::memcpy(&n, &v, 4);
  if ((n & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((n >> 16) | 64u);
  return static_cast<uint16_t>((static_cast<uint64_t>(n) + (0x7fffu + ((n >> 16) & 1u))) >> 16);
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

// Q4_0: d = (the value of largest magnitude) / -8 (as fp16), q = min(15, trunc(x / d + 8.5)),
// elements i and i + 16 sharing byte i (low, high nibble).
void q4_0_block(const float* x, uint8_t* out) {
  float amax = std::fabs(x[0]), mx = x[0];  // the first of equal magnitudes, as numpy's argmax
  for (int i = 1; i < 32; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      mx = x[i];
    }
  }
  const float d = mx / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(d, out);
  uint8_t q[32];
  for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(std::min(15.0f, std::trunc(x[i] * id + 8.5f)));
  for (int i = 0; i < 16; ++i) out[2 + i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
}

}  // namespace

const GgmlTypeInfo& type_info(GgmlType type) {
  for (const auto& t : kTypes)
    if (t.type == type) return t;
  throw std::logic_error("unknown ggml type " + std::to_string(static_cast<uint32_t>(type)));
}

std::string type_names() {
  std::string out;
  for (const auto& t : kTypes) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

GgmlType type_from_name(std::string_view name) {
  for (const auto& t : kTypes)
    if (name == t.name) return t.type;
  throw std::invalid_argument("GGUF type '" + std::string(name) + "' is not one qlora writes: " + type_names());
}

uint64_t row_bytes(GgmlType type, int64_t n) {
  const GgmlTypeInfo& t = type_info(type);
  if (n % t.block != 0)
    throw std::invalid_argument(std::string(t.name) + " rows hold whole blocks of " + std::to_string(t.block));
  return static_cast<uint64_t>(n / t.block * t.block_bytes);
}

void encode_row(GgmlType type, const float* x, int64_t n, uint8_t* out) {
  row_bytes(type, n);  // checks the block
  switch (type) {
    case GgmlType::F32: std::memcpy(out, x, static_cast<size_t>(n) * 4); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) put_half(x[i], out + 2 * i);
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = bf16_bits(x[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      return;
    case GgmlType::Q8_0:
      for (int64_t b = 0; b < n / 32; ++b) q8_0_block(x + 32 * b, out + 34 * b);
      return;
    case GgmlType::Q4_0:
      for (int64_t b = 0; b < n / 32; ++b) q4_0_block(x + 32 * b, out + 18 * b);
      return;
  }
}

}  // namespace qlora::gguf
