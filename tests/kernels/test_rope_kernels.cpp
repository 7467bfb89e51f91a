// RoPE (ops/rope_ops.h, kernels/rope_cpu.cpp) against transformers' expression in float64,
// x * cos + rotate_half(x) * sin, and its autograd gradient: x as the transposed [B, S, H, d]
// projection output, shared and per-row tables, both output layouts, and the ATen fallback; the vision
// towers' rotary in fp32 (rope_in_fp32) within a bf16 rounding of float64 (the kernel may fuse a * b + c).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

#include "qlora/ops/rope_ops.h"

namespace qlora {
namespace {

at::Tensor rnd(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::TensorOptions().dtype(at::kFloat));
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// cos and sin tables of random angles, both halves equal as the model's tables are.
std::pair<at::Tensor, at::Tensor> tables(int64_t rows, int64_t S, int64_t d, uint64_t seed) {
  const at::Tensor angles = rnd({rows, S, d / 2}, seed) * 3.0;
  const at::Tensor both = at::cat({angles, angles}, -1);  // [rows, S, d]
  return {both.cos(), both.sin()};
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
  EXPECT_LE(err, 1e-6 * (want.abs().max().item<double>() + 1.0)) << what;
}

TEST(Rope, MatchesTransformersExpressionAndItsGradient) {
  const int64_t B = 2, S = 7, H = 3, d = 40;  // d / 2 = 20: a vector tail
  for (bool per_row : {false, true}) {
    auto [cos, sin] = tables(per_row ? B : 1, S, d, 1);
    if (per_row) cos = cos.unsqueeze(1), sin = sin.unsqueeze(1);  // [B, 1, S, d]
    else cos = cos[0], sin = sin[0];                                // [S, d]
    const at::Tensor x = rnd({B, S, H, d}, 2).transpose(1, 2);     // [B, H, S, d], strided
    const at::Tensor x64 = x.to(at::kDouble).requires_grad_();
    const at::Tensor want = x64 * cos.to(at::kDouble) + rotate_half(x64) * sin.to(at::kDouble);
    const at::Tensor out = ops::rope(x, cos, sin, -1.0, /*heads_inner=*/false);
    EXPECT_TRUE(out.is_contiguous());
    expect_close(out, want.detach(), "forward");

    const at::Tensor g = rnd({B, H, S, d}, 3);
    const at::Tensor want_grad = torch::autograd::grad({want}, {x64}, {g.to(at::kDouble)})[0];
    const at::Tensor grad = ops::rope(g, cos, sin, 1.0, /*heads_inner=*/true);
    EXPECT_TRUE(grad.transpose(1, 2).is_contiguous()) << "laid out as [B, S, H, d]";
    expect_close(grad, want_grad, "gradient");
  }
}

// bf16 x with fp32 tables (mixed dtypes) takes ATen's ops: the same bits as running them.
TEST(Rope, MixedDtypesTakeAtensOps) {
  auto [cos, sin] = tables(1, 5, 8, 4);
  const at::Tensor c = cos[0], s = sin[0];
  const at::Tensor x = rnd({1, 2, 5, 8}, 5).to(at::kBFloat16);
  at::Tensor want = x * c;
  want.narrow(-1, 0, 4).addcmul_(x.narrow(-1, 4, 4), s.narrow(-1, 0, 4), -1.0);
  want.narrow(-1, 4, 4).addcmul_(x.narrow(-1, 0, 4), s.narrow(-1, 4, 4), 1.0);
  EXPECT_TRUE(at::equal(ops::rope(x, c, s, -1.0, false), want));
}

// The vision towers' rotary: bf16 x rotated in fp32 with fp32 tables, cast back once. The same bits
// as transformers' fp32 expression, within a bf16 rounding of float64, in both output layouts; fp32
// x and a CUDA-less fallback (fp64 x) give the expression's values too.
TEST(Rope, InFp32MatchesTransformersVisionRotary) {
  const int64_t S = 9, H = 3, d = 72;  // d / 2 = 36: whole vectors and a tail
  auto [cos, sin] = tables(1, S, d, 6);
  const at::Tensor c = cos[0], s = sin[0];
  const at::Tensor x = rnd({1, S, H, d}, 7).mul(4.0).to(at::kBFloat16).transpose(1, 2);  // [1, H, S, d], strided
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor want = (xf * c + rotate_half(xf) * s).to(at::kBFloat16);
  const at::Tensor want64 = x.to(at::kDouble) * c.to(at::kDouble) + rotate_half(x.to(at::kDouble)) * s.to(at::kDouble);
  for (bool heads_inner : {false, true}) {
    const at::Tensor out = ops::rope_in_fp32(x, c, s, heads_inner);
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    // transformers' fp32 expression, rounded to bf16: at most one bf16 step apart (an FMA rounds once less)
    EXPECT_TRUE(at::le((out.to(at::kDouble) - want.to(at::kDouble)).abs(), want64.abs() * std::ldexp(1.0, -7) + 1e-30)
                    .all()
                    .item<bool>())
        << "heads_inner " << heads_inner;
    EXPECT_TRUE((heads_inner ? out.transpose(1, 2) : out).is_contiguous());
    const at::Tensor err = (out.to(at::kDouble) - want64).abs(), ulp = want64.abs() * std::ldexp(1.0, -8) + 1e-30;
    EXPECT_TRUE(at::le(err, ulp).all().item<bool>()) << "beyond a bf16 rounding of float64";
  }
  expect_close(ops::rope_in_fp32(xf, c, s, true), want64, "fp32");
  expect_close(ops::rope_in_fp32(x.to(at::kDouble), c, s, false), want64, "fallback");
}

TEST(Rope, BadShapesAreRejected) {
  EXPECT_THROW(ops::rope(at::ones({2, 3, 5}), at::ones({3, 5}), at::ones({3, 5}), -1.0, false), std::invalid_argument);
  EXPECT_THROW(ops::rope(at::ones({1, 2, 3, 5}), at::ones({3, 5}), at::ones({3, 5}), -1.0, false),
               std::invalid_argument);
  EXPECT_THROW(ops::rope_in_fp32(at::ones({2, 3, 6}), at::ones({3, 6}), at::ones({3, 6}), false),
               std::invalid_argument);
}

}  // namespace
}  // namespace qlora
