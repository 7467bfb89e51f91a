// The linear epilogues (ops/epilogue_ops.h, kernels/epilogue_cpu.cpp). GELU's tanh approximation
// in place against transformers' expression, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float64: fp32 within 1e-5
// relative (the far tail: fp32 rounding of the exponent), bf16 within one rounding of it, every ISA path this CPU has,
// vector tails (odd lengths), and the far negative tail where float32's 1 + tanh cancels to 0 but
// the kernel keeps the value; the bias added first. The residual x + (y + bias) against float64.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu_isa.h"
#include "qlora/ops/epilogue_ops.h"

namespace qlora {
namespace {

// transformers' expression in float64; and the same function as x sigmoid(2u), which float64 keeps
// exact where 1 + tanh(u) cancels (x < -8 or so): the reference.
at::Tensor expression(const at::Tensor& x) {
  const at::Tensor d = x.to(at::kDouble);
  return 0.5 * d * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (d + 0.044715 * d * d * d)));
}
at::Tensor reference(const at::Tensor& x) {
  const at::Tensor d = x.to(at::kDouble);
  return d * at::sigmoid(2.0 * std::sqrt(2.0 / M_PI) * (d + 0.044715 * d * d * d));
}

// The largest error relative to |want|, values below 1e-30 counted as 1e-30: there the kernel's exp
// is clamped at e^88 (as every exp of kernels/simd.h), giving |x| / e^88 (~1e-37) for what is smaller.
double rel_err(const at::Tensor& got, const at::Tensor& want) {
  return ((got.to(at::kDouble) - want).abs() / want.abs().clamp_min(1e-30)).max().item<double>();
}

TEST(GeluTanh, MatchesTransformersExpressionOnEveryIsa) {
  const at::Tensor x = at::randn({1037}, at::make_generator<at::CPUGeneratorImpl>(3)) * 4.0;  // odd: a vector tail
  const at::Tensor want = reference(x);
  EXPECT_LE((want - expression(x)).abs().max().item<double>(), 1e-14);  // one function
  for (int level = 0; level <= static_cast<int>(kernels::cpu_features().isa); ++level) {
    kernels::ScopedIsaCap cap(static_cast<kernels::CpuIsa>(level));
    const at::Tensor got = ops::bias_gelu_tanh_(x.clone());
    EXPECT_LE(rel_err(got, want), 1e-5) << level;  // the tail: fp32 rounding of 2u ~ 60 is 4e-6 of e^-2u
    const at::Tensor xb = x.to(at::kBFloat16);
    const at::Tensor gb = ops::bias_gelu_tanh_(xb.clone());
    EXPECT_LE(rel_err(gb, reference(xb)), 1.0 / 256) << level;  // one bf16 rounding
    EXPECT_FALSE(at::equal(gb, xb));
  }
}

TEST(GeluTanh, KeepsTheFarNegativeTailAndFallsBackOffTheKernel) {
  const at::Tensor x = at::tensor({-6.0f, -9.0f, 0.0f, 20.0f});
  const at::Tensor got = ops::bias_gelu_tanh_(x.clone());
  EXPECT_LE(rel_err(got, reference(x)), 1e-5);
  EXPECT_EQ(at::gelu(x, "tanh")[1].item<float>(), 0.0f);
  EXPECT_LT(got[1].item<float>(), 0.0f);  // ~ -1e-30: float32's 1 + tanh gives exactly 0 here
  const at::Tensor strided = at::randn({8, 6}).t();  // not contiguous: ATen's gelu_
  EXPECT_TRUE(at::allclose(ops::bias_gelu_tanh_(strided.clone()), at::gelu(strided, "tanh")));
  // NaN stays NaN (bf16 too), infinities as the function's limits.
  const at::Tensor odd = at::tensor({std::nanf(""), INFINITY, 1.0f});
  for (const at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    const at::Tensor g = ops::bias_gelu_tanh_(odd.to(t)).to(at::kFloat);
    EXPECT_TRUE(std::isnan(g[0].item<float>()));
    EXPECT_EQ(g[1].item<float>(), INFINITY);
  }
}

TEST(Epilogues, BiasBeforeGeluAndResidualOnEveryIsa) {
  const auto gen = [](uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); };
  const at::Tensor y = at::randn({5, 37}, gen(1)) * 3.0, x = at::randn({5, 37}, gen(2)), b = at::randn({37}, gen(3));
  const at::Tensor want_gelu = reference(y + b), want_res = x.to(at::kDouble) + (y.to(at::kDouble) + b.to(at::kDouble));
  for (int level = 0; level <= static_cast<int>(kernels::cpu_features().isa); ++level) {
    kernels::ScopedIsaCap cap(static_cast<kernels::CpuIsa>(level));
    EXPECT_LE(rel_err(ops::bias_gelu_tanh_(y.clone(), b), want_gelu), 1e-5) << level;
    EXPECT_LE((ops::bias_residual_(y.clone(), x, b).to(at::kDouble) - want_res).abs().max().item<double>(), 1e-5) << level;
    // bf16: one rounding of the fp32 result, the bias not rounded into y first.
    const at::ScalarType h = at::kBFloat16;
    const at::Tensor yb = y.to(h), xb = x.to(h), bb = b.to(h);
    const at::Tensor rb = xb.to(at::kDouble) + (yb.to(at::kDouble) + bb.to(at::kDouble));
    EXPECT_LE(rel_err(ops::bias_residual_(yb.clone(), xb, bb), rb), 1.0 / 256) << level;
    EXPECT_LE(rel_err(ops::bias_gelu_tanh_(yb.clone(), bb), reference(yb.to(at::kFloat) + bb.to(at::kFloat))), 1.0 / 256)
        << level;
    EXPECT_TRUE(at::equal(ops::bias_residual_(yb.clone(), xb), (xb.to(at::kFloat) + yb.to(at::kFloat)).to(h)));
  }
  // Off the kernel (a strided y): ATen's adds, the same values.
  const at::Tensor ys = y.t().contiguous().t();
  EXPECT_TRUE(at::allclose(ops::bias_residual_(ys.clone().t().t(), x, b), x + y + b, 1e-6, 1e-6));
  EXPECT_THROW(ops::bias_residual_(y.clone(), x.narrow(1, 0, 5), b), std::invalid_argument);
}

}  // namespace
}  // namespace qlora
