// Builders: every key of a section lands in the field of the component's options it names, and the
// enum keys are spelled by the components' own name tables.
#include "qlora/config/builders.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "qlora/data/tokenizer.h"

using namespace qlora;
using namespace qlora::config;

namespace {
// A sentencepiece model (Llama-2's rule: BOS, no EOS) with no chat template beside it.
data::Tokenizer sp_tokenizer() {
  const char* dir = std::getenv("QLORA_TEST_DATA");
  return data::Tokenizer::open(std::string(dir ? dir : "tests/data") + "/tokenizer/tokenizer.model");
}
}  // namespace

TEST(Builders, DatasetOptionsFromData) {
  DataConfig d;
  d.format = data::DatasetKind::kChat;
  d.template_ = data::TemplateKind::kLlama3Chat;
  d.max_seq_len = 77;
  d.train_on_input = true;
  const data::Tokenizer tok = sp_tokenizer();
  const data::DatasetOptions o = dataset_options(d, tok);
  EXPECT_EQ(o.kind, data::DatasetKind::kChat);
  EXPECT_EQ(o.prompt_template, data::TemplateKind::kLlama3Chat);
  EXPECT_EQ(o.max_seq_len, 77);
  EXPECT_TRUE(o.train_on_input);
  // Empty field keys keep the component's usual names; set ones replace them.
  EXPECT_EQ(o.instruction_field, data::DatasetOptions{}.instruction_field);
  EXPECT_EQ(o.messages_field, data::DatasetOptions{}.messages_field);
  d.instruction_field = "prompt";
  d.output_field = "response";
  d.messages_field = "dialog";
  d.text_field = "body";
  d.input_field = "context";
  const data::DatasetOptions mapped = dataset_options(d, tok);
  EXPECT_EQ(mapped.instruction_field, "prompt");
  EXPECT_EQ(mapped.input_field, "context");
  EXPECT_EQ(mapped.output_field, "response");
  EXPECT_EQ(mapped.messages_field, "dialog");
  EXPECT_EQ(mapped.text_field, "body");
  // "auto": the tokenizer's BOS (sentencepiece adds one), EOS after a hand-written template.
  EXPECT_TRUE(o.add_bos && o.add_eos);
  d.add_bos = false;
  d.add_eos = false;
  EXPECT_FALSE(dataset_options(d, tok).add_bos || dataset_options(d, tok).add_eos);
  // template = "none" keeps the options' default template.
  d.template_ = std::nullopt;
  EXPECT_EQ(dataset_options(d, tok).prompt_template, data::DatasetOptions{}.prompt_template);
  // "auto" without a template beside the tokenizer: alpaca for instruct data, an error for chat.
  d.template_ = data::TemplateKind::kAuto;
  d.format = data::DatasetKind::kInstruct;
  std::string note;
  EXPECT_EQ(dataset_options(d, tok, &note).prompt_template, data::TemplateKind::kAlpaca);
  EXPECT_NE(note.find("ships no chat template; alpaca"), std::string::npos) << note;
  d.format = data::DatasetKind::kChat;
  EXPECT_THROW(dataset_options(d, tok), std::invalid_argument);
}

TEST(Builders, SamplerOptionsSplitOneGlobalBatchBetweenRanks) {
  DataConfig d;
  d.shuffle = false;
  TrainingConfig t;
  t.batch_size = 3;
  t.seed = 1234;
  const data::SamplerOptions o = sampler_options(d, t, 500, 4, 2);
  EXPECT_EQ(o.dataset_size, 500);
  EXPECT_EQ(o.batch_size, 3);  // this rank's share of the global batch of batch_size x ranks
  EXPECT_EQ(o.seed, 1234u);
  EXPECT_FALSE(o.shuffle);
  EXPECT_TRUE(o.drop_last);
  EXPECT_EQ(o.world_size, 4);
  EXPECT_EQ(o.rank, 2);
  EXPECT_TRUE(sampler_options(DataConfig{}, t, 500, 1, 0).shuffle);
}

TEST(Builders, LlamaLoadOptionsFromModelLoraAndSeed) {
  RecipeConfig c;
  c.model.dtype = at::kFloat;
  c.model.activation_checkpointing = false;
  c.lora.targets = {"q", "output"};
  c.lora.rank = 4;
  c.lora.alpha = 7.5;
  c.lora.dropout = 0.25;
  c.training.seed = 99;
  const models::DecoderLoadOptions o = decoder_load_options(c, c10::Device(c10::kCPU), at::kBFloat16);
  EXPECT_TRUE(o.base_in_nf4);
  EXPECT_EQ(o.compute_dtype, at::kFloat);
  EXPECT_EQ(o.frozen_dtype, at::kBFloat16);
  EXPECT_EQ(o.device, c10::Device(c10::kCPU));
  EXPECT_EQ(o.lora_targets, (std::vector<std::string>{"q", "output"}));
  EXPECT_EQ(o.lora_r, 4);
  EXPECT_EQ(o.lora_alpha, 7.5);
  EXPECT_EQ(o.lora_dropout, 0.25);
  EXPECT_EQ(o.seed, 99u);
  EXPECT_FALSE(o.activation_checkpointing);
  EXPECT_FALSE(o.on_layer_loaded);  // the sharded engine's to set
  EXPECT_TRUE(decoder_load_options(RecipeConfig{}, c10::kCPU, at::kFloat).activation_checkpointing);
  EXPECT_EQ(decoder_load_options(RecipeConfig{}, c10::kCPU, at::kFloat).compute_dtype, at::kBFloat16);
  for (BaseFormat dense : {BaseFormat::BF16, BaseFormat::FP32}) {
    c.model.base = dense;
    EXPECT_FALSE(decoder_load_options(c, c10::kCPU, at::kFloat).base_in_nf4);
  }
}

TEST(Builders, ComputeDtypeAutoFollowsTheDeviceAndTheCpu) {
  RecipeConfig cfg = parse_config("[model]\ndtype = \"auto\"\n", "t.toml");
  EXPECT_EQ(cfg.model.dtype, at::ScalarType::Undefined);
  const c10::Device cpu(c10::kCPU), cuda(c10::kCUDA, 0);
  std::string why;
  EXPECT_EQ(resolve_compute_dtype(cfg.model.dtype, cpu, /*fast_bf16=*/true, &why), at::kBFloat16);
  EXPECT_NE(why.find("bf16 GEMMs outrun fp32's"), std::string::npos) << why;
  EXPECT_EQ(resolve_compute_dtype(cfg.model.dtype, cpu, false, &why), at::kFloat);
  EXPECT_NE(why.find("bf16 GEMMs do not outrun fp32's"), std::string::npos) << why;
  EXPECT_EQ(resolve_compute_dtype(cfg.model.dtype, cuda, false), at::kBFloat16);
  // An explicit dtype is the user's: kept on any device, with nothing to log.
  why.clear();
  EXPECT_EQ(resolve_compute_dtype(at::kFloat, cuda, true, &why), at::kFloat);
  EXPECT_EQ(resolve_compute_dtype(at::kBFloat16, cpu, false, &why), at::kBFloat16);
  EXPECT_EQ(why, "model.dtype = \"bf16\"");  // an explicit dtype is its own reason
  // The canonical text keeps "auto" (what the user wrote); the recipe records the resolved one.
  EXPECT_NE(to_toml(cfg).find("dtype = \"auto\""), std::string::npos);
}

TEST(Builders, AdamWOptionsFromOptim) {
  OptimConfig c;
  c.lr = 1e-3;
  c.betas = {0.8, 0.95};
  c.eps = 1e-6;
  c.weight_decay = 0.5;
  const optim::AdamWOptions o = adamw_options(c);
  EXPECT_EQ(o.lr, 1e-3);
  EXPECT_EQ(o.beta1, 0.8);
  EXPECT_EQ(o.beta2, 0.95);
  EXPECT_EQ(o.eps, 1e-6);
  EXPECT_EQ(o.weight_decay, 0.5);
}

TEST(Builders, LrScheduleFromOptimAndTotalSteps) {
  OptimConfig c;
  c.schedule = optim::ScheduleKind::Constant;
  c.lr = 3e-3;
  c.warmup_steps = 10;
  c.min_lr_ratio = 0.1;
  const optim::LrSchedule s = lr_schedule(c, 300);
  EXPECT_EQ(s.kind, optim::ScheduleKind::Constant);
  EXPECT_EQ(s.base_lr, 3e-3);
  EXPECT_EQ(s.warmup_steps, 10);
  EXPECT_EQ(s.total_steps, 300);
  EXPECT_EQ(s.min_lr_ratio, 0.1);
  EXPECT_EQ(lr_schedule(OptimConfig{}, 1).kind, optim::ScheduleKind::Cosine);
}

TEST(Builders, ShardingOptionsFromDist) {
  DistConfig d;
  d.reshard_after_forward = false;
  d.prefetch = false;
  d.reduce_scatter_every_micro_batch = true;
  const engine::ShardingOptions o = sharding_options(d);
  EXPECT_FALSE(o.reshard_after_forward);
  EXPECT_FALSE(o.prefetch);
  EXPECT_TRUE(o.reduce_scatter_every_micro_batch);
  EXPECT_TRUE(sharding_options(DistConfig{}).reshard_after_forward);
  EXPECT_TRUE(sharding_options(DistConfig{}).prefetch);
}

namespace {

// Every name of `table` is accepted for `key` (an override), lands as its value and is written back
// by to_toml under the same name.
template <class E, size_t N, class Field>
void expect_spelled_by(const std::string& key, const io::EnumName<E> (&table)[N], Field field) {
  for (const auto& [value, name] : table) {
    SCOPED_TRACE(key + "=" + name);
    RecipeConfig c;
    apply_override(c, key + "=" + name);
    EXPECT_EQ(field(c), value);
    const std::string line = key.substr(key.find('.') + 1) + " = \"" + name + "\"\n";
    EXPECT_NE(to_toml(c).find(line), std::string::npos) << to_toml(c);
  }
}

}  // namespace

TEST(Builders, EnumKeysAreSpelledByTheComponentsTables) {
  expect_spelled_by("data.format", data::kDatasetKindNames, [](const RecipeConfig& c) { return c.data.format; });
  expect_spelled_by("data.template", data::kTemplateKindNames,
                    [](const RecipeConfig& c) { return c.data.template_.value(); });
  expect_spelled_by("optim.schedule", optim::kScheduleKindNames,
                    [](const RecipeConfig& c) { return c.optim.schedule; });
  expect_spelled_by("checkpoint.merge_from", checkpoint::kMergeSourceNames,
                    [](const RecipeConfig& c) { return c.checkpoint.merge_from; });
  expect_spelled_by("logging.progress", report::kProgressModeNames,
                    [](const RecipeConfig& c) { return c.logging.progress; });
  expect_spelled_by("training.on_nonfinite", train::kNonFinitePolicyNames,
                    [](const RecipeConfig& c) { return c.training.on_nonfinite; });
  expect_spelled_by("model.untrained_tokens", train::kUntrainedTokensPolicyNames,
                    [](const RecipeConfig& c) { return c.model.untrained_tokens; });
  // The components parse and print with the same tables.
  EXPECT_EQ(checkpoint::merge_source_from_name("original"), checkpoint::MergeSource::Original);
  EXPECT_STREQ(checkpoint::merge_source_name(checkpoint::MergeSource::Nf4), "nf4");
  EXPECT_THROW(checkpoint::merge_source_from_name("bf16"), std::invalid_argument);
}
