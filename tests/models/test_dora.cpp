// DoRA (lora.use_dora) and rsLoRA on LoraLinear: forward and gradients against the formula written
// out on a dense copy of the weight with ATen's autograd, y = g ⊙ (x (W + s B A)^T) + bias with
// g = m / ||W + s B A||_row a constant of the graph (as peft detaches it); the dropout form; the
// merge; the initial magnitude. tests/conformance/test_export_peft.py checks the same against peft.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "qlora/modules/lora_linear.h"
#include "qlora/ops/nf4_ops.h"
#include "fixtures.h"

using namespace qlora;
using namespace qlora::modules;
using qlora::models::test_fixtures::randn;
using qlora::models::test_fixtures::rel_err;
using qlora::models::test_fixtures::seeded;

namespace {

// A DoRA projection [out, in] with random B and magnitudes moved off their initial norms.
LoraLinear dora_layer(bool nf4, int64_t out, int64_t in, bool bias, uint64_t seed, double dropout = 0.0) {
  const at::Tensor w = randn({out, in}, seed, 1.0 / std::sqrt(static_cast<double>(in)));
  LoraLinear l = nf4 ? lora_linear_nf4(ops::nf4_quantize(w, "w")) : lora_linear_dense(w);
  if (bias) lora_linear_set_bias(l, randn({out}, seed + 1, 0.1));
  lora_linear_add_adapter(l, 4, 8.0, dropout, seeded(seed + 2), at::kCPU);
  lora_linear_add_dora(l);
  at::NoGradGuard ng;
  l.lora_b.copy_(randn({out, 4}, seed + 3, 0.1));
  l.magnitude.mul_(randn({out}, seed + 4, 0.1).add_(1.0));
  return l;
}

at::Tensor dense_weight(const LoraLinear& l) {
  return l.base_nf4.defined() ? ops::nf4_dequantize(l.base_nf4, at::kFloat) : l.base_dense.to(at::kFloat);
}

// Leaves with gradients: x, A, B, magnitude.
struct Leaves {
  at::Tensor x, a, b, m;
};

// The reference on leaves: W' = (W + s B A) rows scaled by m / ||W + s B A|| (norm detached).
at::Tensor reference(const LoraLinear& l, const Leaves& v) {
  const at::Tensor w = dense_weight(l) + at::mm(v.b, v.a) * l.scale;  // [out, in]
  const at::Tensor g = v.m / w.detach().norm(2, {1});
  const at::Tensor y = at::matmul(v.x, (w * g.unsqueeze(1)).t());
  return l.bias.defined() ? y + l.bias : y;
}

std::vector<at::Tensor> grads_of(const at::Tensor& y, const at::Tensor& gy, const Leaves& v) {
  (y * gy).sum().backward();
  return {y.detach(), v.x.grad(), v.a.grad(), v.b.grad(), v.m.grad()};
}

// Ours (the group node with `others` beside it, or alone) against the reference.
void expect_matches_reference(bool nf4, bool bias, bool grouped, double tol) {
  LoraLinear l = dora_layer(nf4, 24, 64, bias, 700);
  const LoraLinear other = dora_layer(nf4, 16, 64, bias, 710);
  const at::Tensor x0 = randn({2, 5, 64}, 720), gy = randn({2, 5, 24}, 721);
  Leaves ours{x0.clone().requires_grad_(true), l.lora_a, l.lora_b, l.magnitude};
  const at::Tensor y = grouped ? lora_linear_group_forward({&l, &other}, ours.x, true)[0]
                               : lora_linear_forward(l, ours.x, true);
  const std::vector<at::Tensor> got = grads_of(y, gy, ours);
  Leaves ref{x0.clone().requires_grad_(true), l.lora_a.detach().clone().requires_grad_(true),
             l.lora_b.detach().clone().requires_grad_(true), l.magnitude.detach().clone().requires_grad_(true)};
  const std::vector<at::Tensor> want = grads_of(reference(l, ref), gy, ref);
  const char* names[] = {"y", "x grad", "A grad", "B grad", "magnitude grad"};
  for (size_t k = 0; k < want.size(); ++k) {
    ASSERT_TRUE(got[k].defined()) << names[k];
    EXPECT_LE(rel_err(got[k], want[k]), tol) << names[k];
  }
}

}  // namespace

// fp32: the same products summed in another order (the norm from its expansion), ~1e-6.
TEST(Dora, Nf4GroupMatchesTheFormula) { expect_matches_reference(true, false, true, 1e-5); }
TEST(Dora, DenseWithBiasAloneMatchesTheFormula) { expect_matches_reference(false, true, false, 1e-5); }
TEST(Dora, Nf4WithBiasInAGroupMatchesTheFormula) { expect_matches_reference(true, true, true, 1e-5); }

TEST(Dora, StartsAtTheBaseRowNormsAndEqualsTheBase) {
  const at::Tensor w = randn({12, 64}, 730, 0.125);
  LoraLinear l = lora_linear_nf4(ops::nf4_quantize(w, "w"));
  lora_linear_add_adapter(l, 4, 8.0, 0.0, seeded(731), at::kCPU);
  lora_linear_add_dora(l);
  EXPECT_TRUE(l.magnitude.requires_grad());
  EXPECT_LE(rel_err(l.magnitude, dense_weight(l).norm(2, {1})), 1e-6);
  const at::Tensor x = randn({3, 64}, 732);
  at::NoGradGuard ng;
  EXPECT_LE(rel_err(lora_linear_forward(l, x, false), lora_linear_base(l, x)), 1e-6);  // B = 0: g = 1
}

TEST(Dora, WeightNormEqualsTheDirectNorm) {
  const LoraLinear l = dora_layer(true, 32, 128, false, 740);
  const at::Tensor direct = (dense_weight(l) + at::mm(l.lora_b, l.lora_a).detach() * l.scale).norm(2, {1});
  EXPECT_LE(rel_err(dora_weight_norm(l), direct), 1e-6);
  EXPECT_FALSE(dora_weight_norm(l).requires_grad());
}

TEST(Dora, MergedWeightIsTheRescaledSum) {
  const LoraLinear l = dora_layer(true, 20, 64, false, 750);
  at::NoGradGuard ng;
  const at::Tensor w = dense_weight(l) + at::mm(l.lora_b, l.lora_a) * l.scale;
  const at::Tensor want = w * (l.magnitude / w.norm(2, {1})).unsqueeze(1);
  EXPECT_LE(rel_err(lora_merged_weight(l, dense_weight(l)), want), 1e-6);
  // The merged layer computes what the adapted one does.
  const at::Tensor x = randn({4, 64}, 751);
  EXPECT_LE(rel_err(at::matmul(x, lora_merged_weight(l, dense_weight(l)).t()), lora_linear_forward(l, x, false)), 1e-5);
}

// With dropout drawn, peft's form: y = x W^T + (g - 1) ⊙ x_d W^T + g ⊙ s x_d A^T B^T + bias.
TEST(Dora, DropoutPathIsPeftsForm) {
  LoraLinear l = dora_layer(false, 16, 64, true, 760, /*dropout=*/0.5);
  const at::Tensor x = randn({3, 64}, 761);
  at::manual_seed(7);
  const at::Tensor got = lora_linear_forward(l, x, /*training=*/true);
  at::manual_seed(7);
  at::NoGradGuard ng;
  const at::Tensor xd = at::dropout(x, 0.5, true);
  const at::Tensor w = dense_weight(l), g = l.magnitude / dora_weight_norm(l);
  const at::Tensor want = at::matmul(x, w.t()) + l.bias + (g - 1) * at::matmul(xd, w.t()) +
                          g * at::matmul(at::matmul(xd, l.lora_a.t()), l.lora_b.t()) * l.scale;
  EXPECT_LE(rel_err(got, want), 1e-5);
}

TEST(Dora, AdaptersDisabledGivesTheBase) {
  const LoraLinear l = dora_layer(true, 16, 64, false, 770);
  const at::Tensor x = randn({3, 64}, 771);
  at::NoGradGuard ng;
  const AdaptersDisabled off;
  EXPECT_TRUE(at::equal(lora_linear_forward(l, x, false), lora_linear_base(l, x)));
}

TEST(RsLora, ScaleIsAlphaOverSqrtRank) {
  EXPECT_DOUBLE_EQ(lora_scale(16.0, 4, /*rslora=*/true), 8.0);
  EXPECT_DOUBLE_EQ(lora_scale(16.0, 4, /*rslora=*/false), 4.0);
}
