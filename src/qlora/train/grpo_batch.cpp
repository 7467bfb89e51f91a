#include "qlora/train/grpo_batch.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "qlora/models/vision/tower.h"
#include "qlora/modules/lora_linear.h"

namespace qlora::train {

bool ends_truncated(const std::vector<int64_t>& completion, const std::vector<int64_t>& stop_ids) {
  return !completion.empty() && std::find(stop_ids.begin(), stop_ids.end(), completion.back()) == stop_ids.end();
}

CompletionBatch completion_batch(const std::vector<Completion>& completions, int64_t pad_id) {
  if (completions.empty()) throw std::invalid_argument("completion_batch: no completions");
  std::vector<data::Sample> rows;
  std::vector<int64_t> prompt_lengths;
  std::vector<uint8_t> truncated;
  size_t width = 0;
  for (size_t i = 0; i < completions.size(); ++i) {
    const Completion& c = completions[i];
    if (c.prompt.empty()) throw std::invalid_argument("completion_batch: completion " + std::to_string(i) + " has an empty prompt");
    data::Sample s;
    s.tokens = c.prompt;
    s.tokens.insert(s.tokens.end(), c.completion.begin(), c.completion.end());
    s.labels.assign(c.prompt.size(), data::kIgnoreIndex);
    s.labels.insert(s.labels.end(), c.completion.begin(), c.completion.end());
    s.images = c.images;
    rows.push_back(std::move(s));
    prompt_lengths.push_back(static_cast<int64_t>(c.prompt.size()));
    truncated.push_back(c.truncated ? 1 : 0);
    width = std::max(width, c.completion.size());
  }
  CompletionBatch b;
  b.rows = data::collate(rows, pad_id);
  b.prompt_lengths = at::tensor(prompt_lengths, at::kLong);
  b.truncated = at::tensor(truncated, at::kByte).to(at::kBool);
  const auto n = static_cast<int64_t>(completions.size());
  b.completion_mask = at::zeros({n, static_cast<int64_t>(width)}, at::kFloat);
  for (int64_t i = 0; i < n; ++i)
    b.completion_mask[i].narrow(0, 0, static_cast<int64_t>(completions[static_cast<size_t>(i)].completion.size())).fill_(1);
  return b;
}

at::Tensor completion_logps(const models::DecoderModel& m, const CompletionBatch& b, c10::Device device, LogpsOf which,
                            at::Tensor* entropy, const BatchImages& images) {
  std::optional<at::NoGradGuard> no_grad;
  std::optional<modules::AdaptersDisabled> off;
  std::optional<models::vision::OriginalProjector> original;
  if (which != LogpsOf::kPolicy) no_grad.emplace();
  if (which == LogpsOf::kReference) {
    off.emplace();
    original.emplace(m.tower.get());
  }
  const data::Batch& r = b.rows;
  const std::optional<models::ImageInputs> in = images.of(m, r, device);
  const at::Tensor per_token =  // [B, S]
      in ? -m.token_losses(r.tokens.to(device), r.position_ids.to(device), data::block_causal_mask(r.document_ids).to(device),
                           r.labels.to(device), &*in, entropy)
         : -m.token_losses(r.tokens.to(device), r.labels.to(device), entropy);
  // Completion token j of row i is the label at position prompt_i − 1 + j (labels are shifted).
  const int64_t width = b.completion_mask.size(1), seq = per_token.size(1);
  const at::Tensor pos =
      (b.prompt_lengths.unsqueeze(1) - 1 + at::arange(width, at::kLong)).clamp_max(seq - 1).to(device);
  const at::Tensor mask = b.completion_mask.to(device);
  if (entropy) *entropy = entropy->gather(1, pos) * mask;
  return per_token.gather(1, pos) * mask;  // [B, C]
}

}  // namespace qlora::train
