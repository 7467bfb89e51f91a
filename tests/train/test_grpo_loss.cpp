// The GRPO objective's edge cases (train/grpo_loss.h): groups whose rewards are all equal,
// unscorable rewards, completions with no scored token, clipping at the bounds, and options refused
// with the key named. tests/conformance/test_grpo_trl.py checks the general case against TRL.
#include "qlora/train/grpo_loss.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

using namespace qlora::train;

namespace {

// fp32 arithmetic on a handful of values: a few ulps of the result.
constexpr double kTol = 1e-6;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

GrpoOptions options(GrpoLossType type) {
  GrpoOptions o;
  o.loss_type = type;
  o.num_generations = 2;
  return o;
}

// logps [B, C] requiring grad, with advantages and a mask of ones.
GrpoInputs inputs(const at::Tensor& logps, const at::Tensor& advantages) {
  GrpoInputs in;
  in.logps = logps.clone().requires_grad_(true);
  in.advantages = advantages;
  in.mask = at::ones_like(logps);
  return in;
}

}  // namespace

TEST(GrpoAdvantages, GroupOfEqualRewardsGetsZeroNotNaN) {
  const at::Tensor r = at::tensor({1.0f, 2.0f, 3.0f, 5.0f, 5.0f, 5.0f});
  const at::Tensor a = grpo_advantages(r, 3, RewardScaling::kGroup);
  const float s = 1.0f / (1.0f + 1e-4f);  // group 1: mean 2, Bessel std 1
  EXPECT_TRUE(at::allclose(a, at::tensor({-s, 0.0f, s, 0.0f, 0.0f, 0.0f}), 0, kTol)) << a;
  EXPECT_TRUE(at::equal(a.slice(0, 3), at::zeros({3})));  // exactly 0: (5 − 5) / (0 + 1e-4)
}

TEST(GrpoAdvantages, BatchAndNoScaling) {
  const at::Tensor r = at::tensor({0.0f, 2.0f, 4.0f, 4.0f});
  const at::Tensor none = grpo_advantages(r, 2, RewardScaling::kNone);
  EXPECT_TRUE(at::allclose(none, at::tensor({-1.0f, 1.0f, 0.0f, 0.0f}), 0, kTol)) << none;
  // The group's mean, the batch's std: std(0, 2, 4, 4) with n − 1 = sqrt(11/3).
  const at::Tensor batch = grpo_advantages(r, 2, RewardScaling::kBatch);
  EXPECT_TRUE(at::allclose(batch, none / (std::sqrt(11.0 / 3.0) + 1e-4), 0, kTol)) << batch;
}

TEST(GrpoAdvantages, UnscorableRewardsAreLeftOutAndGetZero) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor a = grpo_advantages(at::tensor({1.0f, nan, 3.0f, 1.0f, nan, 1.0f}), 3, RewardScaling::kGroup);
  const float s = 1.0f / (std::sqrt(2.0f) + 1e-4f);  // mean 2, std of (1, 3) = sqrt(2)
  EXPECT_TRUE(at::allclose(a, at::tensor({-s, 0.0f, s, 0.0f, 0.0f, 0.0f}), 0, kTol)) << a;
}

TEST(GrpoAdvantages, RefusesPartialGroups) {
  const std::string e = error_of([] { grpo_advantages(at::zeros({5}), 2, RewardScaling::kGroup); });
  EXPECT_NE(e.find("grpo.num_generations"), std::string::npos) << e;
}

TEST(GrpoLoss, AllMaskedCompletionAddsNothingAndGetsNoGradient) {
  for (GrpoLossType type : {GrpoLossType::kGrpo, GrpoLossType::kDrGrpo, GrpoLossType::kDapo, GrpoLossType::kBnpo,
                            GrpoLossType::kCispo}) {
    GrpoOptions o = options(type);
    o.beta = 0.1;
    GrpoInputs in = inputs(at::tensor({-1.0f, -2.0f, -0.5f, -3.0f}).view({2, 2}), at::tensor({1.0f, -1.0f}));
    in.ref_logps = in.logps.detach() - 0.3;
    in.mask = at::tensor({1.0f, 1.0f, 0.0f, 0.0f}).view({2, 2});
    const GrpoTerms t = grpo_loss(in, o);
    t.loss.backward();
    const char* name = qlora::io::enum_name(kGrpoLossTypeNames, type);
    EXPECT_TRUE(std::isfinite(t.loss.item<double>())) << name;
    EXPECT_TRUE(at::equal(in.logps.grad()[1], at::zeros({2}))) << name;
    EXPECT_GT(in.logps.grad()[0].abs().sum().item<double>(), 0) << name;
  }
}

TEST(GrpoLoss, EveryCompletionMaskedGivesZeroLoss) {
  for (ImportanceSamplingLevel level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
    GrpoOptions o = options(GrpoLossType::kGrpo);
    o.importance_sampling_level = level;
    GrpoInputs in = inputs(at::full({2, 3}, -1.0f), at::tensor({1.0f, -1.0f}));
    in.mask = at::zeros({2, 3});
    const GrpoTerms t = grpo_loss(in, o);
    EXPECT_EQ(t.loss.item<double>(), 0.0);
    EXPECT_TRUE(at::equal(t.ratio, at::ones_like(t.ratio)));  // the empty mean's log-ratio is 0
  }
}

TEST(GrpoLoss, MaskTruncatedZeroesTheRow) {
  const at::Tensor truncated = at::tensor({1, 0}).to(at::kBool);
  const at::Tensor m = grpo_loss_mask(at::ones({2, 2}), truncated, true);
  EXPECT_TRUE(at::equal(m, at::tensor({0.0f, 0.0f, 1.0f, 1.0f}).view({2, 2})));
  EXPECT_TRUE(at::equal(grpo_loss_mask(at::ones({2, 2}), truncated, false), at::ones({2, 2})));
}

TEST(GrpoLoss, ClipsTheRatioAtItsBounds) {
  GrpoOptions o = options(GrpoLossType::kBnpo);
  o.num_iterations = 2;
  o.epsilon_high = 0.28;
  // w = 1.5 and 0.5 against A = +1 and −1: both clipped (1.28, 0.8), so neither has a gradient.
  GrpoInputs in = inputs(at::tensor({-1.0f, -1.0f}).view({2, 1}), at::tensor({1.0f, -1.0f}));
  in.old_logps = in.logps.detach() - at::log(at::tensor({1.5f, 0.5f})).view({2, 1});
  GrpoTerms t = grpo_loss(in, o);
  t.loss.backward();
  EXPECT_NEAR(t.loss.item<double>(), (-1.28 + 0.8) / 2, kTol);
  EXPECT_TRUE(at::equal(in.logps.grad(), at::zeros({2, 1})));
  EXPECT_NEAR(t.clip_ratio.item<double>(), 1.0, kTol);
  // cispo keeps the gradient, weighted by min(w, ε_high) without one: d/dlogπ = −min(w, 5)·A.
  o.loss_type = GrpoLossType::kCispo;
  o.epsilon_high = 5.0;
  in.logps.mutable_grad() = at::Tensor();
  t = grpo_loss(in, o);
  t.loss.backward();
  EXPECT_TRUE(at::allclose(in.logps.grad(), at::tensor({-1.5f, 0.5f}).view({2, 1}) / 2, 0, kTol)) << in.logps.grad();
}

TEST(GrpoLoss, DenominatorsOfEachLossType) {
  // One completion of 1 token and one of 3 (per-token loss −A = −1 each at ratio 1).
  GrpoInputs in = inputs(at::full({2, 3}, -1.0f), at::tensor({1.0f, 1.0f}));
  in.mask = at::tensor({1.0f, 0.0f, 0.0f, 1.0f, 1.0f, 1.0f}).view({2, 3});
  auto loss = [&](GrpoLossType type) {
    GrpoOptions o = options(type);
    o.max_completion_length = 8;
    return grpo_loss(in, o).loss.item<double>();
  };
  EXPECT_NEAR(loss(GrpoLossType::kGrpo), -1.0, kTol);           // mean of per-completion means
  EXPECT_NEAR(loss(GrpoLossType::kBnpo), -1.0, kTol);           // 4 tokens / 4
  EXPECT_NEAR(loss(GrpoLossType::kDapo), -1.0, kTol);           // this batch's 4 tokens
  EXPECT_NEAR(loss(GrpoLossType::kDrGrpo), -4.0 / 16.0, kTol);  // B · max_completion_length
  in.num_items = 10;
  EXPECT_NEAR(loss(GrpoLossType::kDapo), -0.4, kTol);  // the generation batch's tokens
}

TEST(GrpoLoss, KlTermAndItsBiasCorrection) {
  GrpoOptions o = options(GrpoLossType::kDapo);
  o.beta = 0.5;
  GrpoInputs in = inputs(at::tensor({-1.0f, -2.0f}).view({1, 2}), at::tensor({0.0f}));
  in.ref_logps = in.logps.detach();
  EXPECT_EQ(grpo_loss(in, o).mean_kl.item<double>(), 0.0);
  in.ref_logps = in.logps.detach() + 1.0;  // k3 = e − 2 per token, d k3 / d logπ = 1 − e
  const double e = std::exp(1.0);
  for (bool corrected : {true, false}) {
    o.use_bias_correction_kl = corrected;
    in.logps.mutable_grad() = at::Tensor();
    const GrpoTerms t = grpo_loss(in, o);
    t.loss.backward();
    EXPECT_NEAR(t.loss.item<double>(), 0.5 * (e - 2.0), kTol);  // on-policy: w = 1 either way
    // Corrected, the term is k3·w and w = e^(logπ − old) adds k3 to the derivative: (1 − e) + (e − 2) = −1.
    const double per_token = 0.5 * (corrected ? -1.0 : 1.0 - e) / 2;  // beta · d/dlogπ over dapo's 2 tokens
    EXPECT_TRUE(at::allclose(in.logps.grad(), at::full({1, 2}, per_token), 0, kTol)) << corrected << in.logps.grad();
  }
}

TEST(GrpoLoss, MissingInputsAreNamed) {
  GrpoOptions o = options(GrpoLossType::kDapo);
  o.beta = 0.1;
  const GrpoInputs in = inputs(at::zeros({1, 2}), at::zeros({1}));
  EXPECT_NE(error_of([&] { grpo_loss(in, o); }).find("grpo.beta"), std::string::npos);
  o.beta = 0;
  o.num_iterations = 2;
  EXPECT_NE(error_of([&] { grpo_loss(in, o); }).find("grpo.num_iterations"), std::string::npos);
}

TEST(GrpoOptionsCheck, BadValuesAreRefusedNamingTheKey) {
  const auto refused = [](const std::function<void(GrpoOptions&)>& set, const std::string& key) {
    GrpoOptions o;
    set(o);
    const std::string e = error_of([&] { validate(o); });
    EXPECT_NE(e.find("'grpo." + key + "'"), std::string::npos) << key << ": " << e;
  };
  EXPECT_EQ(error_of([] { validate(GrpoOptions{}); }), "");  // TRL's defaults pass
  refused([](GrpoOptions& o) { o.num_generations = 1; }, "num_generations");
  refused([](GrpoOptions& o) { o.epsilon = 0; }, "epsilon");
  refused([](GrpoOptions& o) { o.epsilon = 1.5; }, "epsilon");
  refused([](GrpoOptions& o) { o.epsilon_high = -0.1; }, "epsilon_high");
  refused([](GrpoOptions& o) { o.beta = -0.01; }, "beta");
  refused([](GrpoOptions& o) { o.num_iterations = 0; }, "num_iterations");
  refused([](GrpoOptions& o) { o.max_completion_length = 0; }, "max_completion_length");
}
