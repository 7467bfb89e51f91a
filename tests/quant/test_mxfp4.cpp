// quant/mxfp4: the OCP E2M1 table, the nibble order (low first), the E8M0 scale, and refusals naming
// the tensor. The decode of whole checkpoints is checked against transformers' own in
// conformance.families_transformers (gpt_oss mxfp4).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "quant/mxfp4.h"

namespace qlora {
namespace {

TEST(Mxfp4, E2m1Table) {
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(mxfp4::e2m1_value(c), want[c]) << c;
  EXPECT_TRUE(std::signbit(mxfp4::e2m1_value(8)));
}

TEST(Mxfp4, LowNibbleFirstTimesScale) {
  at::Tensor blocks = at::zeros({2, 1, 16}, at::kByte), scales = at::zeros({2, 1}, at::kByte);
  blocks[0][0][0] = 0x71;  // element 0: code 1 (0.5), element 1: code 7 (6)
  blocks[1][0][15] = 0xA3;  // element 30: code 3 (1.5), element 31: code 10 (-1)
  scales[0][0] = 127;       // 2^0
  scales[1][0] = 130;       // 2^3
  const at::Tensor out = mxfp4::dequantize(blocks, scales, at::kFloat, "t");
  ASSERT_EQ(out.sizes(), at::IntArrayRef({2, 32}));
  EXPECT_EQ(out[0][0].item<float>(), 0.5f);
  EXPECT_EQ(out[0][1].item<float>(), 6.0f);
  EXPECT_EQ(out[1][30].item<float>(), 12.0f);
  EXPECT_EQ(out[1][31].item<float>(), -8.0f);
  EXPECT_EQ(out.abs().sum().item<float>(), 0.5f + 6.0f + 12.0f + 8.0f);
  const at::Tensor bf = mxfp4::dequantize(blocks, scales, at::kBFloat16, "t");
  EXPECT_TRUE(bf.to(at::kFloat).equal(out));
  scales[0][0] = 0;  // 2^-127: a float32 subnormal, kept exactly
  EXPECT_EQ(mxfp4::dequantize(blocks, scales, at::kFloat, "t")[0][1].item<float>(), std::ldexp(6.0f, -127));
}

TEST(Mxfp4, RefusesShapesAndDtypesNamingTheTensor) {
  const auto refused = [](const at::Tensor& b, const at::Tensor& s, const std::string& words) {
    try {
      mxfp4::dequantize(b, s, at::kFloat, "f.safetensors: x_blocks");
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      return m.find("f.safetensors: x_blocks") != std::string::npos && m.find(words) != std::string::npos;
    }
    return false;
  };
  const at::Tensor b = at::zeros({4, 2, 16}, at::kByte);
  EXPECT_TRUE(refused(b, at::zeros({4, 3}, at::kByte), "scales must be"));
  EXPECT_TRUE(refused(at::zeros({4, 2, 8}, at::kByte), at::zeros({4, 2}, at::kByte), "[..., groups, 16]"));
  EXPECT_TRUE(refused(b.to(at::kFloat), at::zeros({4, 2}, at::kByte), "uint8"));
}

}  // namespace
}  // namespace qlora
