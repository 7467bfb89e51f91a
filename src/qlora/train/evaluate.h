// The loss the training step and validation share, and validation itself on 1..N ranks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "qlora/data/batching.h"
#include "qlora/data/dataset.h"
#include "qlora/engine/process_group.h"
#include "qlora/models/decoder.h"

namespace qlora::train {

// Where a batch's images (data::Batch::images) become the language model's inputs: the model's vision
// tower (DecoderModel::tower) and the options the samples were read with (their image processor). Without
// a tower a batch must hold no images.
struct BatchImages {
  const data::DatasetOptions* options = nullptr;
  // The batch's ImageInputs: each image's pixels made again (data::image_pixels), the tower run in the
  // model's mode (dropout while training); with gradient where the tower has trainable tensors
  // (lora.vision_targets, lora.train_projector) and gradients are on, else without (a frozen tower's
  // features are constants of the step); nullopt for a batch without images (the tower's hooks called
  // as if it ran: vision::skip_forward; every rank of a sharded run calls this for each batch). Throws
  // std::invalid_argument when the batch has images and there is no tower.
  std::optional<models::ImageInputs> of(const models::DecoderModel& model, const data::Batch& batch,
                                        c10::Device device) const;
};

// The summed token cross-entropy of a batch over its non-masked labels (fp32 logits, by chunks of
// tokens: DecoderModel::loss; packed rows attend within their own sample only). Divide by the tokens it stands for.
// A MoE model's router statistics (DecoderModel::router_counts) count the batch's tokens, not its padding.
// Its images (BatchImages) at their tokens.
at::Tensor summed_token_loss(const models::DecoderModel& model, const data::Batch& batch, bool packed,
                             c10::Device device, const BatchImages& images = {});

// The sum of `v` over every rank (on the compute device: NCCL reduces CUDA tensors only).
double all_ranks_sum(engine::World& world, double v, c10::Device device);
// Each of `v` summed over every rank, in one collective.
std::vector<double> all_ranks_sum(engine::World& world, const std::vector<double>& v, c10::Device device);
// Every rank's `v` in rank order (exact for integers below 2^53), in one collective.
std::vector<double> every_rank(engine::World& world, double v, c10::Device device);

struct Evaluation {
  double loss = 0.0;        // mean token cross-entropy over the whole validation set
  double perplexity = 0.0;  // exp(loss)
  int64_t tokens = 0;       // non-masked tokens it covers
};

// Validation loss over `samples` (in order, never packed: a token's loss is the same either way).
// Every rank takes its `batch_size` rows of each global batch; a rank whose share of the last one
// is short fills it with fully masked rows, so all ranks run the same forwards (the engine's
// gathers are collectives). No gradients, no dropout, no random numbers: training continues
// exactly as without it. Collective: every rank calls it at the same step.
Evaluation evaluate(models::DecoderModel& model, engine::World& world, const std::vector<data::Sample>& samples,
                    int64_t batch_size, int64_t pad_id, c10::Device device, const BatchImages& images = {});

}  // namespace qlora::train
