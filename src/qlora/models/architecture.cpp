#include "qlora/models/architecture.h"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace qlora::models {

using modules::DecoderLayer;

const Architecture& architecture_of(const DecoderConfig& config) { return config.family->architecture(); }

bool has_bias(const ProjectionRow& row, const DecoderConfig& config) {
  return row.bias == Bias::kAlways || (row.bias == Bias::kIfAttentionBias && config.attention_bias);
}

namespace {

// The PEFT names of the rows of target group `name` (ProjectionRow::group); empty when it is none.
std::vector<std::string> group_rows(const Architecture& arch, const std::string& name) {
  std::vector<std::string> out;
  for (const ProjectionRow& row : arch.projections)
    if (row.group && name == row.group) out.push_back(row.peft_name);
  return out;
}

}  // namespace

std::vector<std::string> peft_targets(const Architecture& arch, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  std::set<std::string> parts;
  for (const std::string& t : names) {
    const std::vector<std::string> group = group_rows(arch, t);
    if (t == kExpertsTarget && arch.experts) out.push_back(t);
    else if (!group.empty()) out.insert(out.end(), group.begin(), group.end());
    else if (const ProjectionRow* row = find_projection(arch, t)) out.push_back(row->peft_name);
    else if (is_known_target(t)) parts.insert(t);
    else out.push_back(peft_target(arch, t));  // throws, naming the allowed names
  }
  for (const ProjectionRow& row : arch.projections) {
    size_t named = 0;
    for (const char* p : row.fused_parts) named += parts.erase(p);
    if (named == row.fused_parts.size() && named > 0) out.push_back(row.peft_name);
    else if (named > 0) {
      std::string all;
      for (const char* p : row.fused_parts) all += (all.empty() ? "" : ", ") + std::string(p);
      throw std::invalid_argument(std::string(arch.family) + " fuses " + all + " into " + row.peft_name +
                                  ": target all of them (or '" + row.short_name + "'), not some");
    }
  }
  if (!parts.empty()) peft_target(arch, *parts.begin());  // a name of another family: throws
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

bool is_known_target(const std::string& name) {
  for (const Family* f : all_families()) {
    if (name == kExpertsTarget && f->architecture().experts) return true;
    if (!group_rows(f->architecture(), name).empty()) return true;
    const ProjectionRow* row = find_projection(f->architecture(), name);
    if (row && name == row->short_name) return true;
  }
  return false;
}

std::string known_target_names() {
  std::vector<std::string> seen;
  std::vector<std::string> groups;
  for (const Family* f : all_families())
    for (const ProjectionRow& row : f->architecture().projections) {
      if (std::find(seen.begin(), seen.end(), row.short_name) == seen.end()) seen.push_back(row.short_name);
      if (row.group && std::find(groups.begin(), groups.end(), row.group) == groups.end()) groups.push_back(row.group);
    }
  seen.push_back(kExpertsTarget);
  seen.insert(seen.end(), groups.begin(), groups.end());
  std::string out;
  for (const std::string& n : seen) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::string hf_module(const char* pattern, int64_t layer) {
  std::string s = pattern;
  const auto at = s.find("{i}");
  if (at != std::string::npos) s.replace(at, 3, std::to_string(layer));
  return s;
}

std::string hf_key(const ProjectionRow& row, int64_t layer) { return hf_module(row.hf_module, layer) + ".weight"; }
std::string hf_key(const NormRow& row, int64_t layer) {
  return hf_module(row.hf_module, layer) + (row.bare ? "" : ".weight");
}
std::string hf_bias_key(const ProjectionRow& row, int64_t layer) { return hf_module(row.hf_module, layer) + ".bias"; }

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
  std::string experts = arch.experts ? std::string(", ") + kExpertsTarget : "";
  for (const ProjectionRow& row : arch.projections)
    if (row.group && experts.find(std::string(", ") + row.group) == std::string::npos) experts += std::string(", ") + row.group;
  throw std::invalid_argument("unknown LoRA target '" + name + "' for " + arch.family + " (expected one of " +
                              projection_names(arch, false) + experts + ", or " + projection_names(arch, true) +
                              experts + ")");
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

int64_t dim_size(Dim d, const DecoderConfig& c, int64_t layer) {
  switch (d) {
    case Dim::kHidden: return c.hidden_size;
    case Dim::kQHeads: return c.num_attention_heads * c.layer_head_dim(layer);
    case Dim::kKvHeads: return c.layer_kv_heads(layer) * c.layer_head_dim(layer);
    case Dim::kIntermediate: return c.layer_intermediate(layer);
    case Dim::kVocab: return c.vocab_size;
    case Dim::kHeadDim: return c.layer_head_dim(layer);
    case Dim::kQkv: return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
    case Dim::kGateUp: return 2 * c.intermediate_size;
    case Dim::kQHeadsGated: return 2 * c.num_attention_heads * c.head_dim;
    case Dim::kLinearQkv: return c.gated_delta.conv_dim();
    case Dim::kLinearValue: return c.gated_delta.value_dim();
    case Dim::kLinearHeads: return c.gated_delta.num_value_heads;
    case Dim::kLinearHeadDim: return c.gated_delta.value_head_dim;
    case Dim::kOne: return 1;
    case Dim::kConvKernel: return c.gated_delta.conv_kernel;
    case Dim::kPerLayer: return c.per_layer_input_dim;
    case Dim::kPerLayerAll: return c.num_hidden_layers * c.per_layer_input_dim;
    case Dim::kPerLayerVocab: return c.per_layer_input_vocab;
    case Dim::kExperts: return c.moe.num_experts;
    case Dim::kHeads: return c.num_attention_heads;
  }
  throw std::logic_error("dim_size: unknown Dim");
}

bool in_layer(Mixer mixer, const DecoderConfig& c, int64_t layer) {
  switch (mixer) {
    case Mixer::kAny: return true;
    case Mixer::kAttention: return !c.is_linear(layer);
    case Mixer::kLinear: return c.is_linear(layer);
    case Mixer::kOwnKv: return !c.is_linear(layer) && !c.is_kv_shared(layer);
    case Mixer::kOwnV: return in_layer(Mixer::kOwnKv, c, layer) && !(c.attention_k_eq_v && !c.is_sliding(layer));
    case Mixer::kPerLayerInput: return c.per_layer_input_dim > 0;
    case Mixer::kDenseMlp: return !c.is_moe(layer);
    case Mixer::kMoe: return c.is_moe(layer);
  }
  throw std::logic_error("in_layer: unknown Mixer");
}

std::vector<int64_t> norm_shape(const NormRow& row, const DecoderConfig& c, int64_t layer) {
  std::vector<int64_t> shape{dim_size(row.size, c, layer)};
  for (int k = 1; k < row.rank; ++k) shape.push_back(dim_size(row.tail[k - 1], c, layer));
  return shape;
}

std::vector<int64_t> embed_shape(const EmbedRow& row, const DecoderConfig& c) {
  std::vector<int64_t> shape;
  for (Dim d : row.shape) shape.push_back(dim_size(d, c, 0));
  return shape;
}

bool has_embed_rows(const DecoderConfig& c) { return c.per_layer_input_dim > 0; }

std::vector<int64_t> projection_shape(const ProjectionRow& row, const DecoderConfig& c, int64_t layer) {
  return {dim_size(row.out, c, layer), dim_size(row.in, c, layer)};
}

}  // namespace qlora::models
