// LoRA's narrow products (ops/narrow_ops.h, kernels/narrow_cpu.cpp) against ATen's GEMM in float64:
// shapes with every tail (rows, rank and feature counts not multiples of the vector tiles),
// column-slice operands and outputs, results independent of the thread count, the ATen fallback
// for other dtypes and strides, and shape errors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "qlora/ops/narrow_ops.h"

namespace qlora {
namespace {

at::Tensor rnd(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::TensorOptions().dtype(at::kFloat));
}

// |got - want| <= 1e-5 * (max |want| + 1), want computed in float64.
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  if (want.numel() == 0) return;
  const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
  const double scale = want.abs().max().item<double>() + 1.0;
  EXPECT_LE(err, 1e-5 * scale) << what;
}

// (T, K, R): tokens, the wide side, the rank.
class NarrowShapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(NarrowShapes, ProductReductionAndUpdateMatchFloat64) {
  const auto [T, K, R] = GetParam();
  const std::string what = "T=" + std::to_string(T) + " K=" + std::to_string(K) + " R=" + std::to_string(R);
  // Operands as column slices of wider tensors (row strides larger than their widths).
  const at::Tensor x = rnd({T, K + 3}, 1).narrow(1, 2, K);
  const at::Tensor u = rnd({T, R + 5}, 2).narrow(1, 1, R);
  const at::Tensor a = rnd({R, K}, 3);  // w = a.t(): strides (1, K)
  const at::Tensor b = rnd({K, R}, 4);  // w = b: strides (R, 1)
  const double alpha = 0.625;

  at::Tensor out = at::full({T, R + 4}, std::nan(""));  // old contents must be ignored
  ops::narrow_product_out(out.narrow(1, 3, R), x, a.t(), alpha);
  expect_close(out.narrow(1, 3, R), x.to(at::kDouble).mm(a.t().to(at::kDouble)) * alpha, "x @ a^T, " + what);
  EXPECT_TRUE(out.narrow(1, 0, 3).isnan().all().item<bool>()) << "columns outside the slice were written";
  expect_close(ops::narrow_product(x, b, alpha), x.to(at::kDouble).mm(b.to(at::kDouble)) * alpha, "x @ b, " + what);

  expect_close(ops::narrow_reduction(u, x, alpha), u.t().to(at::kDouble).mm(x.to(at::kDouble)) * alpha,
               "u^T @ x, " + what);

  at::Tensor y = rnd({T, K + 2}, 5);
  const at::Tensor y0 = y.clone();
  ops::narrow_update_(y.narrow(1, 1, K), u, a, alpha);
  expect_close(y.narrow(1, 1, K), y0.narrow(1, 1, K).to(at::kDouble) + u.to(at::kDouble).mm(a.to(at::kDouble)) * alpha,
               "y += u @ a, " + what);
  EXPECT_TRUE(at::equal(y.narrow(1, 0, 1), y0.narrow(1, 0, 1))) << "column outside the slice changed";
  at::Tensor z = rnd({T, K}, 6);
  const at::Tensor z0 = z.clone();
  ops::narrow_update_(z, u, b.t(), alpha);  // v with strides (1, R): read through a contiguous copy
  expect_close(z, z0.to(at::kDouble) + u.to(at::kDouble).mm(b.t().to(at::kDouble)) * alpha, "z += u @ b^T, " + what);
}

INSTANTIATE_TEST_SUITE_P(Shapes, NarrowShapes,
                         ::testing::Values(std::make_tuple(512, 768, 24), std::make_tuple(512, 2048, 8),
                                           std::make_tuple(64, 768, 16), std::make_tuple(13, 37, 5),
                                           std::make_tuple(9, 25, 9), std::make_tuple(1, 8, 1),
                                           std::make_tuple(3, 5, 64), std::make_tuple(0, 16, 8),
                                           std::make_tuple(7, 0, 8)));

// Each output element is summed in one fixed order: 1 and 2 threads give the same bits.
TEST(Narrow, ResultsDoNotDependOnTheThreadCount) {
  const at::Tensor x = rnd({300, 1000}, 7), u = rnd({300, 24}, 8), a = rnd({24, 1000}, 9), y0 = rnd({300, 1000}, 10);
  auto run = [&](int threads) {
    const int before = at::get_num_threads();
    at::set_num_threads(threads);
    at::Tensor y = y0.clone();
    ops::narrow_update_(y, u, a, 0.5);
    std::vector<at::Tensor> r = {ops::narrow_product(x, a.t(), 2.0), ops::narrow_reduction(u, x, 0.5), y};
    at::set_num_threads(before);
    return r;
  };
  const auto one = run(1), two = run(2);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(at::equal(one[i], two[i])) << "result " << i;
}

// bf16 operands and x with a non-unit column stride take ATen's GEMM: the same results.
TEST(Narrow, OtherDtypesAndStridesFallBackToAten) {
  const at::Tensor x = rnd({32, 48}, 11), a = rnd({8, 48}, 12), u = rnd({32, 8}, 13);
  const at::Tensor xb = x.to(at::kBFloat16), ab = a.to(at::kBFloat16);
  EXPECT_TRUE(at::allclose(ops::narrow_product(xb, ab.t()).to(at::kFloat), at::mm(xb, ab.t()).to(at::kFloat)));
  const at::Tensor xt = x.t().contiguous().t();  // column-major: stride(1) != 1
  expect_close(ops::narrow_product(xt, a.t()), x.to(at::kDouble).mm(a.t().to(at::kDouble)), "column-major x");
  expect_close(ops::narrow_reduction(u, xt), u.t().to(at::kDouble).mm(x.to(at::kDouble)), "column-major x");
}

TEST(Narrow, MismatchedShapesAreRejectedWithTheShapes) {
  const at::Tensor x = rnd({4, 6}, 14), a = rnd({5, 3}, 15);
  try {
    ops::narrow_product(x, a);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 6] by [5, 3]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::narrow_reduction(x, rnd({5, 2}, 16)), std::invalid_argument);
  EXPECT_THROW(ops::narrow_update_(rnd({4, 2}, 17), x, rnd({6, 3}, 18)), std::invalid_argument);
  EXPECT_THROW(ops::narrow_product_out(rnd({4, 2}, 19), x, rnd({6, 3}, 20)), std::invalid_argument);
}

}  // namespace
}  // namespace qlora
