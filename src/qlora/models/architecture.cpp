#include "qlora/models/architecture.h"

#include <stdexcept>

namespace qlora::models {

using modules::DecoderLayer;

const Architecture& llama_architecture() {
  static const Architecture arch{
      "llama",
      {
          {"q", "q_proj", "model.layers.{i}.self_attn.q_proj", &DecoderLayer::q_proj, Dim::kQHeads, Dim::kHidden, {}},
          {"k", "k_proj", "model.layers.{i}.self_attn.k_proj", &DecoderLayer::k_proj, Dim::kKvHeads, Dim::kHidden, {}},
          {"v", "v_proj", "model.layers.{i}.self_attn.v_proj", &DecoderLayer::v_proj, Dim::kKvHeads, Dim::kHidden, {}},
          {"o", "o_proj", "model.layers.{i}.self_attn.o_proj", &DecoderLayer::o_proj, Dim::kHidden, Dim::kQHeads, {}},
          {"gate", "gate_proj", "model.layers.{i}.mlp.gate_proj", &DecoderLayer::gate_proj, Dim::kIntermediate,
           Dim::kHidden, {}},
          {"up", "up_proj", "model.layers.{i}.mlp.up_proj", &DecoderLayer::up_proj, Dim::kIntermediate, Dim::kHidden, {}},
          {"down", "down_proj", "model.layers.{i}.mlp.down_proj", &DecoderLayer::down_proj, Dim::kHidden,
           Dim::kIntermediate, {}},
          {"output", "lm_head", "lm_head", nullptr, Dim::kVocab, Dim::kHidden, {}},
      },
      {
          {"input_layernorm", "model.layers.{i}.input_layernorm", &DecoderLayer::input_layernorm},
          {"post_attention_layernorm", "model.layers.{i}.post_attention_layernorm",
           &DecoderLayer::post_attention_layernorm},
      },
      "model.embed_tokens.weight",
      "model.norm.weight",
  };
  return arch;
}

std::string hf_module(const char* pattern, int64_t layer) {
  std::string s = pattern;
  const auto at = s.find("{i}");
  if (at != std::string::npos) s.replace(at, 3, std::to_string(layer));
  return s;
}

std::string hf_key(const ProjectionRow& row, int64_t layer) { return hf_module(row.hf_module, layer) + ".weight"; }
std::string hf_key(const NormRow& row, int64_t layer) { return hf_module(row.hf_module, layer) + ".weight"; }

const ProjectionRow& output_projection(const Architecture& arch) {
  for (const ProjectionRow& row : arch.projections)
    if (!row.member) return row;
  throw std::logic_error(std::string("architecture '") + arch.family + "' has no output projection row");
}

const ProjectionRow* find_projection(const Architecture& arch, const std::string& name) {
  for (const ProjectionRow& row : arch.projections)
    if (name == row.short_name || name == row.peft_name) return &row;
  return nullptr;
}

std::string peft_target(const Architecture& arch, const std::string& name) {
  if (const ProjectionRow* row = find_projection(arch, name)) return row->peft_name;
  throw std::invalid_argument("unknown LoRA target '" + name + "' for " + arch.family + " (expected one of " +
                              projection_names(arch, false) + ", or " + projection_names(arch, true) + ")");
}

std::string projection_names(const Architecture& arch, bool peft_spelling) {
  std::string out;
  for (const ProjectionRow& row : arch.projections)
    out += (out.empty() ? "" : ", ") + std::string(peft_spelling ? row.peft_name : row.short_name);
  return out;
}

std::vector<std::string> layer_peft_names(const Architecture& arch) {
  std::vector<std::string> out;
  for (const ProjectionRow& row : arch.projections)
    if (row.member) out.push_back(row.peft_name);
  return out;
}

namespace {

// One body for both constnesses of layer_projections.
template <class Layer, class Out>
std::vector<Out*> projections_of(const Architecture& arch, Layer& layer) {
  std::vector<Out*> out;
  for (const ProjectionRow& row : arch.projections)
    if (row.member) out.push_back(&(layer.*row.member));
  return out;
}

}  // namespace

std::vector<modules::LoraLinear*> layer_projections(const Architecture& arch, DecoderLayer& layer) {
  return projections_of<DecoderLayer, modules::LoraLinear>(arch, layer);
}

std::vector<const modules::LoraLinear*> layer_projections(const Architecture& arch, const DecoderLayer& layer) {
  return projections_of<const DecoderLayer, const modules::LoraLinear>(arch, layer);
}

std::vector<int64_t> projection_shape(const ProjectionRow& row, const LlamaConfig& c) {
  auto size = [&c](Dim d) -> int64_t {
    switch (d) {
      case Dim::kHidden: return c.hidden_size;
      case Dim::kQHeads: return c.num_attention_heads * c.head_dim;
      case Dim::kKvHeads: return c.num_key_value_heads * c.head_dim;
      case Dim::kIntermediate: return c.intermediate_size;
      case Dim::kVocab: return c.vocab_size;
    }
    throw std::logic_error("projection_shape: unknown Dim");
  };
  return {size(row.out), size(row.in)};
}

}  // namespace qlora::models
