// Every NF4 kernel against the reference in quant/, on CPU and (when a GPU is present) CUDA:
// codes, scalers, factors and mean byte-identical; dequantized values bit-identical.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>

#include "qlora/ops/nf4_ops.h"
#include "quant/nf4_tensor.h"

namespace qlora {
namespace {

struct Case {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t block_size;
  int64_t scaler_block_size;
};

std::string case_name(const Case& c) {
  std::string s = c10::toString(c.dtype);
  for (int64_t d : c.shape) s += "_" + std::to_string(d);
  return s + "_b" + std::to_string(c.block_size) + "_s" + std::to_string(c.scaler_block_size);
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

std::vector<Case> cases() {
  std::vector<Case> out;
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (auto shape : std::vector<std::vector<int64_t>>{
             {256, 64}, {512, 96}, {3, 7}, {1}, {333, 65}, {64, 1031}, {2, 3, 4097}})
      out.push_back({dt, shape, 64, 256});
    out.push_back({dt, {48, 40}, 32, 8});   // other block sizes, several groups
    out.push_back({dt, {10, 30}, 2, 3});
    out.push_back({dt, {17, 128}, 128, 1});
  }
  return out;
}

at::Tensor make_input(const Case& c, int64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn(c.shape) * 0.02;
  if (x.numel() > 200) x.flatten().narrow(0, 64, 64).zero_();    // an all-zero block
  if (x.numel() > 1000) x.flatten().narrow(0, 500, 300).mul_(40);  // wide absmax spread
  return x.to(c.dtype);
}

void expect_same(const Nf4Tensor& a, const Nf4Tensor& b) {
  ASSERT_TRUE(a.layout == b.layout);
  EXPECT_TRUE(at::equal(a.codes.cpu(), b.codes.cpu())) << "codes";
  EXPECT_TRUE(at::equal(a.scalers.cpu(), b.scalers.cpu())) << "scalers";
  // Compare bits: factors may be +inf for all-zero groups, and equal() treats inf == inf fine,
  // but we want bit-equality of every value, so view as integers.
  EXPECT_TRUE(at::equal(a.factors.cpu().view(at::kShort).flatten(),
                        b.factors.cpu().view(at::kShort).flatten()) ||
              at::equal(a.factors.cpu(), b.factors.cpu()))
      << "factors";
  EXPECT_TRUE(at::equal(a.mean.cpu(), b.mean.cpu())) << "mean";
}

class Nf4Kernels : public ::testing::TestWithParam<std::tuple<Case, std::string>> {
 protected:
  void SetUp() override {
    device_ = std::get<1>(GetParam()) == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
    if (device_.is_cuda() && !ops::cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
  at::Device device_ = at::kCPU;
};

TEST_P(Nf4Kernels, QuantizeMatchesReferenceByteForByte) {
  const Case& c = std::get<0>(GetParam());
  for (int64_t seed : {0, 1}) {
    at::Tensor x = make_input(c, seed);
    Nf4Tensor ref = nf4_quantize_reference(x, "x", c.block_size, c.scaler_block_size);
    Nf4Tensor got = ops::nf4_quantize(x.to(device_), "x", c.block_size, c.scaler_block_size);
    EXPECT_EQ(got.device().type(), device_.type());  // cuda:0 for at::kCUDA: the index is filled in
    expect_same(got, ref);
  }
}

TEST_P(Nf4Kernels, DequantizeMatchesReferenceExactly) {
  const Case& c = std::get<0>(GetParam());
  at::Tensor x = make_input(c, 5);
  Nf4Tensor q = nf4_quantize_reference(x, "x", c.block_size, c.scaler_block_size);
  for (at::ScalarType out : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor ref = nf4_dequantize_reference(q, out);
    at::Tensor got = ops::nf4_dequantize(q.to(device_), out);
    ASSERT_EQ(got.sizes(), x.sizes());
    ASSERT_EQ(got.scalar_type(), out);
    EXPECT_TRUE(at::equal(got.cpu(), ref)) << c10::toString(out);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, Nf4Kernels, ::testing::Combine(::testing::ValuesIn(cases()), ::testing::Values("cpu", "cuda")),
    [](const auto& info) {
      return std::get<1>(info.param) + "_" + case_name(std::get<0>(info.param));
    });

TEST(Nf4Ops, RefusesNonFiniteWithTheTensorName) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      for (int64_t at_index : {int64_t{0}, int64_t{6403}, int64_t{128 * 64 - 1}}) {
        at::Tensor x = at::randn({128, 64}).to(dt);
        x.view({-1})[at_index] = bad;
        try {
          ops::nf4_quantize(x, "model.layers.3.self_attn.q_proj.weight");
          FAIL() << c10::toString(dt) << " " << bad << " at " << at_index;
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("model.layers.3.self_attn.q_proj.weight"), std::string::npos);
        }
      }
    }
  }
  // The largest finite values are not mistaken for Inf.
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor x = at::randn({4, 64}).to(dt);
    const at::Scalar max = dt == at::kHalf       ? at::Scalar(std::numeric_limits<c10::Half>::max())
                           : dt == at::kBFloat16 ? at::Scalar(std::numeric_limits<c10::BFloat16>::max())
                                                 : at::Scalar(std::numeric_limits<float>::max());
    x[1][1] = max;
    EXPECT_NO_THROW(ops::nf4_quantize(x, "big"));
  }
}

TEST(Nf4Ops, DequantizeOutChecksTheBuffer) {
  Nf4Tensor q = ops::nf4_quantize(at::randn({64, 64}), "w");
  at::Tensor wrong = at::empty({63, 64});
  EXPECT_THROW(ops::nf4_dequantize_out(q, wrong), std::invalid_argument);
  at::Tensor right = at::empty({64 * 64}, at::kBFloat16);
  ops::nf4_dequantize_out(q, right);
  EXPECT_TRUE(at::equal(right.view({64, 64}), nf4_dequantize_reference(q, at::kBFloat16)));
}

TEST(Nf4Ops, NonContiguousInputIsQuantizedAsItsValues) {
  at::Tensor x = at::randn({64, 128});
  expect_same(ops::nf4_quantize(x.t(), "wt"), nf4_quantize_reference(x.t().contiguous(), "wt"));
}

}  // namespace
}  // namespace qlora
