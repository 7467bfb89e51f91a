#include "qlora/train/grpo_loss.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace qlora::train {
namespace {

// TRL adds this to the standard deviation before dividing (its advantages' epsilon).
constexpr double kStdEpsilon = 1e-4;

void check(bool ok, const char* key, const char* rule, const std::string& got) {
  if (!ok) throw std::invalid_argument(std::string("'grpo.") + key + "' must be " + rule + ", got " + got);
}

// Bessel-corrected std over dim (-1: all), NaNs left out; 0 where fewer than two values remain
// (TRL: nanstd gives NaN there and its callers use 0 for a single value).
at::Tensor nan_std(const at::Tensor& x, int64_t dim) {
  const at::Tensor valid = ~at::isnan(x);
  const at::Tensor v = at::where(valid, x, at::zeros_like(x));
  const at::Tensor n = dim < 0 ? valid.sum() : valid.sum(dim, /*keepdim=*/true);
  const at::Tensor mean = (dim < 0 ? v.sum() : v.sum(dim, true)) / n.clamp_min(1);
  const at::Tensor sq = at::where(valid, (x - mean).square(), at::zeros_like(x));
  const at::Tensor var = (dim < 0 ? sq.sum() : sq.sum(dim, true)) / (n - 1).clamp_min(1);
  return at::where(n > 1, var.sqrt(), at::zeros_like(var));
}

// Mean of x over the scored tokens, or over completions for a per-sequence x ([B, 1]), as TRL logs.
at::Tensor logged_mean(const at::Tensor& x, const at::Tensor& mask) {
  if (x.size(1) == 1) return x.mean();
  return (x * mask).sum() / mask.sum().clamp_min(1);
}

// log w: [B, C] per token, or [B, 1] the completion's mean over its scored tokens.
at::Tensor log_importance_weights(const at::Tensor& log_ratio, const at::Tensor& mask, ImportanceSamplingLevel level) {
  if (level == ImportanceSamplingLevel::kToken) return log_ratio;
  return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp_min(1)).unsqueeze(-1);
}

// Σ m·ℓ over the micro-batch, normalised as loss_type says.
at::Tensor aggregate(const at::Tensor& per_token, const at::Tensor& mask, const GrpoOptions& o, double num_items) {
  const at::Tensor masked = per_token * mask;  // [B, C]
  switch (o.loss_type) {
    case GrpoLossType::kGrpo: return (masked.sum(-1) / mask.sum(-1).clamp_min(1)).mean();
    case GrpoLossType::kBnpo: return masked.sum() / mask.sum().clamp_min(1);
    case GrpoLossType::kDrGrpo:
      return masked.sum() / static_cast<double>(per_token.size(0) * o.max_completion_length);
    case GrpoLossType::kDapo:
    case GrpoLossType::kCispo: {
      const double n = num_items > 0 ? num_items : mask.sum().item<double>();
      return masked.sum() / std::max(n, 1.0);
    }
  }
  throw std::logic_error("grpo_loss: unknown loss type");
}

void check_inputs(const GrpoInputs& in, const GrpoOptions& o) {
  if (!in.logps.defined() || in.logps.dim() != 2)
    throw std::invalid_argument("grpo_loss: logps must be [completions, tokens]");
  const auto shape = in.logps.sizes();
  auto same = [&](const at::Tensor& t, const char* what) {
    if (t.defined() && t.sizes() != shape)
      throw std::invalid_argument(std::string("grpo_loss: ") + what + " must be shaped like logps " +
                                  c10::str(shape) + ", got " + c10::str(t.sizes()));
  };
  same(in.old_logps, "old_logps");
  same(in.ref_logps, "ref_logps");
  same(in.mask, "mask");
  if (!in.mask.defined()) throw std::invalid_argument("grpo_loss: the loss mask is required");
  if (!in.advantages.defined() || in.advantages.dim() != 1 || in.advantages.size(0) != shape[0])
    throw std::invalid_argument("grpo_loss: advantages must be [" + std::to_string(shape[0]) + "]");
  if (o.beta != 0.0 && !in.ref_logps.defined())
    throw std::invalid_argument("grpo_loss: grpo.beta != 0 needs the reference log-probabilities");
  if (o.num_iterations > 1 && !in.old_logps.defined())
    throw std::invalid_argument("grpo_loss: grpo.num_iterations > 1 needs the old policy's log-probabilities");
}

}  // namespace

void validate(const GrpoOptions& o) {
  const auto d = [](double x) { return c10::str(x); };
  check(o.num_generations >= 2, "num_generations", ">= 2 (a group's advantages need two completions)",
        std::to_string(o.num_generations));
  check(o.epsilon > 0 && o.epsilon < 1, "epsilon", "in (0, 1)", d(o.epsilon));
  check(o.clip_high() > 0, "epsilon_high", "> 0", d(o.clip_high()));
  check(o.beta >= 0, "beta", ">= 0", d(o.beta));
  check(o.num_iterations >= 1, "num_iterations", ">= 1", std::to_string(o.num_iterations));
  check(o.max_completion_length >= 1, "max_completion_length", ">= 1", std::to_string(o.max_completion_length));
}

at::Tensor grpo_advantages(const at::Tensor& rewards, int64_t group_size, RewardScaling scale) {
  if (rewards.dim() != 1 || group_size < 1 || rewards.size(0) % group_size != 0)
    throw std::invalid_argument("grpo_advantages: " + std::to_string(rewards.numel()) +
                                " rewards are not whole groups of grpo.num_generations = " + std::to_string(group_size));
  const at::NoGradGuard no_grad;
  const at::Tensor r = rewards.to(at::kFloat);
  const at::Tensor groups = r.view({-1, group_size});  // [prompts, G]
  const at::Tensor mean = at::nanmean(groups, 1, /*keepdim=*/true);
  at::Tensor adv = (groups - mean).reshape({-1});  // [B]
  if (scale == RewardScaling::kGroup) adv = adv / (nan_std(groups, 1).expand_as(groups).reshape({-1}) + kStdEpsilon);
  if (scale == RewardScaling::kBatch) adv = adv / (nan_std(r, -1) + kStdEpsilon);
  return at::nan_to_num(adv, 0.0);
}

at::Tensor grpo_loss_mask(const at::Tensor& completion_mask, const at::Tensor& truncated, bool mask_truncated) {
  const at::Tensor m = completion_mask.to(at::kFloat);
  if (!mask_truncated) return m;
  if (!truncated.defined() || truncated.dim() != 1 || truncated.size(0) != m.size(0))
    throw std::invalid_argument("grpo_loss_mask: grpo.mask_truncated_completions needs one truncated flag a completion");
  return m * (~truncated.to(at::kBool)).to(at::kFloat).unsqueeze(1);
}

GrpoTerms grpo_loss(const GrpoInputs& in, const GrpoOptions& o) {
  check_inputs(in, o);
  const at::Tensor& logps = in.logps;  // [B, C]
  const auto like_logps = [&](const at::Tensor& t) { return t.to(logps.device(), logps.scalar_type()); };
  const at::Tensor old = in.old_logps.defined() ? like_logps(in.old_logps) : logps.detach();
  const at::Tensor mask = like_logps(in.mask);
  const at::Tensor adv = like_logps(in.advantages).unsqueeze(1);  // [B, 1]
  const at::Tensor w = at::exp(log_importance_weights(logps - old, mask, o.importance_sampling_level));
  const double high = o.clip_high();
  GrpoTerms t;
  at::Tensor per_token, clipped;
  if (o.loss_type == GrpoLossType::kCispo) {
    per_token = -w.clamp_max(high).detach() * adv * logps;
    clipped = (w > high) & (adv > 0);
  } else {
    per_token = -at::min(w * adv, w.clamp(1.0 - o.epsilon, 1.0 + high) * adv);
    clipped = ((w < 1.0 - o.epsilon) & (adv < 0)) | ((w > 1.0 + high) & (adv > 0));
  }
  if (o.beta != 0.0) {
    const at::Tensor d = like_logps(in.ref_logps) - logps;
    at::Tensor kl = at::exp(d) - d - 1.0;  // k3, >= 0
    if (o.use_bias_correction_kl) kl = kl * w;
    per_token = per_token + kl * o.beta;
    t.mean_kl = logged_mean(kl.detach(), mask);
  }
  t.loss = aggregate(per_token, mask, o, in.num_items);
  t.per_token_loss = per_token.detach();
  t.ratio = w.detach();
  t.clip_ratio = logged_mean(clipped.to(logps.dtype()), mask);
  return t;
}

}  // namespace qlora::train
