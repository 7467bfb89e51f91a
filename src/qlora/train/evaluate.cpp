#include "qlora/train/evaluate.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "qlora/data/sample_images.h"
#include "qlora/models/vision/tower.h"

namespace qlora::train {

std::optional<models::ImageInputs> BatchImages::of(const models::DecoderModel& model, const data::Batch& b,
                                                   c10::Device device) const {
  if (!b.images.empty() && (!model.tower || !options))
    throw std::invalid_argument(b.images.front().origin + ": the data holds images but the model has no vision tower "
                                "(a text-only checkpoint: train images on the Hub's multimodal form)");
  if (!model.tower) return std::nullopt;
  model.tower->training = model.training;
  const bool trains = at::GradMode::is_enabled() && !models::vision::tower_trainable(*model.tower).empty();
  at::AutoGradMode grad(trains);
  if (b.images.empty()) {  // the tower's gathers still pair with the ranks' whose batches hold images
    models::vision::skip_forward(*model.tower);
    return std::nullopt;
  }
  std::vector<images::ProcessedImage> pixels;
  for (const data::SampleImage& img : b.images) pixels.push_back(data::image_pixels(img, *options));
  // position_ids restart at each sample (and at a row's padding): where M-RoPE restarts too.
  return models::image_inputs(*model.tower, pixels, b.tokens.to(device), b.position_ids.to(device), model.config);
}

at::Tensor summed_token_loss(const models::DecoderModel& model, const data::Batch& b, bool packed, c10::Device device,
                             const BatchImages& images) {
  const at::Tensor labels = b.labels.to(device);  // [batch, seq]
  if (model.router_counts) model.router_counts->valid = b.document_ids.ge(0).to(device);  // padding is not counted
  const std::optional<models::ImageInputs> in = images.of(model, b, device);
  const models::ImageInputs* with = in ? &*in : nullptr;
  // Images take the packed form's inputs (position_ids say where each row's samples start).
  return packed || with ? model.loss(b.tokens.to(device), b.position_ids.to(device),
                                     data::block_causal_mask(b.document_ids).to(device), labels, with)
                        : model.loss(b.tokens.to(device), labels);
}

double all_ranks_sum(engine::World& world, double v, c10::Device device) {
  return all_ranks_sum(world, std::vector<double>{v}, device)[0];
}

std::vector<double> all_ranks_sum(engine::World& world, const std::vector<double>& v, c10::Device device) {
  if (world.size() == 1 || v.empty()) return v;
  at::Tensor t = at::tensor(v, at::TensorOptions().dtype(at::kDouble)).to(device);
  engine::wait(world.world().all_reduce_sum(t));
  const at::Tensor c = t.cpu();
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

std::vector<double> every_rank(engine::World& world, double v, c10::Device device) {
  std::vector<double> slots(static_cast<size_t>(world.size()), 0.0);
  slots[static_cast<size_t>(world.rank())] = v;
  return all_ranks_sum(world, slots, device);
}

namespace {

// Rows [begin, end) of `samples`, filled up to `rows` with a fully masked copy of the first
// sample (it adds no loss and no tokens).
std::vector<data::Sample> share_of(const std::vector<data::Sample>& samples, int64_t begin, int64_t end, int64_t rows) {
  std::vector<data::Sample> out;
  for (int64_t i = begin; i < end; ++i) out.push_back(samples[static_cast<size_t>(i)]);
  data::Sample filler = samples.front();
  std::fill(filler.labels.begin(), filler.labels.end(), data::kIgnoreIndex);
  while (static_cast<int64_t>(out.size()) < rows) out.push_back(filler);
  return out;
}

}  // namespace

Evaluation evaluate(models::DecoderModel& model, engine::World& world, const std::vector<data::Sample>& samples,
                    int64_t batch_size, int64_t pad_id, c10::Device device, const BatchImages& images) {
  if (samples.empty()) throw std::invalid_argument("evaluate: no validation samples");
  const int64_t n = static_cast<int64_t>(samples.size()), global = batch_size * world.size();
  const bool was_training = model.training;
  model.training = false;  // no dropout: no draws from the generators training continues with
  at::NoGradGuard no_grad;
  double loss = 0.0;
  int64_t tokens = 0;
  for (int64_t first = 0; first < n; first += global) {
    const int64_t begin = std::min(n, first + world.rank() * batch_size), end = std::min(n, begin + batch_size);
    const data::Batch b = data::collate(share_of(samples, begin, end, batch_size), pad_id);
    loss += summed_token_loss(model, b, false, device, images).item<double>();
    tokens += b.num_label_tokens;
  }
  model.training = was_training;
  Evaluation e;
  e.tokens = static_cast<int64_t>(all_ranks_sum(world, static_cast<double>(tokens), device));
  e.loss = all_ranks_sum(world, loss, device) / static_cast<double>(std::max<int64_t>(e.tokens, 1));
  e.perplexity = std::exp(e.loss);
  return e;
}

}  // namespace qlora::train
