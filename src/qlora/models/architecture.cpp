#include "qlora/models/architecture.h"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace qlora::models {

using modules::DecoderLayer;

namespace {

// The Llama block's rows; `attn_bias` is the bias rule of q/k/v (o_proj's: `o_bias`).
std::vector<ProjectionRow> llama_rows(Bias attn_bias, Bias o_bias) {
  return {
      {"q", "q_proj", "model.layers.{i}.self_attn.q_proj", &DecoderLayer::q_proj, Dim::kQHeads, Dim::kHidden, {},
       attn_bias},
      {"k", "k_proj", "model.layers.{i}.self_attn.k_proj", &DecoderLayer::k_proj, Dim::kKvHeads, Dim::kHidden, {},
       attn_bias},
      {"v", "v_proj", "model.layers.{i}.self_attn.v_proj", &DecoderLayer::v_proj, Dim::kKvHeads, Dim::kHidden, {},
       attn_bias},
      {"o", "o_proj", "model.layers.{i}.self_attn.o_proj", &DecoderLayer::o_proj, Dim::kHidden, Dim::kQHeads, {},
       o_bias},
      {"gate", "gate_proj", "model.layers.{i}.mlp.gate_proj", &DecoderLayer::gate_proj, Dim::kIntermediate,
       Dim::kHidden, {}},
      {"up", "up_proj", "model.layers.{i}.mlp.up_proj", &DecoderLayer::up_proj, Dim::kIntermediate, Dim::kHidden, {}},
      {"down", "down_proj", "model.layers.{i}.mlp.down_proj", &DecoderLayer::down_proj, Dim::kHidden,
       Dim::kIntermediate, {}},
      {"output", "lm_head", "lm_head", nullptr, Dim::kVocab, Dim::kHidden, {}},
  };
}

// Phi-3: q/k/v stacked in qkv_proj, gate/up in gate_up_proj (peft targets the fused modules).
std::vector<ProjectionRow> phi3_rows() {
  return {
      {"qkv", "qkv_proj", "model.layers.{i}.self_attn.qkv_proj", &DecoderLayer::qkv_proj, Dim::kQkv, Dim::kHidden,
       {"q", "k", "v"}},
      {"o", "o_proj", "model.layers.{i}.self_attn.o_proj", &DecoderLayer::o_proj, Dim::kHidden, Dim::kQHeads, {}},
      {"gate_up", "gate_up_proj", "model.layers.{i}.mlp.gate_up_proj", &DecoderLayer::gate_up_proj, Dim::kGateUp,
       Dim::kHidden, {"gate", "up"}},
      {"down", "down_proj", "model.layers.{i}.mlp.down_proj", &DecoderLayer::down_proj, Dim::kHidden,
       Dim::kIntermediate, {}},
      {"output", "lm_head", "lm_head", nullptr, Dim::kVocab, Dim::kHidden, {}},
  };
}

constexpr NormRow kInputNorm{"input_layernorm", "model.layers.{i}.input_layernorm", &DecoderLayer::input_layernorm};
constexpr NormRow kPostAttnNorm{"post_attention_layernorm", "model.layers.{i}.post_attention_layernorm",
                            &DecoderLayer::post_attention_layernorm};
constexpr NormRow kPreFfnNorm{"pre_feedforward_layernorm", "model.layers.{i}.pre_feedforward_layernorm",
                          &DecoderLayer::pre_feedforward_layernorm};
constexpr NormRow kPostFfnNorm{"post_feedforward_layernorm", "model.layers.{i}.post_feedforward_layernorm",
                           &DecoderLayer::post_feedforward_layernorm};
constexpr NormRow kQNorm{"q_norm", "model.layers.{i}.self_attn.q_norm", &DecoderLayer::q_norm, Dim::kHeadDim};
constexpr NormRow kKNorm{"k_norm", "model.layers.{i}.self_attn.k_norm", &DecoderLayer::k_norm, Dim::kHeadDim};
// OLMo's q/k norms span all heads.
constexpr NormRow kQNormAll{"q_norm", "model.layers.{i}.self_attn.q_norm", &DecoderLayer::q_norm, Dim::kQHeads};
constexpr NormRow kKNormAll{"k_norm", "model.layers.{i}.self_attn.k_norm", &DecoderLayer::k_norm, Dim::kKvHeads};

Architecture make(const char* family, std::vector<ProjectionRow> rows, std::vector<NormRow> norms) {
  return {family, std::move(rows), std::move(norms), "model.embed_tokens.weight", "model.norm.weight"};
}

const Architecture& qwen2_architecture() {
  static const Architecture a =
      make("qwen2", llama_rows(Bias::kAlways, Bias::kNone), {kInputNorm, kPostAttnNorm});
  return a;
}
const Architecture& qwen3_architecture() {
  static const Architecture a = make("qwen3", llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias),
                                     {kInputNorm, kPostAttnNorm, kQNorm, kKNorm});
  return a;
}
const Architecture& gemma2_architecture() {
  static const Architecture a = make("gemma2", llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias),
                                     {kInputNorm, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm});
  return a;
}
const Architecture& gemma3_architecture() {
  static const Architecture a =
      make("gemma3", llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias),
           {kInputNorm, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm, kQNorm, kKNorm});
  return a;
}
const Architecture& phi3_architecture() {
  static const Architecture a = make("phi3", phi3_rows(), {kInputNorm, kPostAttnNorm});
  return a;
}

const Architecture& smollm3_architecture() {
  static const Architecture a =
      make("smollm3", llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias), {kInputNorm, kPostAttnNorm});
  return a;
}

// OLMo 2 and 3: no input norms; post-norms and all-head q/k norms.
const Architecture& olmo2_architecture() {
  static const Architecture a = make("olmo2", llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias),
                                     {kPostAttnNorm, kPostFfnNorm, kQNormAll, kKNormAll});
  return a;
}

// Qwen3.5: attention layers with the output gate in q_proj and per-head (1 + w) q/k norms, Gated
// DeltaNet layers with their own projections, conv, decay parameters and gated norm; one MLP for both.
const Architecture& qwen35_architecture() {
  static const Architecture a = [] {
    std::vector<ProjectionRow> llama = llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias);
    std::vector<ProjectionRow> rows;
    for (size_t i = 0; i < 4; ++i) {  // q, k, v, o
      rows.push_back(llama[i]);
      rows.back().mixer = Mixer::kAttention;
    }
    rows[0].out = Dim::kQHeadsGated;
    const auto linear = [](const char* short_name, const char* peft, const char* module,
                           modules::LoraLinear DecoderLayer::*member, Dim out, Dim in) {
      return ProjectionRow{short_name, peft, module, member, out, in, {}, Bias::kNone, Mixer::kLinear};
    };
    rows.push_back(linear("linear_qkv", "in_proj_qkv", "model.layers.{i}.linear_attn.in_proj_qkv",
                          &DecoderLayer::in_proj_qkv, Dim::kLinearQkv, Dim::kHidden));
    rows.push_back(linear("linear_z", "in_proj_z", "model.layers.{i}.linear_attn.in_proj_z", &DecoderLayer::in_proj_z,
                          Dim::kLinearValue, Dim::kHidden));
    rows.push_back(linear("linear_b", "in_proj_b", "model.layers.{i}.linear_attn.in_proj_b", &DecoderLayer::in_proj_b,
                          Dim::kLinearHeads, Dim::kHidden));
    rows.push_back(linear("linear_a", "in_proj_a", "model.layers.{i}.linear_attn.in_proj_a", &DecoderLayer::in_proj_a,
                          Dim::kLinearHeads, Dim::kHidden));
    rows.push_back(linear("linear_out", "out_proj", "model.layers.{i}.linear_attn.out_proj", &DecoderLayer::out_proj,
                          Dim::kHidden, Dim::kLinearValue));
    rows.insert(rows.end(), llama.begin() + 4, llama.end());  // gate, up, down, output
    NormRow q_norm = kQNorm, k_norm = kKNorm;
    q_norm.mixer = k_norm.mixer = Mixer::kAttention;
    const std::vector<NormRow> norms = {
        kInputNorm,
        kPostAttnNorm,
        q_norm,
        k_norm,
        {"linear_attn.conv1d", "model.layers.{i}.linear_attn.conv1d", &DecoderLayer::conv1d, Dim::kLinearQkv,
         Mixer::kLinear, false, 3, {Dim::kOne, Dim::kConvKernel}},
        {"linear_attn.A_log", "model.layers.{i}.linear_attn.A_log", &DecoderLayer::A_log, Dim::kLinearHeads,
         Mixer::kLinear, true},
        {"linear_attn.dt_bias", "model.layers.{i}.linear_attn.dt_bias", &DecoderLayer::dt_bias, Dim::kLinearHeads,
         Mixer::kLinear, true},
        {"linear_attn.norm", "model.layers.{i}.linear_attn.norm", &DecoderLayer::linear_norm, Dim::kLinearHeadDim,
         Mixer::kLinear},
    };
    return make("qwen3_5", rows, norms);
  }();
  return a;
}

// Gemma 4: Gemma 3's block with w-scaled norms (the config's), KV-shared layers without k/v
// projections and k_norm, full layers without v_proj under attention_k_eq_v, and per-layer inputs: a
// gate and a projection (LoRA targets "ple_gate", "ple_proj"; peft wraps them as it wraps any
// nn.Linear), their norm and a layer_scalar in each layer, and the embedding unit's table, projection
// and norm (frozen: the embedding unit has no backward, so per_layer_model_projection is no target).
const Architecture& gemma4_architecture() {
  static const Architecture a = [] {
    std::vector<ProjectionRow> rows = llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias);
    rows[1].mixer = Mixer::kOwnKv;  // k_proj
    rows[2].mixer = Mixer::kOwnV;   // v_proj
    const auto per_layer = [](const char* short_name, const char* peft, const char* module,
                              modules::LoraLinear DecoderLayer::*member, Dim out, Dim in) {
      return ProjectionRow{short_name, peft, module, member, out, in, {}, Bias::kNone, Mixer::kPerLayerInput};
    };
    rows.insert(rows.end() - 1, per_layer("ple_gate", "per_layer_input_gate", "model.layers.{i}.per_layer_input_gate",
                                          &DecoderLayer::per_layer_input_gate, Dim::kPerLayer, Dim::kHidden));
    rows.insert(rows.end() - 1, per_layer("ple_proj", "per_layer_projection", "model.layers.{i}.per_layer_projection",
                                          &DecoderLayer::per_layer_projection, Dim::kHidden, Dim::kPerLayer));
    NormRow k_norm = kKNorm;
    k_norm.mixer = Mixer::kOwnKv;
    const std::vector<NormRow> norms = {
        kInputNorm, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm, kQNorm, k_norm,
        {"post_per_layer_input_norm", "model.layers.{i}.post_per_layer_input_norm",
         &DecoderLayer::post_per_layer_input_norm, Dim::kHidden, Mixer::kPerLayerInput},
        {"layer_scalar", "model.layers.{i}.layer_scalar", &DecoderLayer::layer_scalar, Dim::kOne, Mixer::kAny, true},
    };
    Architecture arch = make("gemma4", rows, norms);
    using modules::PerLayerInputs;
    arch.embed_rows = {
        {"embed_tokens_per_layer", "model.embed_tokens_per_layer.weight", &PerLayerInputs::table,
         {Dim::kPerLayerVocab, Dim::kPerLayerAll}, true},
        {"per_layer_model_projection", "model.per_layer_model_projection.weight", &PerLayerInputs::projection,
         {Dim::kPerLayerAll, Dim::kHidden}},
        {"per_layer_projection_norm", "model.per_layer_projection_norm.weight", &PerLayerInputs::norm, {Dim::kPerLayer}},
    };
    return arch;
  }();
  return a;
}

const Architecture* const kAllArchitectures[] = {&llama_architecture(),  &qwen2_architecture(),
                                                 &qwen3_architecture(),  &gemma2_architecture(),
                                                 &gemma3_architecture(), &phi3_architecture(),
                                                 &smollm3_architecture(), &olmo2_architecture(),
                                                 &qwen35_architecture(), &gemma4_architecture()};

}  // namespace

const Architecture& llama_architecture() {
  static const Architecture a =
      make("llama", llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias), {kInputNorm, kPostAttnNorm});
  return a;
}

const Architecture& architecture_of(const DecoderConfig& config) {
  switch (config.family) {
    case Family::kLlama: return llama_architecture();
    case Family::kQwen2: return qwen2_architecture();
    case Family::kQwen3: return qwen3_architecture();
    case Family::kGemma2: return gemma2_architecture();
    case Family::kGemma3: return gemma3_architecture();
    case Family::kPhi3: return phi3_architecture();
    case Family::kSmolLM3: return smollm3_architecture();
    case Family::kOlmo2: return olmo2_architecture();
    case Family::kQwen35: return qwen35_architecture();
    case Family::kGemma4: return gemma4_architecture();
  }
  throw std::logic_error("architecture_of: unknown family");
}

bool has_bias(const ProjectionRow& row, const DecoderConfig& config) {
  return row.bias == Bias::kAlways || (row.bias == Bias::kIfAttentionBias && config.attention_bias);
}

std::vector<std::string> peft_targets(const Architecture& arch, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  std::set<std::string> parts;
  for (const std::string& t : names) {
    if (const ProjectionRow* row = find_projection(arch, t)) out.push_back(row->peft_name);
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
  for (const Architecture* a : kAllArchitectures) {
    const ProjectionRow* row = find_projection(*a, name);
    if (row && name == row->short_name) return true;
  }
  return false;
}

std::string known_target_names() {
  std::vector<std::string> seen;
  for (const Architecture* a : kAllArchitectures)
    for (const ProjectionRow& row : a->projections)
      if (std::find(seen.begin(), seen.end(), row.short_name) == seen.end()) seen.push_back(row.short_name);
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
