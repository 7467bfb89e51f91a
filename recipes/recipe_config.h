// What every command that reads a lora_finetune config shares (`qlora run lora_finetune`,
// `qlora data`): the config from --config FILE (or the embedded default) and overrides, and the
// tokenizer it names or its checkpoint holds.
#pragma once

#include <string>
#include <vector>

#include "qlora/config/config.h"
#include "qlora/data/prompts.h"

namespace CLI {
class App;
}

namespace qlora::recipes {

// What a command that reads a config takes: `--config FILE` and `section.key=value ...` overrides.
struct ConfigArgs {
  std::string path;  // "": the embedded tiny default
  std::vector<std::string> overrides;
};

// Adds --config FILE and the positional overrides to `cmd` (cli/cli.h), parsed into `a`.
void add_config_args(CLI::App& cmd, ConfigArgs& a);

// The config of --config FILE (none: the embedded tiny default, configs/tiny_qlora.toml compiled
// in) with the overrides applied; a malformed override is an error naming it.
config::RecipeConfig load_recipe_config(const ConfigArgs& a);

// The checkpoint the run trains: model.checkpoint_dir (a Hub id: its snapshot in the local Hugging
// Face cache, io/hub_cache.h), or for the embedded default the tiny base under
// checkpoint.output_dir (written on first use by train::ensure_tiny_base).
std::string base_model_dir(const config::RecipeConfig& cfg);

// The base's Hub name, for base_model_name_or_path and export file names: model.name, else the
// repo id when model.checkpoint_dir is a Hub id found in the cache, else "".
std::string base_model_name(const config::RecipeConfig& cfg);

// The training data file: data.path (a directory or Hub data set id: its data.split file,
// data/data_files.h), or for the embedded default the bundled tiny_tasks.jsonl.
std::string train_data_path(const config::RecipeConfig& cfg);

// The validation data file: data.val_path; for the embedded default's data (data.path "") without
// data.val_fraction, the bundled held-out file; else "" (none, or the val_fraction split).
std::string val_data_path(const config::RecipeConfig& cfg);

// GRPO's prompt records of `path` (data.format = "prompt", data/prompts.h), each refused naming its
// line when it fills data.max_seq_len (no room for a completion) or lacks what `rewards` read
// (lora_grpo.cpp; `qlora data` previews the same records).
std::vector<data::PromptRecord> load_grpo_prompts(const std::string& path,
                                                  const data::Tokenizer& tok, const data::DatasetOptions& options,
                                                  const train::Rewards& rewards);

// model.tokenizer, else the checkpoint's tokenizer.model, original/tokenizer.model or tokenizer.json
// (Tokenizer::find_file's order; Llama-3 repositories keep Meta's tiktoken file under original/).
std::string find_tokenizer(const config::RecipeConfig& cfg, const std::string& base_dir);

}  // namespace qlora::recipes
