// SwiGLU (ops/swiglu_ops.h, kernels/swiglu_cpu.cpp) against float64 autograd of silu(g) * u:
// column-slice operands, lengths with a scalar tail, inputs from -100 to 100, NaN propagation, and
// the ATen fallback for bf16 equal to ATen's own ops.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>

#include "qlora/ops/swiglu_ops.h"

namespace qlora {
namespace {

at::Tensor rnd(at::IntArrayRef shape, uint64_t seed, double scale) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::TensorOptions().dtype(at::kFloat)) *
         scale;
}

// Elementwise |got - want| <= 4e-6 * |want| + 1e-6 * max |want|, want in float64 (the absolute
// part for the gate's gradient where 1 + g (1 - s) cancels).
void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  const at::Tensor err = (got.to(at::kDouble) - want).abs() - (want.abs() * 4e-6 + want.abs().max() * 1e-6);
  EXPECT_LE(err.max().item<double>(), 0.0) << what;
}

TEST(SwiGlu, ForwardAndBackwardMatchFloat64Autograd) {
  for (int64_t n : {8, 37, 2048}) {
    for (double scale : {1.0, 30.0}) {
      // gate and up as the two halves of one [2, 5, 2n] output, as the gate/up projections give them.
      const at::Tensor gu = rnd({2, 5, 2 * n}, 1, scale);
      const at::Tensor gate = gu.narrow(-1, 0, n), up = gu.narrow(-1, n, n), grad = rnd({2, 5, n}, 2, 1.0);
      const at::Tensor g64 = gate.to(at::kDouble).requires_grad_(), u64 = up.to(at::kDouble).requires_grad_();
      const at::Tensor want = at::silu(g64) * u64;
      const auto grads = torch::autograd::grad({want}, {g64, u64}, {grad.to(at::kDouble)});
      expect_close(ops::swiglu(gate, up), want.detach(), "forward");
      const auto [dg, du] = ops::swiglu_backward(grad, gate, up);
      expect_close(dg, grads[0], "gate's gradient");
      expect_close(du, grads[1], "up's gradient");
    }
  }
}

TEST(SwiGlu, ExtremeGatesStayFiniteAndNanPropagates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor gate = at::tensor({-100.0f, -90.0f, -20.0f, 0.0f, 20.0f, 90.0f, 100.0f, nan, 1.0f});
  const at::Tensor up = at::ones({9}), grad = at::ones({9});
  const at::Tensor out = ops::swiglu(gate, up);
  const auto [dg, du] = ops::swiglu_backward(grad, gate, up);
  for (const at::Tensor& t : {out, dg, du}) {
    EXPECT_TRUE(t.narrow(0, 0, 7).isfinite().all().item<bool>());
    EXPECT_TRUE(std::isnan(t[7].item<float>()));
  }
  EXPECT_FLOAT_EQ(out[6].item<float>(), 100.0f);
  EXPECT_NEAR(out[0].item<float>(), 0.0f, 1e-30);
}

// bf16 runs the fp32 arithmetic on widened inputs and rounds each output once (as on GPUs), so it
// equals the fp32 kernel's result rounded to bf16, bit for bit.
TEST(SwiGlu, Bf16IsFp32RoundedOnce) {
  const at::Tensor gate = rnd({4, 40}, 3, 2.0).to(at::kBFloat16), up = rnd({4, 40}, 4, 1.0).to(at::kBFloat16);
  const at::Tensor grad = rnd({4, 40}, 5, 1.0).to(at::kBFloat16);
  const at::Tensor y = ops::swiglu(gate, up);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, ops::swiglu(gate.to(at::kFloat), up.to(at::kFloat)).to(at::kBFloat16)));
  const auto [dg, du] = ops::swiglu_backward(grad, gate, up);
  const auto [dg32, du32] = ops::swiglu_backward(grad.to(at::kFloat), gate.to(at::kFloat), up.to(at::kFloat));
  EXPECT_TRUE(at::equal(dg, dg32.to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(du, du32.to(at::kBFloat16)));
}

TEST(SwiGlu, DifferentShapesAreRejected) {
  EXPECT_THROW(ops::swiglu(at::ones({2, 3}), at::ones({2, 4})), std::invalid_argument);
  EXPECT_THROW(ops::swiglu_backward(at::ones({2, 4}), at::ones({2, 3}), at::ones({2, 3})), std::invalid_argument);
}

}  // namespace
}  // namespace qlora
