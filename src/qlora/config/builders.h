// Config sections → the components' options (torchtune's builders): each function copies a
// section's keys into one component's options struct, field for field, so a key reaches its
// component in exactly one place and the recipe holds no conversions. Enum keys already hold the
// components' enums (config.h), so they are copied like any other field; a key that is a whole
// argument already (logging.progress: report::ProgressMode, checkpoint.merge_from:
// checkpoint::MergeSource) needs no builder.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "qlora/config/config.h"
#include "qlora/data/dataset.h"
#include "qlora/data/preference.h"
#include "qlora/data/sampler.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/models/decoder.h"
#include "qlora/optim/adamw.h"
#include "qlora/optim/schedule.h"
#include "qlora/train/rewards.h"

namespace qlora::config {

// kind, prompt template (data.template = "none" keeps the options' default), max_seq_len,
// train_on_input, the field names (an empty key keeps the format's usual name), then "auto" (the
// template, BOS, EOS) resolved for `tokenizer` (data::resolve_dataset_options); `note`, when
// given, receives the line saying what "auto" chose.
data::DatasetOptions dataset_options(const DataConfig& data_cfg, const data::Tokenizer& tokenizer,
                                     std::string* note = nullptr);
// What qlora.json records of resolved options.
checkpoint::PromptFormat prompt_format(const data::DatasetOptions& options);

// Preference pairs' truncation: data.max_seq_len per sequence, the prompt's last dpo.max_prompt_len
// tokens at most (0: half of data.max_seq_len).
data::PreferenceOptions preference_options(const RecipeConfig& cfg);

// Rank `rank`'s sampler: per micro-step its own batch_size rows of one global batch of batch_size x
// ranks rows (the sampler's split, data/sampler.h: the rows one process draws, whatever the number
// of ranks); drop_last keeps every global batch full.
data::SamplerOptions sampler_options(const DataConfig& data_cfg, const TrainingConfig& training,
                                     int64_t dataset_size, int64_t ranks, int64_t rank);

// model.dtype / base / activation_checkpointing, the [lora] section and training.seed (LoRA init).
// frozen_dtype is the recipe's to choose: it depends on the checkpoint's files, not on the config.
// on_layer_loaded stays empty: the sharded engine sets it.
models::DecoderLoadOptions decoder_load_options(const RecipeConfig& cfg, c10::Device device,
                                            at::ScalarType frozen_dtype);

// model.dtype = "auto" (ScalarType::Undefined) for `device`: bf16 on CUDA, and on a CPU whose bf16
// GEMMs outrun fp32's (fast_bf16: kernels::bf16_gemms_fast(), AMX-BF16 or AVX512_BF16 on AMD);
// fp32 elsewhere. An explicit dtype is returned as it is.
// `why` (if given) gets one line for the log saying what was chosen and why.
at::ScalarType resolve_compute_dtype(at::ScalarType configured, c10::Device device, bool fast_bf16,
                                     std::string* why = nullptr);

optim::AdamWOptions adamw_options(const OptimConfig& optim_cfg);

// total_steps: optimizer steps over the whole run (where cosine reaches its floor).
optim::LrSchedule lr_schedule(const OptimConfig& optim_cfg, int64_t total_steps);

engine::ShardingOptions sharding_options(const DistConfig& dist);

// The [grpo] section's rewards, compiled: grpo.rewards, grpo.reward_command with its weight and
// timeout.
train::Rewards grpo_rewards(const GrpoConfig& grpo);

}  // namespace qlora::config
