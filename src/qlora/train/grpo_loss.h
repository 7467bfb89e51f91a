// The GRPO objective, named and defined as TRL 1.16's GRPOTrainer names and computes it
// (trl/trainer/grpo_trainer.py: _generate_and_score_completions for the advantages, _compute_loss
// for the loss), checked against it in tests/conformance/test_grpo_trl.py. Per completion i of a
// group of G (one prompt), over its scored tokens t (mask m):
//   advantages  A_i = r_i − mean_group(r), divided by (std + 1e-4) unless scale_rewards = none; std
//               is Bessel-corrected (n − 1) over the group (scale_rewards = group) or over the whole
//               batch (batch), and 0 for a single value. NaN rewards (unscorable) are left out of
//               both and get A = 0.
//   ratio       log w_it = log π(t) − log π_old(t) (token level), or the mean of that over the
//               completion's scored tokens, one w_i per completion (sequence level: GSPO)
//   per token   −min(w·A, clip(w, 1 − ε, 1 + ε_high)·A)        (grpo, dr_grpo, dapo, bnpo)
//               −min(w, ε_high)·A·log π(t), the min without gradient   (cispo: ε_high is its ε_max)
//               + β·(e^(ref − log π) − (ref − log π) − 1)·[w]  (k3 KL to the reference, when β ≠ 0;
//               times w, with its gradient, under use_bias_correction_kl: TRL 1.16's default, which
//               makes the KL's gradient the unbiased reverse-KL one, DeepSeek-V3.2)
//   loss        grpo: mean over completions of Σ_t m·ℓ / Σ_t m;  bnpo: Σ m·ℓ / Σ m;
//               dr_grpo: Σ m·ℓ / (B · max_completion_length);  dapo, cispo: Σ m·ℓ / num_items, the
//               scored tokens of the whole generation batch (TRL's num_items_in_batch; here: this
//               batch's when not given).
// TRL divides grpo, bnpo and dr_grpo by its gradient-accumulation steps and scales dapo/cispo's
// num_items per window; here each call is one micro-batch and the caller does that scaling.
// Checked against the TRL installed beside the build (1.16.0): no difference from 1.16 to note.
// use_bias_correction_kl is 1.16's and on by default there, so here too. Left out (TRL 1.16 has them,
// issue 39 does not ask for them): sapo, luspo, vespo, delta (two-sided clipping),
// off_policy_mask_threshold, top_entropy_quantile, the entropy bonus, the vLLM IS correction.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "qlora/io/enum_names.h"

namespace qlora::train {

enum class GrpoLossType { kGrpo, kDrGrpo, kDapo, kBnpo, kCispo };
inline constexpr io::EnumName<GrpoLossType> kGrpoLossTypeNames[] = {{GrpoLossType::kGrpo, "grpo"},
                                                                   {GrpoLossType::kDrGrpo, "dr_grpo"},
                                                                   {GrpoLossType::kDapo, "dapo"},
                                                                   {GrpoLossType::kBnpo, "bnpo"},
                                                                   {GrpoLossType::kCispo, "cispo"}};

enum class ImportanceSamplingLevel { kToken, kSequence };
inline constexpr io::EnumName<ImportanceSamplingLevel> kImportanceSamplingLevelNames[] = {
    {ImportanceSamplingLevel::kToken, "token"}, {ImportanceSamplingLevel::kSequence, "sequence"}};

enum class RewardScaling { kGroup, kBatch, kNone };
inline constexpr io::EnumName<RewardScaling> kRewardScalingNames[] = {
    {RewardScaling::kGroup, "group"}, {RewardScaling::kBatch, "batch"}, {RewardScaling::kNone, "none"}};

// TRL's GRPOConfig fields and defaults (the keys are grpo.<field>).
struct GrpoOptions {
  GrpoLossType loss_type = GrpoLossType::kDapo;
  ImportanceSamplingLevel importance_sampling_level = ImportanceSamplingLevel::kToken;
  RewardScaling scale_rewards = RewardScaling::kGroup;
  int64_t num_generations = 8;  // G: completions per prompt, consecutive in the batch
  double epsilon = 0.2;
  std::optional<double> epsilon_high;  // unset: epsilon (also for cispo, as TRL: set it, e.g. 5.0)
  double beta = 0.0;                   // 0: no KL term and no reference pass
  int64_t num_iterations = 1;          // > 1: the loss needs the old policy's log-probs
  bool mask_truncated_completions = false;
  bool use_bias_correction_kl = true;  // the KL term weighted by the importance ratio
  int64_t max_completion_length = 256;  // dr_grpo's constant denominator (and the rollout's cap)

  double clip_high() const { return epsilon_high.value_or(epsilon); }
};

// std::invalid_argument "'grpo.<key>' must be <rule>, got <value>" for the first bad field.
void validate(const GrpoOptions& options);

// rewards [B] (B a multiple of group_size; NaN: unscorable) -> advantages [B] fp32, no gradient.
at::Tensor grpo_advantages(const at::Tensor& rewards, int64_t group_size, RewardScaling scale);

// The loss mask [B, C] fp32: completion_mask (1 on each completion's tokens, 0 on padding) with the
// rows of truncated completions ([B] bool: stopped by the length cap, not by EOS) zeroed when asked.
at::Tensor grpo_loss_mask(const at::Tensor& completion_mask, const at::Tensor& truncated, bool mask_truncated);

// One micro-batch, [B, C] in the completion frame (token j of completion i at [i, j]).
struct GrpoInputs {
  at::Tensor logps;      // the policy's per-token log-probs, with their graph
  at::Tensor old_logps;  // the old policy's (num_iterations > 1); undefined: logps detached (ratio 1)
  at::Tensor ref_logps;  // the reference's (needed when beta != 0)
  at::Tensor advantages;  // [B]
  at::Tensor mask;        // grpo_loss_mask's
  double num_items = 0;   // dapo/cispo's denominator; <= 0: this batch's mask sum
};

struct GrpoTerms {
  at::Tensor loss;            // 0-dim, with the graph of inputs.logps
  at::Tensor per_token_loss;  // [B, C] (or [B, 1] at sequence level without KL), detached, unmasked
  at::Tensor ratio;           // w: [B, C] or [B, 1], detached
  at::Tensor mean_kl;         // masked mean of the KL term over beta, detached (beta != 0; else undefined)
  at::Tensor clip_ratio;      // fraction of scored tokens whose ratio was clipped (TRL's clip_ratio/region_mean)
};

GrpoTerms grpo_loss(const GrpoInputs& inputs, const GrpoOptions& options);

}  // namespace qlora::train
