// `qlora run lora_dpo`: preference tuning (DPO, IPO, hinge, ORPO, SimPO) of LoRA adapters on the
// sharded NF4 base, on 1..N ranks, top to bottom. What every recipe shares (model, optimizer,
// resume, the step loop with its guard, checkpoints, exports) is in session.h; this file keeps
// what is its own:
//   setup  : preference pairs (data.format = "preference"; prompts may hold images, which both
//            sequences carry through the vision tower, frozen or with lora.vision_targets / lora.train_projector:
//            the reference has the tower's adapters off and the projector as loaded), the validation split; with
//            dpo.precompute_reference, every pair's reference log-probabilities once, kept in
//            OUTPUT_DIR/dpo_reference.safetensors for a resumed run
//   train  : one optimizer step = grad_accum micro-batches of pairs; per micro-batch the chosen and
//            rejected rows go through the policy as one batch, and (unless precomputed) through
//            the reference policy, which is the same NF4 base with the adapters off (no second
//            copy of the weights), without gradients; the loss per pair (train/preference_loss.h)
//            is divided by the step's pairs; rewards and log-probs logged as TRL names them
//   cleanup: where the exports are
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <filesystem>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/checkpoint/fingerprint.h"
#include "qlora/checkpoint/xxh64.h"
#include "qlora/config/builders.h"
#include "qlora/io/safetensors.h"
#include "qlora/data/batching.h"
#include "qlora/data/preference.h"
#include "qlora/train/evaluate.h"
#include "qlora/train/faults.h"
#include "qlora/train/preference_batch.h"
#include "qlora/train/preference_loss.h"
#include "qlora/train/untrained_tokens.h"
#include "recipes/recipes.h"
#include "recipes/session.h"

namespace qlora::recipes {

namespace {
using config::RecipeConfig;

struct Pairs {
  std::vector<data::PreferencePair> train, validation;
  std::unique_ptr<data::Sampler> sampler;  // this rank's pairs of one global batch per micro-step
  // dpo.precompute_reference: the reference's summed log-probs of each pair's chosen and rejected
  // response, [pairs] fp64 each, indexed like `train` / `validation`.
  at::Tensor ref_train, ref_validation;
  train::BatchImages images;  // where the prompts hold images: the data's processor
};

Pairs setup_pairs(const RecipeConfig& cfg, const TextSetup& text, const engine::World& world) {
  if (cfg.data.format != data::DatasetKind::kPreference)
    throw std::invalid_argument("qlora run lora_dpo trains on preference pairs: set data.format = \"preference\" "
                                "(records {\"prompt\", \"chosen\", \"rejected\"} or conversational chosen/rejected)");
  if (cfg.data.packing) throw std::invalid_argument("data.packing: lora_dpo does not pack pairs; set it to false");
  Pairs p;
  p.train = data::load_preference_pairs(text.path, text.tokenizer, text.options, config::preference_options(cfg));
  if (const std::string val = val_data_path(cfg); !val.empty())
    p.validation = data::load_preference_pairs(val, text.tokenizer, text.options, config::preference_options(cfg));
  hold_out_validation(cfg, p.train, p.validation);
  p.sampler = std::make_unique<data::Sampler>(
      config::sampler_options(cfg.data, cfg.training, static_cast<int64_t>(p.train.size()), world.size(),
                              world.rank()));
  return p;
}

// What one micro-batch of pairs contributes: the per-pair terms, and each pair's weight.
struct MicroTerms {
  train::PreferenceTerms terms;
  at::Tensor weight;  // [pairs] 1 for a real pair, 0 for a filler (validation's short shares)
};

MicroTerms micro_terms(const RecipeConfig& cfg, const Model& m, const data::Batch& b, const at::Tensor& ref,
                       c10::Device device, const train::BatchImages& images) {
  const train::PairLogps lp = train::pair_logps(m.decoder, b, cfg.dpo.loss, ref, device, images);
  return {train::preference_terms(lp, {cfg.dpo.loss, cfg.dpo.beta, cfg.dpo.label_smoothing, cfg.dpo.simpo_gamma}),
          at::ones({b.tokens.size(0) / 2}, lp.chosen.options())};
}

// The step's metrics as sums over its pairs (then over ranks), in TRL's names, divided by the pairs.
constexpr const char* kMetricNames[] = {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                        "rewards/margins", "logps/chosen",    "logps/rejected"};

std::vector<double> metric_sums(const MicroTerms& t) {
  const train::PreferenceTerms& p = t.terms;
  const at::Tensor w = t.weight.detach().to(at::kDouble);
  auto sum = [&w](const at::Tensor& v) { return (v.to(at::kDouble) * w).sum().item<double>(); };
  return {sum(p.chosen_rewards),
          sum(p.rejected_rewards),
          sum((p.chosen_rewards > p.rejected_rewards).to(at::kDouble)),
          sum(p.chosen_rewards - p.rejected_rewards),
          sum(p.chosen_logps),
          sum(p.rejected_logps)};
}

nlohmann::ordered_json metrics_json(const std::vector<double>& sums, double pairs) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (size_t i = 0; i < std::size(kMetricNames); ++i) j[kMetricNames[i]] = sums[i] / std::max(pairs, 1.0);
  return j;
}

// Rows `picked` of a precomputed [pairs, 2] reference table as the batch's [2n] (chosen, then rejected).
at::Tensor ref_rows(const at::Tensor& table, const std::vector<int64_t>& picked) {
  if (!table.defined()) return at::Tensor();
  const at::Tensor idx = at::tensor(picked, at::kLong);
  const at::Tensor rows = table.index_select(0, idx);  // [n, 2]
  return at::cat({rows.select(1, 0), rows.select(1, 1)}).to(at::kFloat);
}

StepResult dpo_step(const RecipeConfig& cfg, engine::World& world, Model& m, Pairs& d, int64_t pad_id,
                    c10::Device device, int64_t step) {
  const int64_t per_rank = cfg.training.batch_size;
  std::vector<std::vector<int64_t>> picked;
  double chosen_tokens = 0, tokens = 0;
  for (int64_t k = 0; k < cfg.training.grad_accum; ++k) {
    picked.push_back(d.sampler->next());
    for (int64_t i : picked.back()) {
      const data::PreferencePair& p = d.train[static_cast<size_t>(i)];
      const auto scored = [](const data::Sample& s) {
        return std::count_if(s.labels.begin(), s.labels.end(), [](int64_t l) { return l != data::kIgnoreIndex; });
      };
      chosen_tokens += static_cast<double>(scored(p.chosen));
      tokens += static_cast<double>(scored(p.chosen) + scored(p.rejected));
    }
  }
  const std::vector<double> totals = train::all_ranks_sum(world, {chosen_tokens, tokens}, device);
  const double pairs = static_cast<double>(per_rank * world.size() * cfg.training.grad_accum);
  const auto& poison = train::fault_plan().poison_loss;  // tests only
  const bool nan = poison && poison(world.rank(), step);
  StepResult r;
  std::vector<double> sums(std::size(kMetricNames) + 1, 0.0);  // the metrics, then the loss
  for (size_t k = 0; k < picked.size(); ++k) {
    const data::Batch b = train::pair_batch(d.train, picked[k], pad_id);
    const MicroTerms t = micro_terms(cfg, m, b, ref_rows(d.ref_train, picked[k]), device, d.images);
    at::Tensor loss = train::preference_step_loss(t.terms, pairs, totals[0]);
    if (nan) loss = loss * std::numeric_limits<double>::quiet_NaN();
    backward_micro_batch(m, loss, k + 1 == picked.size());
    const std::vector<double> s = metric_sums(t);
    for (size_t i = 0; i < s.size(); ++i) sums[i] += s[i];
    sums.back() += loss.item<double>();
  }
  sums = train::all_ranks_sum(world, sums, device);
  r.loss = sums.back();
  r.tokens = static_cast<int64_t>(totals[1]);
  sums.pop_back();
  r.extra = metrics_json(sums, pairs);
  return r;
}

// Every pair of `pairs` through `each`, this rank taking pairs rank, rank + ranks, ... in chunks of
// batch_size, all ranks running the same number of chunks (the engine's gathers are collectives):
// a short last share is filled with copies of pair 0 of weight 0. No gradients.
template <typename Each>
void over_all_pairs(const std::vector<data::PreferencePair>& pairs, engine::World& world, int64_t batch_size, Each each) {
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(pairs.size()), ranks = world.size();
  const int64_t chunks = (n + ranks * batch_size - 1) / (ranks * batch_size);
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<int64_t> picked;
    std::vector<float> weight;
    for (int64_t j = 0; j < batch_size; ++j) {
      const int64_t i = (c * batch_size + j) * ranks + world.rank();
      picked.push_back(i < n ? i : 0);
      weight.push_back(i < n ? 1.0f : 0.0f);
    }
    each(picked, at::tensor(weight));
  }
}

// The reference's summed log-probs of every pair, [pairs, 2] fp64 (chosen, rejected), the same on
// every rank: each computes its share, a sum over ranks assembles the table.
at::Tensor precompute_reference(const Model& m, engine::World& world, const std::vector<data::PreferencePair>& pairs,
                                int64_t batch_size, int64_t pad_id, c10::Device device, const train::BatchImages& images) {
  at::Tensor table = at::zeros({static_cast<int64_t>(pairs.size()), 2}, at::TensorOptions().dtype(at::kDouble).device(device));
  over_all_pairs(pairs, world, batch_size, [&](const std::vector<int64_t>& picked, const at::Tensor& weight) {
    const int64_t n = static_cast<int64_t>(picked.size());
    const at::Tensor lp =
        train::row_logps(m.decoder, train::pair_batch(pairs, picked, pad_id), device, true, images).to(at::kDouble);  // [2n]
    const at::Tensor w = weight.to(device).to(at::kDouble);
    const at::Tensor idx = at::tensor(picked, at::kLong).to(device);
    table.select(1, 0).index_add_(0, idx, lp.narrow(0, 0, n) * w);
    table.select(1, 1).index_add_(0, idx, lp.narrow(0, n, n) * w);
  });
  if (world.size() > 1) engine::wait(world.world().all_reduce_sum(table));
  return table.cpu();
}

// The validation pairs' mean loss and metrics now (collective).
report::ValidationMetrics validate(const RecipeConfig& cfg, engine::World& world, Model& m, const Pairs& d,
                                  int64_t pad_id, const Position& p, c10::Device device) {
  std::vector<double> sums(std::size(kMetricNames) + 2, 0.0);  // the metrics, the loss, the scored tokens
  // No dropout and no random numbers: training continues exactly as without this pass.
  const bool training = m.decoder.training;
  m.decoder.training = false;
  over_all_pairs(d.validation, world, cfg.training.batch_size, [&](const std::vector<int64_t>& picked, const at::Tensor& weight) {
    const data::Batch b = train::pair_batch(d.validation, picked, pad_id);
    MicroTerms t = micro_terms(cfg, m, b, ref_rows(d.ref_validation, picked), device, d.images);
    t.weight = weight.to(device);
    const std::vector<double> s = metric_sums(t);
    for (size_t i = 0; i < s.size(); ++i) sums[i] += s[i];
    sums[s.size()] += (t.terms.pair_losses.to(at::kDouble) * t.weight).sum().item<double>();
    const at::Tensor scored = b.labels.ne(data::kIgnoreIndex).sum(1).to(at::kDouble).to(device);  // [2n]
    const int64_t n = static_cast<int64_t>(picked.size());
    sums[s.size() + 1] += ((scored.narrow(0, 0, n) + scored.narrow(0, n, n)) * t.weight).sum().item<double>();
  });
  m.decoder.training = training;
  sums = train::all_ranks_sum(world, sums, device);
  const double pairs = static_cast<double>(d.validation.size());
  report::ValidationMetrics v{p.global_step, p.epoch, sums[std::size(kMetricNames)] / pairs, -1.0,
                             static_cast<int64_t>(sums.back())};
  v.extra = metrics_json(sums, pairs);
  return v;
}

// What the reference table depends on: every pair's tokens, labels and images' sources, the base's fingerprint,
// its quantization, the compute dtype and whether untrained token rows were set to the mean (not the
// adapters: the reference has them off).
std::string reference_key(const Session& s, const Pairs& d, const Model& m) {
  checkpoint::Xxh64 h;
  for (const auto* set : {&d.train, &d.validation})
    for (const data::PreferencePair& p : *set)
      for (const data::Sample* r : {&p.chosen, &p.rejected}) {
        h.update(r->tokens.data(), r->tokens.size() * sizeof(int64_t));
        h.update(r->labels.data(), r->labels.size() * sizeof(int64_t));
        for (const data::SampleImage& img : r->images) {
          h.update(img.source.name.data(), img.source.name.size());
          h.update(img.source.bytes.data(), img.source.bytes.size());
        }
      }
  return checkpoint::fingerprint_checkpoint_dir(s.base_dir) + "-" + std::to_string(h.digest()) + "-" +
         c10::toString(m.decoder.compute_dtype) + "-base" + std::to_string(static_cast<int>(s.cfg.model.base)) +
         (m.decoder.token_rows.ids.empty() ? "" : "-mean_rows" + std::to_string(m.decoder.token_rows.ids.size()));
}

// dpo.precompute_reference: the tables from OUTPUT_DIR/dpo_reference.safetensors when its key is
// this run's (a resume, or a rerun on the same pairs and base) in every rank's output_dir, else
// computed now and written there by each output_dir's lead. A resumed run thus uses the very
// numbers its first part did, on any mesh.
void reference_tables(Session& s, Pairs& d, const Model& m, int64_t pad) {
  const std::string path = s.cfg.checkpoint.output_dir + "/dpo_reference.safetensors", key = reference_key(s, d, m);
  std::optional<io::SafetensorsFile> kept;
  if (std::filesystem::exists(path)) {
    try {
      kept = io::SafetensorsFile::open(path);
      const auto it = kept->metadata().find("key");
      if (it == kept->metadata().end() || it->second != key || !kept->find("train")) kept.reset();
    } catch (const std::exception& e) {  // damaged: computed again (on every rank, which all must join)
      std::printf("dpo.precompute_reference: %s is unreadable (%s): computing the table again\n", path.c_str(), e.what());
      kept.reset();
    }
  }
  if (train::all_ranks_sum(s.world, kept ? 0.0 : 1.0, s.device) == 0) {  // every rank has it
    d.ref_train = kept->tensor("train").clone();
    if (kept->find("validation")) d.ref_validation = kept->tensor("validation").clone();
    if (s.lead) std::printf("dpo.precompute_reference: reference log-probabilities read from %s\n", path.c_str());
    return;
  }
  kept.reset();
  const int64_t batch = s.cfg.training.batch_size;
  d.ref_train = precompute_reference(m, s.world, d.train, batch, pad, s.device, d.images);
  if (!d.validation.empty())
    d.ref_validation = precompute_reference(m, s.world, d.validation, batch, pad, s.device, d.images);
  if (!s.dir_lead()) return;
  std::vector<std::pair<std::string, at::Tensor>> tables = {{"train", d.ref_train}};
  if (d.ref_validation.defined()) tables.emplace_back("validation", d.ref_validation);
  io::save_safetensors(path, tables, {{"key", key}});
  if (s.lead)
    std::printf("dpo.precompute_reference: reference log-probabilities of %zu pairs computed, kept in %s\n",
                d.train.size() + d.validation.size(), path.c_str());
}

int run_dpo(Session& s) {
  const RecipeConfig& cfg = s.cfg;
  const TextSetup text = open_text(s);
  Pairs d = setup_pairs(cfg, text, s.world);
  train::TokenIdSet ids;
  for (const auto* set : {&d.train, &d.validation})
    for (const data::PreferencePair& x : *set) ids.add(x.chosen), ids.add(x.rejected);
  Model m = setup_model(s, text, ids.ids());
  const auto has_images = [](const std::vector<data::PreferencePair>& set) {
    return std::any_of(set.begin(), set.end(), [](const data::PreferencePair& x) { return !x.chosen.images.empty(); });
  };
  d.images = load_vision_tower(s, m, text.options, has_images(d.train), has_images(d.validation));
  const int64_t pad = text.tokenizer.pad_id();
  if (cfg.dpo.precompute_reference && train::needs_reference(cfg.dpo.loss)) reference_tables(s, d, m, pad);
  RecipeParts parts;
  parts.sampler = d.sampler.get();
  parts.records = static_cast<int64_t>(d.train.size());
  parts.records_name = "preference pairs";
  parts.step = [&](int64_t step) { return dpo_step(cfg, s.world, m, d, pad, s.device, step); };
  if (!d.validation.empty())
    parts.validate = [&](const Position& p) { return validate(cfg, s.world, m, d, pad, p, s.device); };
  const Position p = train(s, m, text, parts);
  print_done(s, p, io::enum_name(train::kPreferenceLossNames, cfg.dpo.loss));
  return 0;
}

}  // namespace

int lora_dpo_main(const ConfigArgs& args) { return run_recipe("lora_dpo", args, run_dpo); }

}  // namespace qlora::recipes
