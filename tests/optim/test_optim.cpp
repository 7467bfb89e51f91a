// Schedules (shape), clipping (no-op below the threshold, norm after clipping), AdamW (first-step
// closed form, skipped params, save/restore continues bit-identically). Bit-identity with torch
// itself is checked by tests/conformance/test_optim_torch.py through tests/tools/optim_replay.cpp.
#include "qlora/optim/adamw.h"
#include "qlora/optim/schedule.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

using namespace qlora::optim;

TEST(Schedule, CosineWarmupShape) {
  const int64_t warmup = 10, total = 110;
  EXPECT_EQ(cosine_with_warmup_factor(0, warmup, total), 0.0);
  EXPECT_EQ(cosine_with_warmup_factor(5, warmup, total), 0.5);
  EXPECT_EQ(cosine_with_warmup_factor(warmup, warmup, total), 1.0);  // warmup end: full lr
  EXPECT_EQ(cosine_with_warmup_factor(total, warmup, total), 0.0);   // cos(pi) = -1 exactly
  EXPECT_NEAR(cosine_with_warmup_factor(60, warmup, total), 0.5, 1e-15);  // half way
  for (int64_t s = 1; s < warmup; ++s)
    EXPECT_GT(cosine_with_warmup_factor(s, warmup, total), cosine_with_warmup_factor(s - 1, warmup, total));
  for (int64_t s = warmup + 1; s <= total; ++s)
    EXPECT_LT(cosine_with_warmup_factor(s, warmup, total), cosine_with_warmup_factor(s - 1, warmup, total));
  // No warmup: the first step runs at full lr (torchtune: step / max(1, 0) is never reached).
  EXPECT_EQ(cosine_with_warmup_factor(0, 0, 100), 1.0);
}

TEST(Schedule, MinLrRatioFloorsTheCosine) {
  LrSchedule s{ScheduleKind::Cosine, 2e-4, 10, 110, 0.1};
  EXPECT_EQ(s.factor(0), 0.0);  // warmup is unaffected
  EXPECT_EQ(s.factor(10), 1.0);
  EXPECT_NEAR(s.factor(110), 0.1, 1e-15);
  EXPECT_NEAR(s.lr_at(110), 2e-5, 1e-18);
  for (int64_t k = 11; k <= 110; ++k) EXPECT_LT(s.factor(k), s.factor(k - 1));
  LrSchedule plain{ScheduleKind::Cosine, 2e-4, 10, 110, 0.0};
  for (int64_t k = 0; k <= 120; ++k) EXPECT_EQ(plain.factor(k), cosine_with_warmup_factor(k, 10, 110));
}

TEST(Schedule, ConstantWithWarmup) {
  LrSchedule s{ScheduleKind::Constant, 1e-3, 4, 100, 0.0};
  EXPECT_EQ(s.factor(0), 0.0);
  EXPECT_EQ(s.factor(2), 0.5);
  EXPECT_EQ(s.factor(4), 1.0);
  EXPECT_EQ(s.lr_at(1000), 1e-3);
}

namespace {
std::vector<at::Tensor> params_with_grads(double grad_scale, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> params;
  for (auto shape : {std::vector<int64_t>{8, 16}, {33}, {4, 5, 3}}) {
    at::Tensor p = at::randn(shape);
    p.mutable_grad() = at::randn(shape) * grad_scale;
    params.push_back(p);
  }
  return params;
}
}  // namespace

TEST(Schedule, Names) {
  EXPECT_EQ(schedule_kind_from_name("constant"), ScheduleKind::Constant);
  EXPECT_STREQ(schedule_kind_name(ScheduleKind::Cosine), "cosine");
  try {
    schedule_kind_from_name("linear");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "unknown lr schedule 'linear'; expected one of cosine, constant");
  }
}

TEST(Clip, NoOpBelowThresholdBitwise) {
  auto params = params_with_grads(1e-3, 1);
  std::vector<at::Tensor> before;
  for (auto& p : params) before.push_back(p.grad().clone());
  const at::Tensor norm = clip_grad_norm_(params, 1.0);
  double sumsq = 0;
  for (auto& g : before) sumsq += g.to(at::kDouble).pow(2).sum().item<double>();
  EXPECT_NEAR(norm.item<double>(), std::sqrt(sumsq), 1e-6 * std::sqrt(sumsq));  // fp32 sums
  // clip_coef = 1/(norm+1e-6) clamps to exactly 1.0, and x * 1.0 == x.
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].grad(), before[i]));
}

TEST(Clip, ClipsToMaxNorm) {
  auto params = params_with_grads(10.0, 2);
  const double total = clip_grad_norm_(params, 0.5).item<double>();
  EXPECT_GT(total, 0.5);
  // After scaling by 0.5/(total+1e-6) the norm is 0.5 up to fp32 rounding (~1e-6 relative).
  EXPECT_NEAR(grad_total_norm(params).item<double>(), 0.5, 1e-5);
}

TEST(Clip, NonPositiveMaxNormOnlyMeasures) {
  auto params = params_with_grads(10.0, 3);
  const at::Tensor g0 = params[0].grad().clone();
  EXPECT_GT(clip_grad_norm_(params, 0.0).item<double>(), 1.0);
  EXPECT_TRUE(at::equal(params[0].grad(), g0));
  params[1].mutable_grad() = at::Tensor();  // params without grads are skipped, as torch does
  EXPECT_NO_THROW(clip_grad_norm_(params, 1.0));
}

TEST(AdamW, FirstStepIsSignStepPlusDecay) {
  // Step 1: m_hat = g, v_hat = g^2, so p' = p (1 - lr wd) - lr g / (|g| + eps).
  auto params = params_with_grads(1.0, 4);
  std::vector<at::Tensor> p0;
  for (auto& p : params) p0.push_back(p.detach().clone());
  AdamWOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  AdamW opt(params, o);
  opt.step();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor g = params[i].grad();
    const at::Tensor expected = p0[i] * (1 - 0.01 * 0.1) - 0.01 * g / (g.abs() + 1e-8);
    EXPECT_TRUE(at::allclose(params[i], expected, 0, 1e-6));  // fp32 rounding of O(1) values
  }
  EXPECT_EQ(opt.step_count(), 1);
}

TEST(AdamW, SkipsParamsWithoutGrad) {
  auto params = params_with_grads(1.0, 5);
  params[1].mutable_grad() = at::Tensor();
  const at::Tensor p1 = params[1].clone();
  AdamW opt(params, {});
  opt.step();
  opt.step();
  EXPECT_TRUE(at::equal(params[1], p1));
  EXPECT_EQ(opt.step_count(0), 2);
  EXPECT_EQ(opt.step_count(1), 0);
}

TEST(AdamW, SaveRestoreContinuesBitIdentically) {
  auto grads_at = [](int64_t step, const std::vector<at::Tensor>& params) {
    at::manual_seed(100 + step);
    for (auto& p : params) p.mutable_grad() = at::randn(p.sizes());
  };
  LrSchedule sched{ScheduleKind::Cosine, 1e-2, 3, 10, 0.0};
  // Uninterrupted run.
  auto a = params_with_grads(1.0, 6);
  std::vector<at::Tensor> start;
  for (auto& p : a) start.push_back(p.detach().clone());
  AdamW opt_a(a, {});
  for (int64_t s = 0; s < 10; ++s) {
    grads_at(s, a);
    opt_a.set_lr(sched.lr_at(s));
    opt_a.step();
  }
  // Interrupted at step 4: state and params saved, a fresh optimizer resumes.
  std::vector<at::Tensor> b;
  for (auto& p : start) b.push_back(p.clone());
  NamedTensors state;
  std::vector<at::Tensor> saved;
  {
    AdamW opt_b(b, {});
    for (int64_t s = 0; s < 4; ++s) {
      grads_at(s, b);
      opt_b.set_lr(sched.lr_at(s));
      opt_b.step();
    }
    state = opt_b.state_dict();
    for (auto& p : b) saved.push_back(p.clone());
  }
  AdamW opt_c(saved, {});
  opt_c.load_state_dict(state);
  EXPECT_EQ(opt_c.step_count(), 4);
  for (int64_t s = 4; s < 10; ++s) {
    grads_at(s, saved);
    opt_c.set_lr(sched.lr_at(s));
    opt_c.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], saved[i])) << i;
  const NamedTensors sa = opt_a.state_dict(), sc = opt_c.state_dict();
  ASSERT_EQ(sa.size(), sc.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(at::equal(sa[i].second, sc[i].second)) << sa[i].first;
}

TEST(AdamW, LoadStateDictRejectsMismatchAndLeavesStateAlone) {
  auto params = params_with_grads(1.0, 7);
  AdamW opt(params, {});
  opt.step();
  NamedTensors state = opt.state_dict();
  NamedTensors bad = state;
  bad[2].second = at::zeros({3});  // exp_avg.1 has shape [33]
  EXPECT_THROW(opt.load_state_dict(bad), std::invalid_argument);
  bad = state;
  bad.pop_back();
  EXPECT_THROW(opt.load_state_dict(bad), std::invalid_argument);
  const NamedTensors after = opt.state_dict();
  for (size_t i = 0; i < state.size(); ++i) EXPECT_TRUE(at::equal(after[i].second, state[i].second));
}
