// Completions through the policy, its reference and its old self: the part of a GRPO step that
// `qlora run lora_grpo` (next) and tests/tools/grpo_tool (the TRL conformance test) share, so the
// test checks the recipe's own path. Log-probs come in the completion frame of TRL's GRPOTrainer:
// token j of completion i at [i, j], right-padded to the longest completion.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "qlora/data/batching.h"
#include "qlora/models/decoder.h"
#include "qlora/train/evaluate.h"

namespace qlora::train {

struct Completion {
  std::vector<int64_t> prompt;      // >= 1 token: the first completion token is scored after it
  std::vector<int64_t> completion;  // as sampled, its stop token (EOS) included
  bool truncated = false;           // stopped by the length cap, not by a stop token
  std::vector<data::SampleImage> images;  // the prompt's (data/prompts.h), at its image tokens
};

// TRL's rule: a completion is truncated when its last token is none of stop_ids (EOS ids and pad).
bool ends_truncated(const std::vector<int64_t>& completion, const std::vector<int64_t>& stop_ids);

struct CompletionBatch {
  data::Batch rows;            // prompt + completion per row, labelled on the completion, right-padded
  at::Tensor prompt_lengths;   // [B] int64
  at::Tensor completion_mask;  // [B, C] fp32: 1 on each completion token
  at::Tensor truncated;        // [B] bool
};

CompletionBatch completion_batch(const std::vector<Completion>& completions, int64_t pad_id);

enum class LogpsOf {
  kPolicy,     // with the graph (the loss's)
  kOld,        // the same adapters, no gradient (the old policy's, taken when the completions were sampled)
  kReference,  // adapters off (a trained projector as loaded), no gradient: the base, never a second copy
};

// [B, C] fp32 per-token log-probabilities of each completion token (0 on padding), by chunks of
// the vocabulary (DecoderModel::token_losses): no [tokens, vocab] logits. entropy (optional): set to
// [B, C] fp32, each completion token's entropy of the policy's softmax there (0 on padding): TRL's
// entropy metric, from the same pass.
// The prompts' images go through the vision tower to their tokens (BatchImages).
at::Tensor completion_logps(const models::DecoderModel& m, const CompletionBatch& b, c10::Device device, LogpsOf which,
                            at::Tensor* entropy = nullptr, const BatchImages& images = {});

}  // namespace qlora::train
