#include "recipe_config.h"

#include <cstdio>
#include <stdexcept>

#include "qlora/data/data_files.h"
#include "qlora/data/tokenizer.h"
#include "qlora/io/hub_cache.h"
#include "qlora/train/tiny_default.h"

namespace qlora::recipes {

extern const char* const kEmbeddedTinyConfig;  // configs/tiny_qlora.toml, compiled in

config::RecipeConfig load_recipe_config(const std::vector<std::string>& args) {
  std::string path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) throw std::invalid_argument("--config needs a file");
      path = args[++i];
    } else if (args[i].find('=') != std::string::npos && args[i][0] != '-') {
      overrides.push_back(args[i]);
    } else {
      throw std::invalid_argument("unexpected argument '" + args[i] +
                                  "'; expected --config FILE and section.key=value overrides");
    }
  }
  config::RecipeConfig cfg = path.empty() ? config::parse_config(kEmbeddedTinyConfig, "<embedded tiny_qlora.toml>")
                                          : config::load_config(path);
  if (path.empty()) std::printf("No --config: running the embedded default (configs/tiny_qlora.toml)\n");
  for (const auto& o : overrides) config::apply_override(cfg, o);
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
