#include "qlora/config/builders.h"

#include "qlora/data/chat_template.h"

namespace qlora::config {

data::DatasetOptions dataset_options(const DataConfig& data_cfg, const data::Tokenizer& tokenizer, std::string* note) {
  data::DatasetOptions o;
  o.kind = data_cfg.format;
  if (data_cfg.template_) o.prompt_template = *data_cfg.template_;
  o.max_seq_len = data_cfg.max_seq_len;
  o.train_on_input = data_cfg.train_on_input;
  // An empty field key keeps the format's usual name.
  const auto set = [](std::string& field, const std::string& configured) {
    if (!configured.empty()) field = configured;
  };
  set(o.instruction_field, data_cfg.instruction_field);
  set(o.input_field, data_cfg.input_field);
  set(o.output_field, data_cfg.output_field);
  set(o.messages_field, data_cfg.messages_field);
  set(o.text_field, data_cfg.text_field);
  std::string chosen = data::resolve_dataset_options(o, tokenizer, data_cfg.add_bos, data_cfg.add_eos,
                                                     data_cfg.template_kwargs);
  if (note) *note = std::move(chosen);
  return o;
}

checkpoint::PromptFormat prompt_format(const data::DatasetOptions& o) {
  checkpoint::PromptFormat p{data::dataset_kind_name(o.kind),
                             o.kind == data::DatasetKind::kText ? "" : std::string(data::template_name(o.prompt_template)),
                             o.train_on_input, o.add_bos, o.add_eos};
  if (o.chat_template) {
    p.chat_template = o.chat_template->source();
    p.chat_template_origin = o.chat_template->origin();
    p.template_kwargs = o.chat_template->kwargs();
  }
  return p;
}

data::PreferenceOptions preference_options(const RecipeConfig& cfg) {
  return {cfg.data.max_seq_len, cfg.dpo.max_prompt_len > 0 ? cfg.dpo.max_prompt_len : cfg.data.max_seq_len / 2};
}

data::SamplerOptions sampler_options(const DataConfig& data_cfg, const TrainingConfig& training,
                                     int64_t dataset_size, int64_t ranks, int64_t rank) {
  data::SamplerOptions o;
  o.dataset_size = dataset_size;
  o.batch_size = training.batch_size;
  o.seed = static_cast<uint64_t>(training.seed);
  o.shuffle = data_cfg.shuffle;
  o.drop_last = true;
  o.world_size = ranks;
  o.rank = rank;
  return o;
}

models::DecoderLoadOptions decoder_load_options(const RecipeConfig& cfg, c10::Device device,
                                            at::ScalarType frozen_dtype) {
  models::DecoderLoadOptions o;
  o.base_in_nf4 = cfg.model.base == BaseFormat::NF4;
  o.compute_dtype = cfg.model.dtype;
  o.frozen_dtype = frozen_dtype;
  o.device = device;
  o.lora_targets = cfg.lora.targets;
  o.lora_r = cfg.lora.rank;
  o.lora_alpha = cfg.lora.alpha;
  o.lora_dropout = cfg.lora.dropout;
  o.lora_use_rslora = cfg.lora.use_rslora;
  o.lora_use_dora = cfg.lora.use_dora;
  o.seed = static_cast<uint64_t>(cfg.training.seed);
  o.activation_checkpointing = cfg.model.activation_checkpointing;
  return o;
}

at::ScalarType resolve_compute_dtype(at::ScalarType configured, c10::Device device, bool fast_bf16, std::string* why) {
  if (configured != at::ScalarType::Undefined) {
    if (why != nullptr) *why = std::string("model.dtype = \"") + (configured == at::kBFloat16 ? "bf16" : "fp32") + "\"";
    return configured;
  }
  const bool bf16 = device.is_cuda() || fast_bf16;
  if (why != nullptr) {
    *why = std::string("model.dtype = \"auto\" ") +
           (device.is_cuda() ? "on a CUDA device"
            : bf16           ? "and this CPU's bf16 GEMMs outrun fp32's: AMX-BF16, or AVX512_BF16 on AMD"
                             : "and this CPU's bf16 GEMMs do not outrun fp32's (neither AMX-BF16 nor AVX512_BF16 "
                               "on AMD)");
  }
  return bf16 ? at::kBFloat16 : at::kFloat;
}

optim::AdamWOptions adamw_options(const OptimConfig& optim_cfg) {
  return {optim_cfg.lr, optim_cfg.betas[0], optim_cfg.betas[1], optim_cfg.eps, optim_cfg.weight_decay};
}

optim::LrSchedule lr_schedule(const OptimConfig& optim_cfg, int64_t total_steps) {
  optim::LrSchedule s;
  s.kind = optim_cfg.schedule;
  s.base_lr = optim_cfg.lr;
  s.warmup_steps = optim_cfg.warmup_steps;
  s.total_steps = total_steps;
  s.min_lr_ratio = optim_cfg.min_lr_ratio;
  return s;
}

engine::ShardingOptions sharding_options(const DistConfig& dist) {
  engine::ShardingOptions o;
  o.reshard_after_forward = dist.reshard_after_forward;
  o.prefetch = dist.prefetch;
  o.reduce_scatter_every_micro_batch = dist.reduce_scatter_every_micro_batch;
  return o;
}

train::Rewards grpo_rewards(const GrpoConfig& grpo) {
  return train::Rewards(grpo.rewards, grpo.reward_command, grpo.reward_command_weight,
                        static_cast<double>(grpo.reward_timeout_s));
}

}  // namespace qlora::config
