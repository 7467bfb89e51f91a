#include "recipes/recipe_config.h"

#include <cstdio>
#include <stdexcept>

#include <CLI/CLI.hpp>

#include "qlora/data/data_files.h"
#include "qlora/data/tokenizer.h"
#include "qlora/io/hub_cache.h"
#include "qlora/train/tiny_default.h"

namespace qlora::recipes {

extern const char* const kEmbeddedTinyConfig;  // configs/tiny_qlora.toml, compiled in

void add_config_args(CLI::App& cmd, ConfigArgs& a) {
  cmd.add_option("--config", a.path, "the recipe's TOML config (none: the embedded tiny default)")->type_name("FILE");
  cmd.add_option("section.key=value", a.overrides,
                 "config keys to override, e.g. lora.rank=32; every key, its default and\nwhat it does: `qlora config`");
}

config::RecipeConfig load_recipe_config(const ConfigArgs& a) {
  config::RecipeConfig cfg = a.path.empty() ? config::parse_config(kEmbeddedTinyConfig, "<embedded tiny_qlora.toml>")
                                            : config::load_config(a.path);
  if (a.path.empty()) std::printf("No --config: running the embedded default (configs/tiny_qlora.toml)\n");
  for (const auto& o : a.overrides) config::apply_override(cfg, o);
  return cfg;
}

std::string base_model_dir(const config::RecipeConfig& cfg) {
  if (cfg.model.checkpoint_dir.empty()) return cfg.checkpoint.output_dir + "/tiny_base";
  return io::resolve_local_or_hub(cfg.model.checkpoint_dir, io::HubRepoType::kModel, "model.checkpoint_dir");
}

std::string base_model_name(const config::RecipeConfig& cfg) {
  if (!cfg.model.name.empty()) return cfg.model.name;
  const std::string& dir = cfg.model.checkpoint_dir;
  const auto id = io::parse_hub_id(dir);
  return id && base_model_dir(cfg) != dir ? id->repo_id : "";
}

std::string train_data_path(const config::RecipeConfig& cfg) {
  if (cfg.data.path.empty()) return train::bundled_train_path();
  return data::resolve_data_file(cfg.data.path, cfg.data.split, "data.path");
}

std::string val_data_path(const config::RecipeConfig& cfg) {
  if (!cfg.data.val_path.empty()) return cfg.data.val_path;
  return cfg.data.path.empty() && cfg.data.val_fraction == 0 ? train::bundled_val_path() : "";
}

std::string find_tokenizer(const config::RecipeConfig& cfg, const std::string& base_dir) {
  if (!cfg.model.tokenizer.empty()) return cfg.model.tokenizer;
  try {
    return data::Tokenizer::find_file(base_dir);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(std::string(e.what()) + "; set model.tokenizer to the tokenizer file");
  }
}

}  // namespace qlora::recipes
