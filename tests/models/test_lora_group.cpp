// Tests for lora_linear_group_forward: projections that share one input (q/k/v, gate/up) run as
// one autograd node and give each member what lora_linear_forward gives it alone, with the same
// gradients for x, every A and every B.
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
struct Case {
  bool nf4 = true;
  std::vector<int64_t> outs;
  std::vector<int64_t> ranks;  // 0: a member without an adapter
  int64_t in = 64;
  at::ScalarType dtype = at::kFloat;
  bool bias = false;
};

std::vector<LoraLinear> members(const Case& c) {
  std::vector<LoraLinear> m;
  uint64_t seed = 300;
  for (size_t i = 0; i < c.outs.size(); ++i) {
    const at::Tensor w = randn({c.outs[i], c.in}, seed++, 1.0 / std::sqrt(static_cast<double>(c.in)));
    LoraLinear l = c.nf4 ? lora_linear_nf4(ops::nf4_quantize(w.to(c.dtype), "w")) : lora_linear_dense(w.to(c.dtype));
    if (c.bias) lora_linear_set_bias(l, randn({c.outs[i]}, seed++, 0.1).to(c.dtype));
    if (c.ranks[i] > 0) {
      lora_linear_add_adapter(l, c.ranks[i], 2.0 * c.ranks[i] + i, 0.0, seeded(seed++), at::kCPU);
      at::NoGradGuard ng;
      l.lora_b.copy_(randn({c.outs[i], c.ranks[i]}, seed++, 0.1));  // nonzero: every gradient nontrivial
    }
    m.push_back(std::move(l));
  }
  return m;
}

// Runs the members one by one and as a group on the same x and output gradients (`used`: which
// members' outputs reach the loss), then compares outputs and every gradient.
void expect_group_equals_members(const Case& c, const std::vector<bool>& used, double tol) {
  std::vector<LoraLinear> m = members(c);
  std::vector<const LoraLinear*> ptrs;
  for (const LoraLinear& l : m) ptrs.push_back(&l);
  const at::Tensor x0 = randn({2, 7, c.in}, 400).to(c.dtype);
  std::vector<at::Tensor> gs;
  for (size_t i = 0; i < m.size(); ++i) gs.push_back(randn({2, 7, c.outs[i]}, 500 + i).to(c.dtype));

  auto run = [&](bool grouped) {
    for (LoraLinear& l : m)
      if (l.has_lora()) {
        l.lora_a.mutable_grad() = at::Tensor();
        l.lora_b.mutable_grad() = at::Tensor();
      }
    at::Tensor x = x0.clone().requires_grad_(true);
    std::vector<at::Tensor> ys;
    if (grouped) ys = lora_linear_group_forward(ptrs, x, /*training=*/true);
    else
      for (const LoraLinear& l : m) ys.push_back(lora_linear_forward(l, x, true));
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (size_t i = 0; i < ys.size(); ++i)
      if (used[i]) loss = loss + (ys[i].to(at::kDouble) * gs[i].to(at::kDouble)).sum();
    loss.backward();
    std::vector<at::Tensor> out;
    for (const at::Tensor& y : ys) out.push_back(y.detach());
    out.push_back(x.grad());
    for (const LoraLinear& l : m)
      if (l.has_lora()) {
        out.push_back(l.lora_a.grad().defined() ? l.lora_a.grad().clone() : at::zeros_like(l.lora_a));
        out.push_back(l.lora_b.grad().defined() ? l.lora_b.grad().clone() : at::zeros_like(l.lora_b));
      }
    return out;
  };
  const std::vector<at::Tensor> ref = run(false), got = run(true);
  ASSERT_EQ(ref.size(), got.size());
  for (size_t k = 0; k < ref.size(); ++k) {
    ASSERT_EQ(ref[k].sizes(), got[k].sizes()) << k;
    EXPECT_EQ(ref[k].scalar_type(), got[k].scalar_type()) << k;
    EXPECT_LE(rel_err(got[k], ref[k]), tol) << "tensor " << k << " (outputs, x grad, then A, B grads)";
  }
}
}  // namespace

TEST(LoraGroup, QkvNf4EqualsMembersOneByOne) {
  // GQA-shaped: k and v narrower than q.
  expect_group_equals_members({true, {64, 32, 32}, {4, 4, 4}}, {true, true, true}, 1e-5);
}

TEST(LoraGroup, DenseWithBiasAndAMemberWithoutAdapter) {
  // Qwen2-like q/k/v with biases, LoRA on q and v only (k frozen, as torchtune's default targets).
  expect_group_equals_members({false, {48, 16, 16}, {8, 0, 8}, 64, at::kFloat, true}, {true, true, true}, 1e-5);
}

TEST(LoraGroup, UnusedOutputGetsNoGradientAndOthersAreExact) {
  // k's output never reaches the loss: its adapter's gradients are zero, the others unchanged.
  expect_group_equals_members({true, {32, 32, 32}, {4, 4, 4}}, {true, false, true}, 1e-5);
}

TEST(LoraGroup, Bf16ComputeDtype) {
  // Stacked vs separate GEMMs round bf16 outputs differently in the last place at most.
  expect_group_equals_members({true, {64, 64}, {4, 4}, 64, at::kBFloat16}, {true, true}, 1e-2);
}

TEST(LoraGroup, NoAdapterAtAllStillPassesGradientToX) {
  expect_group_equals_members({true, {32, 16}, {0, 0}}, {true, true}, 1e-5);
}

TEST(LoraGroup, LargeMembersGoWeightByWeight) {
  // 3 x 1400 x 4096 = 17.2M elements: more than one stacked chunk may hold, so each member runs its
  // own product into its columns and x's gradient accumulates member by member.
  expect_group_equals_members({true, {1400, 1400, 1400}, {2, 2, 2}, 4096}, {true, true, true}, 1e-5);
}

TEST(LoraGroup, DropoutFallsBackToSeparateNodes) {
  std::vector<LoraLinear> m = members({false, {16, 16}, {4, 4}});
  m[1].dropout = 0.5;
  const at::Tensor x = randn({3, 64}, 7);
  // Not training: no dropout drawn, the group node runs and equals the members.
  const std::vector<at::Tensor> ys = lora_linear_group_forward({&m[0], &m[1]}, x, false);
  EXPECT_LE(rel_err(ys[1], lora_linear_forward(m[1], x, false)), 1e-6);
  // Training: m[1] draws dropout, so outputs differ from the no-dropout forward.
  const std::vector<at::Tensor> yt = lora_linear_group_forward({&m[0], &m[1]}, x, true);
  EXPECT_LE(rel_err(yt[0], lora_linear_forward(m[0], x, true)), 1e-6);
  EXPECT_GT(rel_err(yt[1], ys[1]), 1e-3);
}

TEST(LoraGroup, InputWithoutGradientStillTrainsTheAdapters) {
  // The first layer's input comes from the frozen embedding: backward skips x's gradient (and the
  // base GEMMs it needs) but the A and B gradients are those of a run where x wants one.
  std::vector<LoraLinear> m = members({true, {32, 16}, {4, 4}});
  const std::vector<const LoraLinear*> ptrs{&m[0], &m[1]};
  auto grads = [&](bool x_grad) {
    for (LoraLinear& l : m) {
      l.lora_a.mutable_grad() = at::Tensor();
      l.lora_b.mutable_grad() = at::Tensor();
    }
    const at::Tensor x = randn({5, 64}, 8).requires_grad_(x_grad);
    const std::vector<at::Tensor> ys = lora_linear_group_forward(ptrs, x, true);
    (ys[0].sum() + ys[1].pow(2).sum()).backward();
    EXPECT_EQ(x.grad().defined(), x_grad);
    return std::vector<at::Tensor>{m[0].lora_a.grad(), m[0].lora_b.grad(), m[1].lora_a.grad(), m[1].lora_b.grad()};
  };
  const std::vector<at::Tensor> with = grads(true), without = grads(false);
  for (size_t k = 0; k < with.size(); ++k) EXPECT_TRUE(at::equal(with[k], without[k])) << k;
}
