// GELU's tanh approximation in place (ops/gelu_ops.h, kernels/gelu_cpu.cpp) against transformers'
// expression, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float64: fp32 within 1e-5
// relative (the far tail: fp32 rounding of the exponent), bf16 within one rounding of it, every ISA path this CPU has,
// vector tails (odd lengths), and the far negative tail where float32's 1 + tanh cancels to 0 but
// the kernel keeps the value.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu_isa.h"
#include "qlora/ops/gelu_ops.h"

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
    const at::Tensor got = ops::gelu_tanh_(x.clone());
    EXPECT_LE(rel_err(got, want), 1e-5) << level;  // the tail: fp32 rounding of 2u ~ 60 is 4e-6 of e^-2u
    const at::Tensor xb = x.to(at::kBFloat16);
    const at::Tensor gb = ops::gelu_tanh_(xb.clone());
    EXPECT_LE(rel_err(gb, reference(xb)), 1.0 / 256) << level;  // one bf16 rounding
    EXPECT_FALSE(at::equal(gb, xb));
  }
}

TEST(GeluTanh, KeepsTheFarNegativeTailAndFallsBackOffTheKernel) {
  const at::Tensor x = at::tensor({-6.0f, -9.0f, 0.0f, 20.0f});
  const at::Tensor got = ops::gelu_tanh_(x.clone());
  EXPECT_LE(rel_err(got, reference(x)), 1e-5);
  EXPECT_EQ(at::gelu(x, "tanh")[1].item<float>(), 0.0f);
  EXPECT_LT(got[1].item<float>(), 0.0f);  // ~ -1e-30: float32's 1 + tanh gives exactly 0 here
  const at::Tensor strided = at::randn({8, 6}).t();  // not contiguous: ATen's gelu_
  EXPECT_TRUE(at::allclose(ops::gelu_tanh_(strided.clone()), at::gelu(strided, "tanh")));
  // NaN stays NaN (bf16 too), infinities as the function's limits.
  const at::Tensor odd = at::tensor({std::nanf(""), INFINITY, 1.0f});
  for (const at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    const at::Tensor g = ops::gelu_tanh_(odd.to(t)).to(at::kFloat);
    EXPECT_TRUE(std::isnan(g[0].item<float>()));
    EXPECT_EQ(g[1].item<float>(), INFINITY);
  }
}

}  // namespace
}  // namespace qlora
