#include "qlora/models/key_layout.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <stdexcept>

namespace qlora::models {
namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// What replaces a text key's "model." and what precedes its other keys (lm_head).
struct Prefixes {
  const char* body;
  const char* head;
};

Prefixes prefixes(KeyLayout layout) {
  switch (layout) {
    case KeyLayout::kText: return {"model.", ""};
    case KeyLayout::kLanguageModel: return {"language_model.model.", "language_model."};
    case KeyLayout::kModelLanguage: return {"model.language_model.", ""};
  }
  throw std::logic_error("prefixes: unknown KeyLayout");
}

}  // namespace

std::string layout_key(KeyLayout layout, const std::string& text_key) {
  const Prefixes p = prefixes(layout);
  if (starts_with(text_key, "model.")) return p.body + text_key.substr(6);
  return p.head + text_key;
}

std::string text_key(KeyLayout layout, const std::string& key) {
  const Prefixes p = prefixes(layout);
  if (starts_with(key, p.body)) return "model." + key.substr(std::string(p.body).size());
  if (starts_with(key, p.head)) return key.substr(std::string(p.head).size());
  return key;
}

KeyLayout peft_layout(const DecoderConfig& config) {
  return config.multimodal ? KeyLayout::kModelLanguage : KeyLayout::kText;
}

namespace {

// A module name with "{i}" for a layer index as a regular expression: dots escaped, the index \d+.
std::string module_regex(const std::string& module) {
  std::string out;
  for (char ch : module) out += ch == '.' ? std::string("\\.") : std::string(1, ch);
  const auto at = out.find("{i}");
  if (at != std::string::npos) out.replace(at, 3, "\\d+");
  return out;
}

// "model.visual.blocks.3.attn.qkv" -> "model.visual.blocks.{i}.attn.qkv" (the first index).
std::string with_layer_index(const std::string& module) {
  for (size_t at = module.find('.'); at != std::string::npos; at = module.find('.', at + 1)) {
    size_t end = at + 1;
    while (end < module.size() && std::isdigit(static_cast<unsigned char>(module[end]))) ++end;
    if (end > at + 1 && (end == module.size() || module[end] == '.'))
      return module.substr(0, at + 1) + "{i}" + module.substr(end);
  }
  return module;
}

}  // namespace

std::string peft_target_pattern(const Architecture& arch, KeyLayout layout, const std::vector<std::string>& peft_names,
                                const std::vector<std::string>& tower_modules) {
  // The language model's modules under the multimodal class (model.language_model.layers.N...) and
  // under the text-only one that AutoModelForCausalLM builds from the same checkpoint
  // (model.layers.N...): an adapter must apply under either. Both prefixes leave the towers out.
  const std::string body = "model\\.", optional = layout == KeyLayout::kText ? "" : "(?:language_model\\.)?";
  std::vector<std::string> alts;
  // A name matches the row it names or ends (PEFT's rule: "gate_proj" matches shared_expert.gate_proj).
  const auto named = [&peft_names](const std::string& row) {
    for (const std::string& n : peft_names)
      if (row == n || (row.size() > n.size() && row.compare(row.size() - n.size() - 1, std::string::npos, "." + n) == 0))
        return true;
    return false;
  };
  for (const ProjectionRow& row : arch.projections) {
    if (!named(row.peft_name)) continue;
    std::string alt = module_regex(layout_key(KeyLayout::kText, row.hf_module));
    if (alt.rfind(body, 0) == 0) alt.insert(body.size(), optional);
    alts.push_back(alt);
  }
  for (const std::string& m : tower_modules) {
    const std::string alt = module_regex(with_layer_index(m));
    if (std::find(alts.begin(), alts.end(), alt) == alts.end()) alts.push_back(alt);
  }
  std::string out;
  for (const std::string& a : alts) out += (out.empty() ? "" : "|") + a;
  return out;
}

KeyLayout key_layout_of(const io::CheckpointDir& ckpt, const DecoderConfig& config) {
  if (!config.multimodal) return KeyLayout::kText;
  const std::string embed = "model.embed_tokens.weight";
  for (KeyLayout l : {KeyLayout::kLanguageModel, KeyLayout::kModelLanguage})
    if (ckpt.contains(layout_key(l, embed))) return l;
  throw std::invalid_argument("checkpoint '" + ckpt.path() + "': no language model weights: neither '" +
                              layout_key(KeyLayout::kLanguageModel, embed) + "' nor '" +
                              layout_key(KeyLayout::kModelLanguage, embed) + "' is present (config.json says " +
                              config.model_type + ", whose language model is under one of these prefixes)");
}

bool is_language_model_key(KeyLayout layout, const std::string& key) {
  const Prefixes p = prefixes(layout);
  return starts_with(key, p.body) || key == layout_key(layout, "lm_head.weight");
}

SkippedWeights skipped_weights(const io::CheckpointDir& ckpt, KeyLayout layout) {
  SkippedWeights s;  // a text-only checkpoint's too: Qwen3.5's multi-token prediction block (mtp.*)
  for (const std::string& key : ckpt.tensor_names()) {
    if (is_language_model_key(layout, key)) continue;
    if (s.first.empty()) s.first = key;
    ++s.tensors;
    const io::TensorInfo& t = ckpt.file_of(key).info(key);
    s.bytes += static_cast<int64_t>(t.end - t.begin);
  }
  return s;
}

std::string skipped_weights_note(const SkippedWeights& s) {
  if (s.tensors == 0) return "";
  char size[32];
  std::snprintf(size, sizeof size, "%.3g MB", static_cast<double>(s.bytes) / 1e6);
  return "skipped " + std::to_string(s.tensors) + " tensors (" + size + ", " + std::to_string(s.bytes) +
         " bytes) outside the language model (a vision tower, a multi-modal projector, mtp.*; e.g. '" + s.first +
         "'): not computed, copied unchanged into merged exports";
}

}  // namespace qlora::models
