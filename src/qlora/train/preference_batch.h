// A micro-batch of preference pairs through the policy and the reference policy: the part of a
// preference step that `qlora run lora_dpo` and tests/tools/dpo_tool (the TRL conformance test)
// share, so the test checks the recipe's own path.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "qlora/data/batching.h"
#include "qlora/data/preference.h"
#include "qlora/models/decoder.h"
#include "qlora/train/evaluate.h"
#include "qlora/train/preference_loss.h"

namespace qlora::train {

// Pairs `picked` of `all` as one batch: their chosen rows, then their rejected rows.
data::Batch pair_batch(const std::vector<data::PreferencePair>& all, const std::vector<int64_t>& picked, int64_t pad_id);

// Summed log-probabilities of each row's scored labels, [rows] fp32: the policy's (with its
// graph), or the reference's (no gradient, adapters off, the vision tower's too, a trained projector as
// loaded: the same base, never a second copy). The batch's images (the prompts') go through the tower to their tokens (BatchImages).
at::Tensor row_logps(const models::DecoderModel& m, const data::Batch& b, c10::Device device, bool reference,
                     const BatchImages& images = {});

// A pair batch's log-probs for `loss`: the policy's, and the reference's when the loss needs them,
// from `ref` ([2n] chosen then rejected, precomputed) or computed now when `ref` is undefined. A frozen
// tower runs once for both.
PairLogps pair_logps(const models::DecoderModel& m, const data::Batch& b, PreferenceLoss loss, const at::Tensor& ref,
                     c10::Device device, const BatchImages& images = {});

// A step's loss from one micro-batch's terms: its pair losses over the step's `pairs`, plus (orpo)
// its chosen NLL over the step's `chosen_tokens`.
at::Tensor preference_step_loss(const PreferenceTerms& t, double pairs, double chosen_tokens);

}  // namespace qlora::train
