#include "qlora/train/preference_batch.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <optional>

#include "qlora/models/vision/tower.h"
#include "qlora/modules/lora_linear.h"

namespace qlora::train {

data::Batch pair_batch(const std::vector<data::PreferencePair>& all, const std::vector<int64_t>& picked, int64_t pad_id) {
  std::vector<data::Sample> rows;
  for (int64_t i : picked) rows.push_back(all[static_cast<size_t>(i)].chosen);
  for (int64_t i : picked) rows.push_back(all[static_cast<size_t>(i)].rejected);
  return data::collate(rows, pad_id);
}

namespace {

// -(row losses) of b, the features `in` (none: a batch without images) at its image tokens.
at::Tensor logps_with(const models::DecoderModel& m, const data::Batch& b, c10::Device device,
                      const std::optional<models::ImageInputs>& in) {
  if (!in) return -m.row_losses(b.tokens.to(device), b.labels.to(device));
  return -m.row_losses(b.tokens.to(device), b.position_ids.to(device), data::block_causal_mask(b.document_ids).to(device),
                       b.labels.to(device), &*in);
}

}  // namespace

at::Tensor row_logps(const models::DecoderModel& m, const data::Batch& b, c10::Device device, bool reference,
                     const BatchImages& images) {
  if (!reference) return logps_with(m, b, device, images.of(m, b, device));
  at::NoGradGuard no_grad;
  modules::AdaptersDisabled off;
  models::vision::OriginalProjector original(m.tower.get());
  return logps_with(m, b, device, images.of(m, b, device));
}

PairLogps pair_logps(const models::DecoderModel& m, const data::Batch& b, PreferenceLoss loss, const at::Tensor& ref,
                     c10::Device device, const BatchImages& images) {
  const int64_t n = b.tokens.size(0) / 2;
  const at::Tensor counts = b.labels.ne(data::kIgnoreIndex).sum(1).to(at::kFloat).to(device);  // [2n]
  const bool with_ref = needs_reference(loss);
  at::Tensor ref_logps = with_ref && ref.defined() ? ref.to(device) : at::Tensor();
  std::optional<models::ImageInputs> ref_in;  // the reference's image features, where it ran now
  if (with_ref && !ref.defined()) {
    at::NoGradGuard no_grad;
    modules::AdaptersDisabled off;
    models::vision::OriginalProjector original(m.tower.get());
    ref_in = images.of(m, b, device);
    ref_logps = logps_with(m, b, device, ref_in);
  }
  // A frozen tower's features are the same with the adapters on or off, and constants of the step.
  // (Whether the reference ran now, not whether this batch had images: every rank decides alike, and
  // the tower's gathers pair up.)
  const bool frozen = !m.tower || models::vision::tower_trainable(*m.tower).empty();
  const bool reuse = with_ref && !ref.defined() && frozen;
  const at::Tensor pol = logps_with(m, b, device, reuse ? ref_in : images.of(m, b, device));  // [2n]
  PairLogps lp{pol.narrow(0, 0, n), pol.narrow(0, n, n), at::Tensor(), at::Tensor(),
               counts.narrow(0, 0, n), counts.narrow(0, n, n)};
  if (with_ref) {
    lp.ref_chosen = ref_logps.narrow(0, 0, n);
    lp.ref_rejected = ref_logps.narrow(0, n, n);
  }
  return lp;
}

at::Tensor preference_step_loss(const PreferenceTerms& t, double pairs, double chosen_tokens) {
  at::Tensor loss = t.pair_losses.sum() / pairs;
  if (t.token_losses.defined()) loss = loss + t.token_losses.sum() / std::max(chosen_tokens, 1.0);
  return loss;
}

}  // namespace qlora::train
