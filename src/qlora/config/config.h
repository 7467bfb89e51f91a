// The lora_finetune recipe config: TOML in, typed structs out. Defaults live in the structs, so a
// missing key means "the default"; an unknown key, a wrong type, a bad enum value or an out-of-range
// number is a ConfigError naming the file, the key and (where the TOML parser knows it) the line.
// Sections hold the components' own enums, spelled by the components' name tables (e.g.
// data::kDatasetKindNames); builders.h turns sections into the components' options.
#pragma once

#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/checkpoint/export.h"
#include "qlora/data/dataset.h"
#include "qlora/optim/schedule.h"
#include "qlora/report/metrics.h"
#include "qlora/train/nonfinite.h"
#include "qlora/train/grpo_loss.h"
#include "qlora/train/preference_loss.h"
#include "qlora/train/rewards.h"
#include "qlora/train/untrained_tokens.h"

namespace qlora::config {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Storage of the frozen decoder projections: NF4, or dense ("bf16" and "fp32" both mean dense in
// the compute dtype: models::DecoderLoadOptions has only base_in_nf4). The one enum of config's own:
// no component has a twin of it.
enum class BaseFormat { NF4, BF16, FP32 };

struct ModelConfig {
  // HF directory, or a Hub id ("org/name", "org/name@revision") found in the local Hugging Face
  // cache (io/hub_cache.h; a path that exists wins); empty = the embedded tiny default model.
  std::string checkpoint_dir;
  // What adapter_config.json records as base_model_name_or_path: a hub id ("meta-llama/Llama-2-7b-hf")
  // where the base will be found under that name; empty = checkpoint_dir as an absolute path.
  std::string name;
  // Tokenizer file; empty = the first of <checkpoint_dir>/tokenizer.model, original/tokenizer.model
  // (where Llama-3 repositories keep Meta's tiktoken file), tokenizer.json (Qwen ships only that).
  std::string tokenizer;
  // "auto" (the first CUDA device when one is present, else the CPU), "cpu", "cuda" or "cuda:N".
  std::string device = "auto";
  // Compute dtype: "bf16" | "fp32" | "auto" (ScalarType::Undefined until the recipe resolves it with
  // resolve_compute_dtype (builders.h): bf16 on CUDA and on CPUs that multiply bf16 natively).
  at::ScalarType dtype = at::kBFloat16;
  BaseFormat base = BaseFormat::NF4;      // "nf4" | "bf16" | "fp32"
  bool activation_checkpointing = true;
  // Tokens the data uses whose embedding or output row the base never trained (row norm below
  // 1e-3 x the median row norm; Llama-3 base's reserved special tokens): "error" refuses naming
  // them, "mean" sets those rows to the mean of the trained rows (train/untrained_tokens.h).
  train::UntrainedTokensPolicy untrained_tokens = train::UntrainedTokensPolicy::kError;
};

struct LoraConfig {
  int64_t rank = 8;
  double alpha = 16.0;
  double dropout = 0.05;
  // Short names of architecture rows (models/architecture.h): q, k, v, o, gate, up, down, output;
  // Phi-3 adds qkv and gate_up (its fused modules), which q, k, v / gate, up also select; the MoE
  // families (Qwen3-MoE, Mixtral) add experts: every routed expert's gate/up and down (peft's
  // target_parameters; neither DoRA nor dropout, as peft refuses them there); Qwen3.5-MoE adds
  // shared_expert: its shared expert's gate, up and down (shared_gate, shared_up, shared_down).
  std::vector<std::string> targets = {"q", "k", "v", "o"};
  bool use_rslora = false;  // rank-stabilised LoRA: scale alpha / sqrt(rank) instead of alpha / rank
  // DoRA (peft's use_dora): a trainable magnitude per output row of each adapted projection.
  bool use_dora = false;
  // A vision-language checkpoint's tower (models/vision/tower.h): LoRA (rank, alpha, dropout, rslora as
  // above; no DoRA) on its encoder linears with these short names (Tower::target_names: Qwen3.5 qkv,
  // proj, linear_fc1, linear_fc2; Gemma 3 and 4 q_proj, k_proj, v_proj, out_proj / o_proj, fc1 / fc2 /
  // gate_proj, up_proj, down_proj), and the projector trained in full (an fp32 master copy; peft's
  // modules_to_save). Empty / false: the tower runs frozen. lora_finetune only.
  std::vector<std::string> vision_targets;
  bool train_projector = false;
};

struct DataConfig {
  // A JSON / JSONL file; a directory or a Hub data set id ("yahma/alpaca-cleaned[@revision]", found
  // in the local Hugging Face cache) whose `split` file is chosen by the Hub's file naming
  // (data/data_files.h); empty = the embedded tiny default data set.
  std::string path;
  std::string split = "train";  // the split of a directory or Hub data set in `path`
  // Validation data: a file of the same format, or (val_path empty) a seeded val_fraction of `path`
  // held out of training. Neither: no validation.
  std::string val_path;
  double val_fraction = 0.0;
  data::DatasetKind format = data::DatasetKind::kInstruct;
  // TOML key "template". "auto": the model's own chat template (tokenizer_config.json or
  // chat_template.jinja), rendered as transformers' apply_chat_template does; a model without one
  // gets alpaca for instruct data and an error for chat data. "none" (nullopt): no template
  // chosen, for format "text", which renders without one; the other formats then get alpaca.
  std::optional<data::TemplateKind> template_ = data::TemplateKind::kAuto;
  // Keyword arguments of the model's own template (Qwen3's enable_thinking), a TOML table.
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();
  // BOS before / EOS after each sample. "auto" (nullopt): BOS as the tokenizer adds it (none with
  // the model's own template, which spells its own); EOS after every sample of a hand-written
  // template or plain text (so the model learns to stop), none after the model's own template's
  // text (its end-of-turn marker ends each answer). true/false force it; a BOS already there is
  // never doubled.
  std::optional<bool> add_bos;
  std::optional<bool> add_eos;
  int64_t max_seq_len = 512;
  bool train_on_input = false;
  bool packing = false;
  bool shuffle = true;
  // Record field names; empty = the format's usual names (instruct: instruction/input/output;
  // chat: messages or conversations, each turn role/content or from/value; text: text).
  std::string instruction_field;
  std::string input_field;
  std::string output_field;
  std::string messages_field;
  std::string text_field;
};

struct OptimConfig {
  double lr = 2e-4;
  double weight_decay = 0.01;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  int64_t warmup_steps = 100;
  optim::ScheduleKind schedule = optim::ScheduleKind::Cosine;
  double min_lr_ratio = 0.0;  // cosine floor as a fraction of lr; 0 = torchtune's schedule exactly
  double max_grad_norm = 1.0;  // <= 0 disables clipping
};

struct TrainingConfig {
  int64_t epochs = 1;
  int64_t batch_size = 2;
  int64_t grad_accum = 8;
  int64_t max_steps_per_epoch = 0;  // 0 = no cap
  int64_t seed = 42;
  // Validation loss every this many optimizer steps (0 = only at each epoch end); needs
  // data.val_path or data.val_fraction.
  int64_t eval_every_steps = 0;
  // A step whose loss or gradient norm is not finite: "stop" (error naming the step and the last
  // good checkpoint) or "skip" (no update; the run stops at a non-finite step that follows
  // max_consecutive_skips skipped ones).
  train::NonFinitePolicy on_nonfinite = train::NonFinitePolicy::kStop;
  int64_t max_consecutive_skips = 5;
};

struct CheckpointConfig {
  std::string output_dir = "out";
  int64_t save_every_steps = 0;  // 0 = only at the end of each epoch
  int64_t keep_last_n = 2;
  bool adapter_only = false;
  checkpoint::MergeSource merge_from = checkpoint::MergeSource::Nf4;
  bool resume = false;
  // GGUF types written into each epoch's export beside the merged model, with an Ollama Modelfile
  // each (gguf/modelfile.h): e.g. ["q8_0", "q4_k_m"]. Empty: none.
  std::vector<std::string> gguf;
};

struct LoggingConfig {
  int64_t log_every_steps = 1;
  report::ProgressMode progress = report::ProgressMode::Auto;
  // TensorBoard event files in OUTPUT_DIR/tb from rank 0: every number metrics.jsonl logs.
  bool tensorboard = false;
};

struct DistConfig {
  int64_t shard_size = 0;  // 0 = world size
  // How long a collective may wait for its peers: a peer that hangs (alive but stuck) fails the
  // others after this. Loading and exports, where ranks legitimately drift apart for long, wait
  // in barriers of their own.
  int64_t collective_timeout_s = 60;
  // Free a layer's gathered NF4 after its forward and gather it again for backward (the last
  // layer and the head stay): memory of one or two layers instead of the whole base.
  bool reshard_after_forward = true;
  bool prefetch = true;  // gather the next layer while this one computes
  // Reduce-scatter gradients after every micro-batch instead of only the step's last; same results.
  bool reduce_scatter_every_micro_batch = false;
};

// `qlora run lora_dpo` (lora_finetune ignores it): the loss and its constants (train/preference_loss.h).
struct DpoConfig {
  train::PreferenceLoss loss = train::PreferenceLoss::kSigmoid;  // sigmoid | ipo | hinge | orpo | simpo
  double beta = 0.1;
  double label_smoothing = 0.0;  // sigmoid, simpo: in [0, 0.5)
  double simpo_gamma = 0.5;
  // The reference log-probabilities (the base with the adapters off) computed once for every pair
  // before training and kept with the run, instead of a no-grad forward in every step; the same numbers.
  bool precompute_reference = false;
  // A pair longer than data.max_seq_len keeps at most this many of the prompt's last tokens and
  // cuts the responses (0: half of data.max_seq_len).
  int64_t max_prompt_len = 0;
};

// `qlora run lora_grpo` (the others ignore it): what a completion's reward is, the weighted sum of
// the built-in rewards and the user's program (train/rewards.h, train/reward_command.h).
//   [[grpo.rewards]]                        or  rewards = [{ kind = "answer" }, ...]
//   kind = "answer"   # field = "answer", tolerance = 1e-6
//   kind = "regex"    # pattern = "^<think>.*?</think>"
//   kind = "length"   # target = 200, max = 256 (tokens)
//   weight = 1.0      # every kind
// The rollouts and the objective take TRL 1.16's GRPOConfig names and defaults (train/grpo_loss.h).
// training.batch_size counts prompts per micro-batch per rank; each brings num_generations completions.
struct GrpoConfig {
  std::vector<train::RewardSpec> rewards;
  std::string reward_command;  // run by /bin/sh; empty: none
  double reward_command_weight = 1.0;
  int64_t reward_timeout_s = 60;  // per batch of completions; then the program's process group is killed
  int64_t num_generations = 8;    // completions per prompt (the group)
  int64_t max_completion_length = 256;  // new tokens per completion at most (also: prompt + completion <= data.max_seq_len)
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;  // 0: no top-k cut
  train::GrpoLossType loss_type = train::GrpoLossType::kDapo;
  train::ImportanceSamplingLevel importance_sampling_level = train::ImportanceSamplingLevel::kToken;
  train::RewardScaling scale_rewards = train::RewardScaling::kGroup;
  double epsilon = 0.2;
  double epsilon_high = 0.0;  // 0: epsilon
  double beta = 0.0;          // KL to the reference (adapters off); 0: no reference pass
  int64_t num_iterations = 1;  // updates per generation batch (> 1: the old policy's log-probs)
  bool mask_truncated_completions = false;
  bool use_bias_correction_kl = true;

  train::GrpoOptions options() const;
};

struct RecipeConfig {
  ModelConfig model;
  LoraConfig lora;
  DataConfig data;
  OptimConfig optim;
  TrainingConfig training;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  DistConfig dist;
  DpoConfig dpo;
  GrpoConfig grpo;
};

// Reads and parses a file; errors name the file.
RecipeConfig load_config(const std::string& toml_path);
// source_name appears in error messages in place of a file name.
RecipeConfig parse_config(std::string_view toml_text, const std::string& source_name);

// Applies one command-line override "section.key=value". The value is read as a TOML value
// (1e-4, true, ["q","v"], "text"); for string and enum keys a value that is not a TOML string is
// taken verbatim, so model.checkpoint_dir=/m/Llama-2-7b-hf works unquoted. The whole config is
// validated again afterwards; errors name the override.
void apply_override(RecipeConfig& cfg, std::string_view override_text);

// Canonical TOML, written by toml++ (a table per section, keys sorted): every key (those added
// later only when set), floats as short as reads back exactly, so parse_config(to_toml(c)) == c
// exactly. Every resume checkpoint keeps it (meta.json's config_toml); a resume parses it again.
std::string to_toml(const RecipeConfig& cfg);

enum class HashScope {
  Full,       // every key
  Exactness,  // only the keys listed by exactness_breaking_differences (see config.cpp)
};
// 16 hex digits: FNV-1a 64 over the canonical TOML of the keys in scope. Stable across runs,
// machines and builds (it depends only on to_toml's text).
std::string config_hash(const RecipeConfig& cfg, HashScope scope);

// "section.key" of every key that differs between a and b and whose change would make a resumed
// run diverge from an uninterrupted one (e.g. optim.lr, lora.rank, training.seed). Keys that only
// change where things go or what is printed (logging.*, checkpoint.output_dir, checkpoint.resume,
// ...) are never listed. Empty = resuming b from a checkpoint written under a is exact.
std::vector<std::string> exactness_breaking_differences(const RecipeConfig& a, const RecipeConfig& b);

// All "section.key" names, in canonical order, and whether each affects exactness.
struct KeyInfo {
  std::string name;
  bool affects_exactness;
};
std::vector<KeyInfo> known_keys();

// Every key of cfg as {"section.key", its value as TOML}, in known_keys' order (`qlora config`
// prints them beside the defaults). A float is as short as reads back exactly on its own.
std::vector<std::pair<std::string, std::string>> key_values(const RecipeConfig& cfg);

// One line of what "section.key" does (key_docs.cpp); empty for a key without one.
std::string_view key_description(std::string_view key);

bool operator==(const RecipeConfig& a, const RecipeConfig& b);
inline bool operator!=(const RecipeConfig& a, const RecipeConfig& b) { return !(a == b); }

}  // namespace qlora::config
