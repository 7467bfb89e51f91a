#include "qlora/models/vision/tower.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <set>
#include <stdexcept>

#include "qlora/io/read_file.h"
#include "qlora/models/config_json.h"
#include "qlora/models/family.h"

namespace qlora::models::vision {

std::unique_ptr<Tower> load_tower(const std::string& dir, const TowerLoadOptions& opt) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  const auto text = io::read_file(path);
  if (!text) throw std::invalid_argument(path + ": cannot read the checkpoint's config.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(*text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(path + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(path + ": expected a JSON object");
  const std::string type = cfg::get_str(j, "model_type", path);
  std::string towers;
  for (const Family* f : all_families()) {
    if (!f->multimodal || !f->vision_tower) continue;
    if (type == f->multimodal->model_type) {
      const io::CheckpointDir ckpt = io::CheckpointDir::open(dir);
      return f->vision_tower(ckpt, j, opt);
    }
    towers += (towers.empty() ? "" : ", ") + std::string(f->multimodal->model_type);
  }
  throw std::invalid_argument(path + ": model_type '" + type + "' has no vision tower qlora computes (those of: " +
                              towers + ")");
}

namespace {

// "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear" -> "q_proj" (Gemma 4's clippable
// wrapper holds the linear); "model.visual.blocks.0.attn.qkv" -> "qkv".
std::string short_name(std::string module) {
  const std::string wrapped = ".linear";
  if (module.size() > wrapped.size() && module.compare(module.size() - wrapped.size(), wrapped.size(), wrapped) == 0)
    module.resize(module.size() - wrapped.size());
  return module.substr(module.rfind('.') + 1);
}

}  // namespace

int64_t add_tower_lora(Tower& tower, const std::vector<std::string>& targets, int64_t r, double alpha, bool rslora,
                       double dropout, at::Generator gen) {
  const std::vector<std::string> names = tower.target_names();
  for (const std::string& t : targets)
    if (std::find(names.begin(), names.end(), t) == names.end()) {
      std::string allowed;
      for (const std::string& n : names) allowed += (allowed.empty() ? "" : ", ") + n;
      throw std::invalid_argument("lora.vision_targets: '" + t + "' is not a linear of this vision tower (" + allowed +
                                  ")");
    }
  const std::set<std::string> wanted(targets.begin(), targets.end());
  int64_t adapted = 0;
  for (auto& [module, lin] : tower.linears()) {
    if (!wanted.count(short_name(module))) continue;
    const at::Device device = lin->base_nf4.defined() ? lin->base_nf4.device() : lin->base_dense.device();
    modules::lora_linear_add_adapter(*lin, r, alpha, dropout, gen, device);
    lin->scale = modules::lora_scale(alpha, r, rslora);
    ++adapted;
  }
  return adapted;
}

void train_projector(Tower& tower) {
  tower.original_projector.clear();
  for (auto& [name, t] : tower.projector()) {
    tower.original_projector.push_back(*t);
    *t = t->to(at::kFloat).clone().detach().set_requires_grad(true);
  }
}

OriginalProjector::OriginalProjector(Tower* tower) : tower_(tower) {
  if (!tower || tower->original_projector.empty()) return;
  size_t i = 0;
  for (auto& [name, t] : tower->projector()) {
    trained_.push_back(*t);
    *t = tower->original_projector.at(i++);
  }
}

OriginalProjector::~OriginalProjector() {
  if (trained_.empty()) return;
  size_t i = 0;
  for (auto& [name, t] : tower_->projector()) *t = trained_[i++];
}

void Tower::enter(int64_t unit) const {
  if (hooks) hooks->before_forward(unit, false);
}

void Tower::leave(int64_t unit, const at::Tensor& out) const {
  if (!hooks) return;
  hooks->after_forward(unit, false);
  if (unit >= 0) add_unit_backward_hooks(out, hooks.get(), unit, /*feeds_next=*/unit < depth());
}

void skip_forward(const Tower& tower) {
  if (!tower.hooks) return;
  for (int64_t u = -1; u <= tower.depth(); ++u) {
    tower.hooks->before_forward(u, false);
    tower.hooks->after_forward(u, false);
  }
}

std::string Tower::checkpoint_key(const std::string& name) const {
  for (const auto& [model, ckpt] : key_prefixes)
    if (name.rfind(model, 0) == 0) return ckpt + name.substr(model.size());
  return name;
}

std::vector<std::string> adapted_modules(Tower& tower) {
  std::vector<std::string> out;
  for (auto& [module, lin] : tower.linears())
    if (lin->has_lora()) out.push_back(module);
  return out;
}

std::string projector_module(Tower& tower) {
  std::vector<std::string> common;  // the components every trained tensor's module starts with
  bool first = true;
  for (auto& [name, t] : tower.projector()) {
    if (!t->requires_grad()) continue;
    std::vector<std::string> parts;
    for (size_t at = 0, dot; at <= name.size(); at = dot + 1) {
      dot = std::min(name.find('.', at), name.size());
      parts.push_back(name.substr(at, dot - at));
    }
    parts.pop_back();  // the parameter's own name
    if (first) common = parts;
    size_t k = 0;
    while (k < common.size() && k < parts.size() && common[k] == parts[k]) ++k;
    common.resize(k);
    first = false;
  }
  std::string out;
  for (const std::string& c : common) out += (out.empty() ? "" : ".") + c;
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> tower_trainable(Tower& tower) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [module, lin] : tower.linears()) {
    if (!lin->has_lora()) continue;
    out.emplace_back("base_model.model." + module + ".lora_A.weight", lin->lora_a);
    out.emplace_back("base_model.model." + module + ".lora_B.weight", lin->lora_b);
  }
  for (auto& [name, t] : tower.projector())
    if (t->requires_grad()) out.emplace_back("base_model.model." + name, *t);
  return out;
}

}  // namespace qlora::models::vision
