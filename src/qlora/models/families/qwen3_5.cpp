// Qwen3.5 (qwen3_5_text): three of every four layers are Gated DeltaNet (linear_attention; without
// layer_types every full_attention_interval-th layer attends), the rest full attention with a
// sigmoid output gate packed into q_proj, (1 + w) q/k norms and rotary on the first
// partial_rotary_factor (0.25) of head_dim; (1 + w) norms everywhere but the DeltaNet's gated one;
// head_dim 256. qwen3_5 is the Hub's Qwen3.5 (Qwen3_5ForConditionalGeneration): the qwen3_5_text
// language model of its text_config beside a vision tower (copied, never computed).
// llama.cpp's "qwen35": the ssm.* sizes and full_attention_interval; rope.dimension_count is the
// rotary part of head_dim and rope.dimension_sections the config's mrope_section (or
// [11, 11, 10, 0]), which text positions make plain NeoX RoPE. Every norm but the DeltaNet's gated
// one stored as 1 + w; q_proj (query and gate per head) as it is; in_proj_qkv/z/b/a -> attn_qkv,
// attn_gate, ssm_beta, ssm_alpha; conv1d squeezed to ssm_conv1d (f32 in every file type:
// ggml_ssm_conv reads f32 only); A_log stored as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias;
// out_proj as ssm_out. Value heads go from HF's order (grouped by key head) to llama.cpp's tiled one
// wherever they index rows or columns (HeadRegroup). llama.cpp takes one head size for keys and
// values and full attention on every full_attention_interval-th layer, so a config that differs is
// refused. The MTP block (mtp.*) is not written.
#include <regex>

#include "qlora/models/config_json.h"
#include "qlora/models/families/blocks.h"
#include "qlora/models/families/qwen3_5.h"
#include "qlora/models/family.h"
#include "qlora/models/vision/tower.h"

namespace qlora::models {
namespace families {

using modules::DecoderLayer;
using cfg::json;

// Qwen3.5: attention layers with the output gate in q_proj and per-head (1 + w) q/k norms, Gated
// DeltaNet layers with their own projections, conv, decay parameters and gated norm; one feed-forward for both.
std::vector<ProjectionRow> qwen35_rows(const std::vector<ProjectionRow>& ffn) {
  std::vector<ProjectionRow> llama = llama_rows();
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
  rows.insert(rows.end(), ffn.begin(), ffn.end());
  rows.push_back(llama.back());  // output
  return rows;
}

std::vector<NormRow> qwen35_norms() {
  NormRow q_norm = kQNorm, k_norm = kKNorm;
  q_norm.mixer = k_norm.mixer = Mixer::kAttention;
  return {
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
}

namespace {

// Qwen3.5's rope_parameters.mrope_section (or rope_scaling's): a list of non-negative integers.
std::vector<int64_t> mrope_section(const json& j, const std::string& where) {
  std::vector<int64_t> out;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!cfg::present(j, key) || !j.at(key).is_object() || !cfg::present(j.at(key), "mrope_section")) continue;
    const json& s = j.at(key).at("mrope_section");
    const std::string name = std::string(key) + ".mrope_section";
    if (!s.is_array()) cfg::fail(where, name, "expected a list of integers, got " + s.dump());
    for (const json& v : s) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) cfg::fail(where, name, "entries must be non-negative integers");
      out.push_back(v.get<int64_t>());
    }
    break;
  }
  return out;
}

}  // namespace

void parse_qwen35(const json& j, const std::string& where, DecoderConfig& c) {
  c.norm = modules::RmsScale::kOnePlusWeight;  // every RMSNorm but the DeltaNet's gated one
  c.attn_output_gate = true;
  modules::GatedDeltaDims& g = c.gated_delta;
  g.conv_kernel = cfg::get_int(j, "linear_conv_kernel_dim", where, 4);
  g.key_head_dim = cfg::get_int(j, "linear_key_head_dim", where, 128);
  g.value_head_dim = cfg::get_int(j, "linear_value_head_dim", where, 128);
  g.num_key_heads = cfg::get_int(j, "linear_num_key_heads", where, 16);
  g.num_value_heads = cfg::get_int(j, "linear_num_value_heads", where, 32);
  c.mrope_section = mrope_section(j, where);
  // transformers' default where the config has none (Qwen3_5TextRotaryEmbedding), as llama.cpp's converter's.
  if (c.mrope_section.empty()) c.mrope_section = {11, 11, 10};
}

namespace {

// llama.cpp's qwen35 attends on layer i when (i + 1) % full_attention_interval == 0 and runs the
// Gated DeltaNet elsewhere: the interval the config's layers follow (its first full layer + 1).
int64_t full_attention_interval(const DecoderConfig& c, const std::string& where) {
  int64_t every = c.num_hidden_layers + 1;  // no full layer at all
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (!c.is_linear(i)) {
      every = i + 1;
      break;
    }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (c.is_linear(i) != ((i + 1) % every != 0))
      refuse_gguf(where, c, "layer_types", "layer " + std::to_string(i) + " is " + (c.is_linear(i) ? "linear" : "full") +
                                          " attention where llama.cpp attends on every " + std::to_string(every) +
                                          "th layer only (full_attention_interval)");
  return every;
}

}  // namespace

void check_qwen35(const DecoderConfig& c, const std::string& where) {
  const modules::GatedDeltaDims& g = c.gated_delta;
  if (g.key_head_dim != g.value_head_dim)
    refuse_gguf(where, c, "linear_value_head_dim", std::to_string(g.value_head_dim) + " != linear_key_head_dim " +
                                                  std::to_string(g.key_head_dim) + ": llama.cpp's qwen35 takes one "
                                                  "head size (ssm.state_size) for the DeltaNet's keys and values");
  if (c.mrope_section.size() > 4)
    refuse_gguf(where, c, "rope_parameters.mrope_section", "llama.cpp reads at most 4 sections");
  full_attention_interval(c, where);
}

// The Gated DeltaNet's sizes as llama.cpp's qwen35 reads them (its converter's names: state size is
// the head size, group count the key heads, time step rank the value heads).
void add_qwen35_keys(const DecoderConfig& c, const std::string& where, GgufAdditions& out) {
  const modules::GatedDeltaDims& g = c.gated_delta;
  const auto u32 = [](int64_t v) { return GgufValue(static_cast<uint32_t>(v)); };
  std::vector<int32_t> sections(c.mrope_section.begin(), c.mrope_section.end());
  sections.resize(4, 0);
  const std::pair<const char*, GgufValue> keys[] = {
      {"ssm.conv_kernel", u32(g.conv_kernel)},
      {"ssm.state_size", u32(g.key_head_dim)},
      {"ssm.group_count", u32(g.num_key_heads)},
      {"ssm.time_step_rank", u32(g.num_value_heads)},
      {"ssm.inner_size", u32(g.value_head_dim * g.num_value_heads)},
      {"full_attention_interval", u32(full_attention_interval(c, where))},
      {"rope.dimension_sections", sections}};
  for (const auto& [key, v] : keys) out.keys.emplace_back(key, v);
}

namespace {

// A Gated DeltaNet tensor ("linear_attn.<part>") of layer `layer`, as llama.cpp's converter writes it.
std::optional<TensorPlan> linear_tensor(const std::string& layer, const std::string& part, const DecoderConfig& c) {
  const modules::GatedDeltaDims& g = c.gated_delta;
  const int64_t per_group = g.num_value_heads / g.num_key_heads, qk = 2 * g.key_head_dim * g.num_key_heads;
  const auto regroup = [&](int dim, int64_t offset, int64_t head_dim) -> std::optional<HeadRegroup> {
    if (per_group == 1) return std::nullopt;  // one value head a key head: the orders agree
    return HeadRegroup{dim, offset, g.num_key_heads, per_group, head_dim};
  };
  const std::string blk = "blk." + layer + ".";
  const int64_t dv = g.value_head_dim;
  TensorPlan t;
  if (part == "in_proj_qkv.weight") t = {blk + "attn_qkv.weight", 0, 0.0f, regroup(0, qk, dv)};
  else if (part == "in_proj_z.weight") t = {blk + "attn_gate.weight", 0, 0.0f, regroup(0, 0, dv)};
  else if (part == "in_proj_b.weight") t = {blk + "ssm_beta.weight", 0, 0.0f, regroup(0, 0, 1)};
  else if (part == "in_proj_a.weight") t = {blk + "ssm_alpha.weight", 0, 0.0f, regroup(0, 0, 1)};
  else if (part == "out_proj.weight") t = {blk + "ssm_out.weight", 0, 0.0f, regroup(1, 0, dv)};
  else if (part == "norm.weight") t = {blk + "ssm_norm.weight"};  // the gated norm: plain w
  else if (part == "dt_bias") t = {blk + "ssm_dt.bias", 0, 0.0f, regroup(0, 0, 1)};
  else if (part == "A_log") t = {blk + "ssm_a", 0, 0.0f, regroup(0, 0, 1), true};
  else if (part == "conv1d.weight") t = {blk + "ssm_conv1d.weight", 0, 0.0f, regroup(0, qk, dv), false, true};
  else return std::nullopt;
  return t;
}

}  // namespace

// The Gated DeltaNet's tensors ("model.layers.N.linear_attn.<part>").
std::optional<TensorPlan> qwen35_tensor(const std::string& hf, const DecoderConfig& c) {
  static const std::regex linear(R"(model\.layers\.(\d+)\.linear_attn\.(.+))");
  std::smatch m;
  if (!std::regex_match(hf, m, linear)) return std::nullopt;
  return linear_tensor(m[1], m[2], c);
}

namespace {

const Architecture& qwen35_architecture() {
  static const Architecture a = [] {
    const std::vector<ProjectionRow> llama = llama_rows();
    return make_architecture("qwen3_5", qwen35_rows({llama.begin() + 4, llama.end() - 1}), qwen35_norms());  // gate, up, down
  }();
  return a;
}

}  // namespace

void qwen35_family_base(Family& f) {
  f.head_dim = 256;
  f.partial_rotary_factor = 0.25;
  f.gated_delta_layers = true;
  f.gguf.tensors = post_norm_tensor_names(true);
  f.gguf.check = check_qwen35;
  f.gguf.add = add_qwen35_keys;
  f.gguf.tensor = qwen35_tensor;
}

}  // namespace families

const Family& qwen3_5_family() {
  static const Family f = [] {
    Family f;
    families::qwen35_family_base(f);
    f.name = "qwen3_5";
    f.model_types = {"qwen3_5_text"};
    f.architecture = families::qwen35_architecture;
    f.multimodal = Family::Multimodal{"qwen3_5",
                                      R"({"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                                          "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
                                          "max_position_embeddings": 32768})",
                                      false, false, /*image_token_id=*/248056, /*spatial_merge=*/2};
    f.parse = families::parse_qwen35;
    f.gguf.arch = "qwen35";
    f.vision_tower = vision::load_qwen3_5_tower;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
