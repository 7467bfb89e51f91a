// The NF4 format pieces in quant/: codebook, the threshold form of the code search, and the
// reference quantize/dequantize on hand-checkable inputs. (The conversions are c10's; the
// kernels' own are held to them in tests/kernels/test_dtype_conversions.cpp.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "quant/nf4_dtype.h"
#include "quant/nf4_reference.h"
#include "quant/nf4_tensor.h"

namespace qlora {
namespace {

using nf4::Dtype;

TEST(Nf4Format, CodebookIsSortedWithExactEnds) {
  for (Dtype d : {Dtype::F32, Dtype::BF16, Dtype::F16}) {
    const auto& cb = nf4::codebook(d);
    EXPECT_EQ(cb[0], -1.0f);
    EXPECT_EQ(cb[nf4::kZeroCode], 0.0f);
    EXPECT_EQ(cb[15], 1.0f);
    for (int i = 1; i < 16; ++i) EXPECT_LT(cb[i - 1], cb[i]);
  }
  // 0.0796 as float32, and rounded to bfloat16 (8 significant bits): 0.07958984375.
  EXPECT_EQ(nf4::codebook(Dtype::F32)[8], 0.0796f);
  EXPECT_EQ(nf4::codebook(Dtype::BF16)[8], 0.07958984375f);
}

// The threshold form must agree with the 16-way argmin on every value it can be asked about.
TEST(Nf4Format, ThresholdsEqualArgminOnEvery16BitValue) {
  for (Dtype d : {Dtype::BF16, Dtype::F16}) {
    const float* t = nf4::code_thresholds(d).data();
    for (uint32_t u = 0; u < 0x10000; ++u) {
      const uint16_t bits = static_cast<uint16_t>(u);
      const float v = nf4::load_as_float(d, &bits, 0);
      if (!(std::fabs(v) <= 1.0f)) continue;
      ASSERT_EQ(nf4::nearest_code(t, v), nf4::nearest_code_reference(d, v))
          << nf4::dtype_name(d) << " v=" << v;
    }
  }
}

TEST(Nf4Format, ThresholdsEqualArgminForFloat32) {
  const float* t = nf4::code_thresholds(Dtype::F32).data();
  std::vector<float> probes;
  for (int k = 0; k < 15; ++k) {  // a window of ulps around every threshold
    float v = t[k];
    for (int s = 0; s < 64; ++s) v = std::nextafter(v, -2.0f);
    for (int s = 0; s < 128; ++s, v = std::nextafter(v, 2.0f)) probes.push_back(v);
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < 500000; ++i) probes.push_back(u(rng));
  for (float v : probes)
    ASSERT_EQ(nf4::nearest_code(t, v), nf4::nearest_code_reference(Dtype::F32, v)) << v;
}

TEST(Nf4Layout, PadsToWholeGroupsAndRejectsBadSizes) {
  const auto l = nf4::Layout::make(21);
  EXPECT_EQ(l.padded_numel, 16384);
  EXPECT_EQ(l.n_real_blocks(), 1);
  EXPECT_EQ(l.n_blocks(), 256);
  EXPECT_EQ(l.n_groups(), 1);
  EXPECT_EQ(nf4::Layout::make(4096 * 4096).padded_numel, 4096 * 4096);
  EXPECT_THROW(nf4::Layout::make(0), std::invalid_argument);
  EXPECT_THROW(nf4::Layout::make(64, 63), std::invalid_argument);
  EXPECT_THROW(nf4::Layout::make(64, 64, 0), std::invalid_argument);
}

TEST(Nf4Reference, CodebookMultiplesRoundTripExactly) {
  // One block whose absmax is 2 and whose values are 2 * codebook: every value is recovered
  // up to the double-quantized scaler, and the code bytes are the indices themselves.
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = 2.0f * nf4::codebook(Dtype::F32)[i % 16];
  at::Tensor xt = at::from_blob(x.data(), {64}, at::kFloat).clone();
  Nf4Tensor q = nf4_quantize_reference(xt, "w");
  const uint8_t* c = q.codes.data_ptr<uint8_t>();
  for (int j = 0; j < 32; ++j) EXPECT_EQ(c[j], ((2 * j) % 16) << 4 | ((2 * j + 1) % 16));
  // Only one real block: s = absmax - mean = 0, so the scaler is the mean, exactly 2.
  EXPECT_EQ(q.mean.item<float>(), 2.0f);
  at::Tensor back = nf4_dequantize_reference(q, at::kFloat);
  EXPECT_TRUE(at::equal(back, xt));
}

TEST(Nf4Reference, ZeroBlocksDequantizeToExactZeros) {
  at::Tensor x = at::randn({8, 64}).to(at::kBFloat16);
  x[3].zero_();
  x[5].zero_();
  Nf4Tensor q = nf4_quantize_reference(x, "w");
  at::Tensor back = nf4_dequantize_reference(q, at::kBFloat16);
  EXPECT_TRUE(at::equal(back[3], x[3]));
  EXPECT_TRUE(at::equal(back[5], x[5]));
  EXPECT_EQ(q.codes[3 * 32].item<uint8_t>(), nf4::kZeroByte);
  at::Tensor all_zero = at::zeros({4, 64});
  EXPECT_TRUE(at::equal(nf4_dequantize_reference(nf4_quantize_reference(all_zero), at::kFloat),
                        all_zero));
}

TEST(Nf4Reference, NonFiniteInputIsRefusedByName) {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    at::Tensor x = at::randn({4, 64});
    x[2][7] = bad;
    try {
      nf4_quantize_reference(x, "model.layers.0.mlp.up_proj.weight");
      FAIL() << "expected an error";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.up_proj.weight"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("NaN or Inf"), std::string::npos);
    }
  }
  EXPECT_THROW(nf4_quantize_reference(at::zeros({4}, at::kInt), "ints"), std::invalid_argument);
  EXPECT_THROW(nf4_quantize_reference(at::zeros({0}), "empty"), std::invalid_argument);
}

TEST(Nf4Reference, OddShapesKeepRealValuesAndTheirAbsmax) {
  at::manual_seed(3);
  for (auto shape : std::vector<std::vector<int64_t>>{{3, 7}, {1}, {333, 65}, {1, 16385}}) {
    at::Tensor x = at::randn(shape);
    Nf4Tensor q = nf4_quantize_reference(x, "w");
    // The mean is over the real blocks only: padding does not pull it down.
    at::Tensor flat = at::constant_pad_nd(x.flatten(), {0, q.layout.n_real_blocks() * 64 - x.numel()});
    const float expect_mean = std::get<0>(flat.view({-1, 64}).abs().max(1)).mean().item<float>();
    EXPECT_EQ(q.mean.item<float>(), expect_mean);
    at::Tensor back = nf4_dequantize_reference(q, at::kFloat);
    ASSERT_EQ(back.sizes(), x.sizes());
    // NF4's worst case is half the widest codebook gap (0.277 / 2) times the block absmax, plus
    // the int8 scaler's error (< 1%): 0.15 * max|x| still catches any misplaced value.
    EXPECT_LT((back - x).abs().max().item<float>(), 0.15f * x.abs().max().item<float>());
    const uint8_t* c = q.codes.data_ptr<uint8_t>();
    for (int64_t j = (x.numel() + 1) / 2; j < q.layout.code_bytes(); ++j)
      ASSERT_EQ(c[j], nf4::kZeroByte);
  }
}

}  // namespace
}  // namespace qlora
