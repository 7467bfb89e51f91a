#include "quant/mxfp4.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/StringUtil.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace qlora::mxfp4 {

float e2m1_value(int code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 7];
  return (code & 8) ? -m : m;
}

namespace {

void check(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype, const std::string& what) {
  auto fail = [&](const std::string& why) { throw std::invalid_argument(what + ": MXFP4 " + why); };
  if (blocks.scalar_type() != at::kByte || scales.scalar_type() != at::kByte)
    fail("blocks and scales must be uint8, got " + std::string(c10::toString(blocks.scalar_type())) + " and " +
         c10::toString(scales.scalar_type()));
  if (!blocks.is_cpu() || !scales.is_cpu()) fail("blocks and scales must be on the CPU");
  if (blocks.dim() < 2 || blocks.size(-1) != 16)
    fail("blocks must be [..., groups, 16] (32 elements a group, two a byte), got " + c10::str(blocks.sizes()));
  if (scales.sizes() != blocks.sizes().slice(0, blocks.dim() - 1))
    fail("scales must be blocks' shape without its last dim, " + c10::str(blocks.sizes().slice(0, blocks.dim() - 1)) +
         ", got " + c10::str(scales.sizes()));
  if (dtype != at::kFloat && dtype != at::kBFloat16) fail("decodes to float32 or bfloat16 only");
}

}  // namespace

at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype, const std::string& what) {
  check(blocks, scales, dtype, what);
  const at::Tensor b = blocks.contiguous(), s = scales.contiguous();
  std::vector<int64_t> shape = scales.sizes().vec();
  shape.back() *= 32;
  at::Tensor out = at::empty(shape, b.options().dtype(at::kFloat));
  const uint8_t* pb = b.data_ptr<uint8_t>();
  const uint8_t* ps = s.data_ptr<uint8_t>();
  float* po = out.data_ptr<float>();
  const int64_t groups = s.numel();
  at::parallel_for(0, groups, 1024, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float scale = std::ldexp(1.0f, static_cast<int>(ps[g]) - 127);  // 2^-127 .. 2^128: exact or inf
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = pb[g * 16 + j];
        po[g * 32 + 2 * j] = e2m1_value(byte & 0x0F) * scale;
        po[g * 32 + 2 * j + 1] = e2m1_value(byte >> 4) * scale;
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor to_ggml_blocks(const at::Tensor& blocks, const at::Tensor& scales, const std::string& what) {
  check(blocks, scales, at::kFloat, what);
  const at::Tensor b = blocks.contiguous(), s = scales.contiguous();
  std::vector<int64_t> shape = blocks.sizes().vec();
  shape.back() = 17;
  at::Tensor out = at::empty(shape, b.options());
  const uint8_t* pb = b.data_ptr<uint8_t>();
  const uint8_t* ps = s.data_ptr<uint8_t>();
  uint8_t* po = out.data_ptr<uint8_t>();
  at::parallel_for(0, s.numel(), 4096, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* in = pb + g * 16;  // element 2i: low nibble of byte i, 2i + 1: its high nibble
      uint8_t* o = po + g * 17;
      o[0] = ps[g];
      const auto code = [in](int e) { return static_cast<uint8_t>((in[e / 2] >> (4 * (e % 2))) & 0x0F); };
      for (int j = 0; j < 16; ++j) o[1 + j] = static_cast<uint8_t>(code(j) | (code(j + 16) << 4));
    }
  });
  return out;
}

}  // namespace qlora::mxfp4
