// `qlora run lora_finetune`: QLoRA supervised fine-tuning on 1..N ranks (one process is a world of
// one), top to bottom. What every recipe shares (model, optimizer, resume, the step loop with its
// guard, checkpoints, exports) is in session.h; this file keeps what is its own:
//   setup  : the data (tokenized samples, packed rows when packing, the validation split)
//   train  : one optimizer step = grad_accum micro-batches, the loss normalised by the non-masked
//            tokens of the whole step; validation loss
//   cleanup: where the exports are, and for the embedded default what it learned
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/config/builders.h"
#include "qlora/data/batching.h"
#include "qlora/data/split.h"
#include "qlora/data/stats.h"
#include "demo.h"
#include "qlora/train/evaluate.h"
#include "qlora/train/faults.h"
#include "qlora/train/tiny_default.h"
#include "qlora/train/untrained_tokens.h"
#include "recipes/recipes.h"
#include "recipes/session.h"

namespace qlora::recipes {

namespace {
using config::RecipeConfig;

// The training data as this run sees it: tokenized samples, packed rows when packing, and the
// sampler that gives this rank its rows of one global batch (batch_size x ranks rows) per micro-step.
struct Data {
  const TextSetup* text = nullptr;  // the file, tokenizer and rendering options
  std::vector<data::Sample> samples;
  std::vector<data::Sample> validation;  // data.val_path, or the held-out data.val_fraction of `path`
  std::vector<data::PackedRow> rows;  // packing: samples packed once into rows of max_seq_len
  bool packed = false;
  std::unique_ptr<data::Sampler> sampler;
  train::BatchImages images;  // where the samples hold images: the data's processor

  // Rows `picked` of the data set as one batch.
  data::Batch batch(const std::vector<int64_t>& picked) const {
    if (packed) {
      std::vector<data::PackedRow> b;
      for (int64_t i : picked) b.push_back(rows[i]);
      return data::collate_packed(b);
    }
    std::vector<data::Sample> b;
    for (int64_t i : picked) b.push_back(samples[i]);
    return data::collate(b, text->tokenizer.pad_id());
  }
};

// The validation set: data.val_path (the embedded default: its held-out file), or data.val_fraction
// of the training records held out (seeded by training.seed, the same on any number of ranks);
// empty without either.
void split_validation(const RecipeConfig& cfg, Data& d) {
  if (const std::string val = val_data_path(cfg); !val.empty()) d.validation = data::load_dataset(val, d.text->tokenizer, d.text->options);
  hold_out_validation(cfg, d.samples, d.validation);
}

Data setup_data(const RecipeConfig& cfg, const TextSetup& text, const engine::World& world) {
  Data d{&text, {}, {}, {}, cfg.data.packing, nullptr, {}};
  d.samples = data::load_dataset(text.path, text.tokenizer, text.options);
  split_validation(cfg, d);
  // Otherwise every step's loss is 0/0 and the run "trains" on nothing.
  const data::DatasetStats stats = data::dataset_stats(d.samples);
  if (stats.trained_tokens == 0)
    throw std::invalid_argument(text.path + ": no sample has a trained token: every response is cut by data.max_seq_len = " +
                                std::to_string(cfg.data.max_seq_len) + " (or empty); raise it (`qlora data` shows the lengths)");
  if (!d.validation.empty() && data::dataset_stats(d.validation).trained_tokens == 0)
    throw std::invalid_argument("validation data (" + (val_data_path(cfg).empty() ? text.path : val_data_path(cfg)) +
                                ") has no trained tokens: every sample's response is cut by data.max_seq_len = " +
                                std::to_string(cfg.data.max_seq_len) + " (or empty)");
  if (!stats.untrained.empty())
    std::printf("warning: %s: %zu of %zu samples have no trained token (cut by data.max_seq_len = %lld, or an empty "
                "response) and train on nothing; `qlora data` lists them\n",
                text.path.c_str(), stats.untrained.size(), d.samples.size(), (long long)cfg.data.max_seq_len);
  if (d.packed) d.rows = data::pack_samples(d.samples, cfg.data.max_seq_len, text.tokenizer.pad_id());
  const int64_t size = static_cast<int64_t>(d.packed ? d.rows.size() : d.samples.size());
  // One global batch per micro-step; each rank trains on its own batch_size rows of it.
  d.sampler = std::make_unique<data::Sampler>(
      config::sampler_options(cfg.data, cfg.training, size, world.size(), world.rank()));
  return d;
}

// One optimizer step: grad_accum micro-batches, this rank's rows of each global batch, the loss
// normalised by the non-masked tokens of the whole step on every rank (every token weighs the
// same, however the step's tokens fall into micro-batches and ranks). Every rank sees the same
// summed loss, so every rank judges the step alike.
StepResult train_step(const RecipeConfig& cfg, engine::World& world, Model& m, Data& d, c10::Device device,
                      int64_t step) {
  std::vector<data::Batch> micro;
  StepResult r;
  for (int64_t k = 0; k < cfg.training.grad_accum; ++k) {
    micro.push_back(d.batch(d.sampler->next()));
    r.tokens += micro.back().num_label_tokens;
  }
  r.tokens = static_cast<int64_t>(train::all_ranks_sum(world, static_cast<double>(r.tokens), device));
  const auto& poison = train::fault_plan().poison_loss;  // tests only
  const bool nan = poison && poison(world.rank(), step);
  for (size_t k = 0; k < micro.size(); ++k) {
    at::Tensor loss = train::summed_token_loss(m.decoder, micro[k], d.packed, device, d.images) /
                      static_cast<double>(std::max<int64_t>(r.tokens, 1));
    if (nan) loss = loss * std::numeric_limits<double>::quiet_NaN();
    backward_micro_batch(m, loss, k + 1 == micro.size());
    r.loss += loss.item<double>();
  }
  r.loss = train::all_ranks_sum(world, r.loss, device);
  return r;
}

// Validation loss now (every rank evaluates its share).
report::ValidationMetrics validate(const RecipeConfig& cfg, engine::World& world, Model& m, const Data& d,
                                  const Position& p, c10::Device device) {
  const train::Evaluation e =
      train::evaluate(m.decoder, world, d.validation, cfg.training.batch_size, d.text->tokenizer.pad_id(), device,
                      d.images);
  return {p.global_step, p.epoch, e.loss, e.perplexity, e.tokens};
}

// The recipe proper, the same on 1..N ranks.
int run_finetune(Session& s) {
  const RecipeConfig& cfg = s.cfg;
  const TextSetup text = open_text(s);
  Data d = setup_data(cfg, text, s.world);
  train::TokenIdSet ids;
  for (const auto* set : {&d.samples, &d.validation})
    for (const data::Sample& x : *set) ids.add(x);
  Model m = setup_model(s, text, ids.ids());
  const auto has_images = [](const std::vector<data::Sample>& set) {
    return std::any_of(set.begin(), set.end(), [](const data::Sample& x) { return !x.images.empty(); });
  };
  d.images = load_vision_tower(s, m, text.options, has_images(d.samples), has_images(d.validation));
  RecipeParts parts;
  parts.sampler = d.sampler.get();
  parts.records = static_cast<int64_t>(d.samples.size());
  parts.records_name = "samples";
  parts.step = [&](int64_t step) { return train_step(cfg, s.world, m, d, s.device, step); };
  if (!d.validation.empty())
    parts.validate = [&](const Position& p) { return validate(cfg, s.world, m, d, p, s.device); };
  const Position p = train(s, m, text, parts);
  const bool lead = s.lead;
  const std::string& out_dir = cfg.checkpoint.output_dir;
  if (lead)
    std::printf("done: %lld steps; metrics in %s (qlora plot %s); exports in %s/epoch_*; try\n  qlora generate --checkpoint "
                "%s/epoch_%lld %s\n",
                (long long)p.global_step, (out_dir + "/metrics.jsonl").c_str(), out_dir.c_str(), out_dir.c_str(), out_dir.c_str(),
                (long long)cfg.training.epochs - 1,
                cfg.data.format == data::DatasetKind::kInstruct ? "--instruction \"...\" [--input \"...\"]"
                : cfg.data.format == data::DatasetKind::kChat   ? "--message \"...\""
                                                                : "--prompt \"...\"");
  // The embedded default shows what it learned: greedy answers of the last export to held-out prompts.
  if (lead && cfg.model.checkpoint_dir.empty() && cfg.data.path.empty() && !cfg.checkpoint.adapter_only && cfg.data.template_) {
    const std::string last = out_dir + "/epoch_" + std::to_string(cfg.training.epochs - 1);
    print_heldout(score_heldout(last, train::bundled_val_path(), *cfg.data.template_), train::bundled_val_path(), last);
  }
  return 0;
}

}  // namespace

int lora_finetune_main(const ConfigArgs& args) { return run_recipe("lora_finetune", args, run_finetune); }

}  // namespace qlora::recipes
