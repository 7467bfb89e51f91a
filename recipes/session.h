// What every training recipe shares (lora_finetune, lora_dpo, lora_grpo), so that none copies
// another's loop: the model (NF4 base + LoRA, sharded by the engine), the optimizer and schedule, resume,
// the step loop with its non-finite guard, resume checkpoints, per-epoch exports and the metrics.
// A recipe keeps what is its own: its data, the loss of one optimizer step, its validation. The
// benches set up the models they time here too (build_model, make_adamw; bench/recipe_model.h).
//
//   int my_recipe_main(args) { return run_recipe("my_recipe", args, [](Session& s) { ...; return train(s, m, parts); }); }
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/checkpoint/resume.h"
#include "qlora/config/config.h"
#include "qlora/data/dataset.h"
#include "qlora/data/sampler.h"
#include "qlora/data/split.h"
#include "qlora/data/tokenizer.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/models/decoder.h"
#include "qlora/optim/adamw.h"
#include "qlora/report/metrics.h"
#include "qlora/train/evaluate.h"
#include "qlora/train/output_dir.h"
#include "recipes/recipe_config.h"

namespace qlora::recipes {

// One run on this rank: its config, device and world, and the base checkpoint it trains.
struct Session {
  std::string recipe;  // "lora_finetune": recorded in resume checkpoints, named in errors
  const config::RecipeConfig& cfg;
  c10::Device device;
  engine::World& world;
  bool lead = false;     // rank 0: prints, logs metrics, commits checkpoints and exports
  std::string base_dir;  // model.checkpoint_dir, or the embedded default's tiny base (written here)
  // checkpoint.gguf: what rank 0 adds to each epoch's export (checked before the model loads).
  std::function<void(const std::string&)> add_gguf;
  // Which ranks see the same checkpoint.output_dir (one per node where it is node-local): each
  // directory's lead writes what every directory needs (the tiny base, resume checkpoints'
  // commits, the DPO reference table); exports, metrics and TensorBoard go to rank 0's only.
  train::OutputDirs dirs;
  bool dir_lead() const { return dirs.leads(world.rank()); }
};

// The tokenizer and how records are rendered (data.template "auto" resolved for the tokenizer).
struct TextSetup {
  std::string path, tokenizer_path;  // the training file; the tokenizer file
  data::Tokenizer tokenizer;
  data::DatasetOptions options;
  std::string template_note;  // what "auto" chose, for the log
};
TextSetup open_text(const Session& s);

// The model as the engine holds it: every rank builds the same model (same seed, same adapters)
// and keeps its share of each layer as soon as the layer is loaded.
struct Model {
  models::DecoderModel decoder;
  std::shared_ptr<engine::ShardedDecoder> engine;
};
// Loads, shards and seeds (dropout's generator per rank); checks the tokenizer fits the vocabulary.
// data_token_ids: every id the run's data (training and validation, the whole set, as every rank
// loads it) feeds in or scores; their untrained rows get model.untrained_tokens
// (train/untrained_tokens.h) before the model is sharded.
Model setup_model(const Session& s, const TextSetup& text, const std::vector<int64_t>& data_token_ids);

// Whether the run trains the vision tower (lora.vision_targets, lora.train_projector).
bool trains_vision_tower(const config::RecipeConfig& cfg);
// Where the run's data holds images (train_images: the training set's; other_images: validation's) or
// the config trains the tower: the checkpoint's vision tower (models/vision) as m.decoder.tower, its
// encoder linears in NF4 where the base is, and the BatchImages its batches take; else nothing is
// loaded and the BatchImages is empty (text). With lora.vision_targets / lora.train_projector its
// adapters (drawn from training.seed's generator: the same on every rank) and the projector's fp32 copy
// join the engine's trainable groups (before the optimizer is made); else it stays frozen. Errors name
// the checkpoint when it has no tower, and the key when it is set for a text-only checkpoint or for
// training data without images.
train::BatchImages load_vision_tower(const Session& s, Model& m, const data::DatasetOptions& options,
                                     bool train_images, bool other_images);

// Makes the decoder from the load options the config gives (on_layer_loaded shards each layer as it
// is made): a bench's model built in memory, or a checkpoint loaded its own way.
using DecoderBuilder = std::function<models::DecoderModel(const models::DecoderLoadOptions&)>;

// setup_model without a tokenizer or data, for a program that trains without a recipe's data (the
// benches): the decoder loaded from s.base_dir with the embedding and head stored as a recipe stores
// them, or made by `build` (its options leave that storage to it: the compute dtype unless it says
// otherwise), each layer sharded as it is made; `prepare` sees the model whole (its embedding and
// head not yet sharded); then finished, in training mode, dropout's generator seeded per rank.
Model build_model(const Session& s, const DecoderBuilder& build = {},
                  const std::function<void(models::DecoderModel&)>& prepare = {});

// AdamW over this rank's flat shards of the adapters, with the config's optim settings.
std::unique_ptr<optim::AdamW> make_adamw(const config::RecipeConfig& cfg, const Model& m);

// Where the loop is: epoch and step within it (0-based), optimizer steps done.
struct Position {
  int64_t epoch = 0, step_in_epoch = 0, global_step = 0;
};

// One optimizer step's gradients as a recipe computed them, summed over every rank.
struct StepResult {
  double loss = 0.0;
  int64_t tokens = 0;        // the step's trained tokens
  double grad_norm = 0.0;    // filled by train()
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // the recipe's own metrics
};

// What a recipe hands train(): its sampler (one global batch per micro-step; saved and resumed
// with the run), its step and its validation.
struct RecipeParts {
  data::Sampler* sampler = nullptr;
  int64_t records = 0;        // training records, for the "too few for one step" error
  std::string records_name;   // "samples", "pairs"
  // grad_accum micro-batches of this rank's rows, backward done through backward_micro_batch;
  // loss/tokens/extra summed over ranks. train() clips and steps (or skips a non-finite step).
  std::function<StepResult(int64_t step)> step;
  // Validation now (collective: every rank computes, rank 0 logs what it returns). Empty: the run
  // has no validation data.
  std::function<report::ValidationMetrics(const Position&)> validate;
  // Optimizer steps each of the sampler's global batches feeds (GRPO's num_iterations: its rollouts
  // are used for that many updates); an epoch is batches_per_epoch / grad_accum times this.
  int64_t steps_per_batch = 1;
  // The recipe's own state a resumed run needs (GRPO's rollouts still to be reused), saved with each
  // resume checkpoint as this rank's tensors (names prefixed by the recipe); restored from this
  // rank's saved tensors when the mesh is the same, else from every rank's (`remesh`). Empty: none.
  std::function<std::vector<std::pair<std::string, at::Tensor>>()> save_state;
  std::function<void(const checkpoint::ResumeCheckpoint& ck, bool remesh, const std::string& where)> load_state;
};

// The validation records: `validation` (data.val_path's, as the caller loaded them) plus, with
// data.val_fraction, that seeded fraction of `train` moved out of it (the same split on any number
// of ranks). training.eval_every_steps without validation data is an error.
template <class Record>
void hold_out_validation(const config::RecipeConfig& cfg, std::vector<Record>& train, std::vector<Record>& validation) {
  if (cfg.data.val_fraction > 0) {
    const data::SplitIndices split = data::split_validation(static_cast<int64_t>(train.size()), cfg.data.val_fraction,
                                                            static_cast<uint64_t>(cfg.training.seed));
    std::vector<Record> kept;
    for (int64_t i : split.val) validation.push_back(train[static_cast<size_t>(i)]);
    for (int64_t i : split.train) kept.push_back(train[static_cast<size_t>(i)]);
    train = std::move(kept);
  }
  if (cfg.training.eval_every_steps > 0 && validation.empty())
    throw std::invalid_argument("training.eval_every_steps = " + std::to_string(cfg.training.eval_every_steps) +
                                " needs validation data: set data.val_path or data.val_fraction");
}

// Backward of one micro-batch's loss (already divided by what the whole step normalises by);
// gradients are reduced across ranks after the last one.
void backward_micro_batch(Model& m, const at::Tensor& loss, bool last);

// Sets up the optimizer, resumes if asked, runs the epochs (steps, guard, validation, resume
// checkpoints, per-epoch exports) and returns the final position. Collective.
Position train(const Session& s, Model& m, const TextSetup& text, RecipeParts& parts);

// Rank 0's last line of a run: the steps (of `what`, e.g. the loss), where the metrics and exports
// are, and the command that tries the last export.
void print_done(const Session& s, const Position& p, const std::string& what);

// The rank's entry: config from --config and overrides, compute dtype resolved, world joined,
// `body` run; an error is printed naming the culprit ranks and gives exit status 1.
int run_recipe(const std::string& name, const ConfigArgs& args, const std::function<int(Session&)>& body);

}  // namespace qlora::recipes
