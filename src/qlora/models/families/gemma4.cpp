// Gemma 4 (dense; gemma4_text): w-scaled fp32 norms (not 1 + w), q/k norms and a weightless v norm
// with attention scale 1, sliding layers (window 512, five of every six, the last layer always
// full) and full layers with their own head_dim / kv heads (global_head_dim) and proportional RoPE,
// per-layer input embeddings (PLE), a layer_scalar per layer, KV sharing across the last layers,
// attention_k_eq_v (v = k on full layers), double-wide MLPs on KV-shared layers. gemma4 is the Hub's
// Gemma 4 (Gemma4ForConditionalGeneration): gemma4_text's language model of its text_config beside
// vision and audio towers (copied, never computed). Its mixture-of-experts form (26B-A4B,
// enable_moe_block) adds to every layer a router and experts beside the MLP (parse_gemma4_moe,
// modules/decoder_layer.cpp's mlp_beside_moe).
// llama.cpp's "gemma4": Gemma 3's block with plain w norms (no + 1), a weightless v norm and
// attention scale 1 (llama.cpp's own); the full layers' head size, kv heads and MLP widths
// (key_length, head_count_kv and feed_forward_length arrays, *_swa for the sliding layers), the
// sliding layers as a bool array, shared_kv_layers; the full layers' proportional RoPE as a
// rope_freqs tensor (1 a rotated frequency, 1e30 the rest); full layers without v_proj under
// attention_k_eq_v are written so (llama.cpp then takes the keys as values); the per-layer inputs
// (per_layer_token_embd, per_layer_model_proj, per_layer_proj_norm; blk.N.inp_gate, proj,
// post_norm) and layer_scalar as blk.N.layer_output_scale. llama.cpp fixes the layers KV-shared
// layers read, so a config that differs is refused. A MoE layer: the router as ffn_gate_inp with its
// scale as ffn_gate_inp.scale, the experts fused as ffn_gate_up_exps beside ffn_down_exps with
// per_expert_scale as ffn_down_exps.scale, the norms as pre_ffw_norm_2, post_ffw_norm_1/_2;
// expert_count, expert_used_count and expert_feed_forward_length.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <regex>

#include "qlora/models/config_json.h"
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"
#include "qlora/models/vision/tower.h"

namespace qlora::models {
namespace {

using namespace families;
using modules::DecoderLayer;
using cfg::json;

// Gemma 4: Gemma 3's block with w-scaled norms (the config's), KV-shared layers without k/v
// projections and k_norm, full layers without v_proj under attention_k_eq_v, and per-layer inputs: a
// gate and a projection (LoRA targets "ple_gate", "ple_proj"; peft wraps them as it wraps any
// nn.Linear), their norm and a layer_scalar in each layer, and the embedding unit's table, projection
// and norm (frozen: the embedding unit has no backward, so per_layer_model_projection is no target).
const Architecture& gemma4_architecture() {
  static const Architecture a = [] {
    std::vector<ProjectionRow> rows = llama_rows();
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
        // The MoE layers' (enable_moe_block): the router's scales, the experts' input norm, the branches' norms.
        {"router.scale", "model.layers.{i}.router.scale", &DecoderLayer::router_scale, Dim::kHidden, Mixer::kMoe, true},
        {"router.per_expert_scale", "model.layers.{i}.router.per_expert_scale", &DecoderLayer::per_expert_scale,
         Dim::kExperts, Mixer::kMoe, true},
        {"pre_feedforward_layernorm_2", "model.layers.{i}.pre_feedforward_layernorm_2",
         &DecoderLayer::pre_feedforward_layernorm_2, Dim::kHidden, Mixer::kMoe},
        {"post_feedforward_layernorm_1", "model.layers.{i}.post_feedforward_layernorm_1",
         &DecoderLayer::post_feedforward_layernorm_1, Dim::kHidden, Mixer::kMoe},
        {"post_feedforward_layernorm_2", "model.layers.{i}.post_feedforward_layernorm_2",
         &DecoderLayer::post_feedforward_layernorm_2, Dim::kHidden, Mixer::kMoe},
    };
    Architecture arch = make_architecture("gemma4", rows, norms);
    // Gemma 4's MoE sits on the layer beside the MLP: router.proj [E, hidden] and experts.gate_up_proj /
    // down_proj (transformers writes them fused; a checkpoint with a tensor per expert names them
    // experts.<e>.gate_proj / up_proj / down_proj).
    arch.experts = ExpertsRow{"model.layers.{i}.router.proj", "model.layers.{i}.experts", "gate_proj", "up_proj",
                              "down_proj", "model.layers.{i}.router.proj", "model.layers.{i}.experts"};
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

// Gemma 4's layer index keys in per_layer_config: "5", or zero-padded "05" as transformers writes them.
int64_t layer_index(const std::string& key, int64_t n, const std::string& where) {
  const bool digits = !key.empty() && key.size() < 10 && key.find_first_not_of("0123456789") == std::string::npos;
  const int64_t i = digits ? std::stoll(key) : -1;
  if (i < 0 || i >= n) cfg::fail(where, "per_layer_config." + key, "expected a layer index in [0, " + std::to_string(n) + ")");
  return i;
}

// Gemma 4's full-attention layers' head_dim and kv heads. transformers writes per_layer_config (each
// layer's overrides); the Hub's configs give global_head_dim (the class's default: 512) and, under
// attention_k_eq_v, num_global_key_value_heads. Each layer type has one size, as its RoPE table does.
void parse_gemma4_heads(const json& j, const std::string& where, DecoderConfig& c) {
  const int64_t n = c.num_hidden_layers;
  if (!j.contains("per_layer_config")) {
    c.global_head_dim = cfg::get_int(j, "global_head_dim", where, 512);
    c.global_kv_heads = c.attention_k_eq_v ? cfg::get_int(j, "num_global_key_value_heads", where, c.num_key_value_heads)
                                           : c.num_key_value_heads;
    return;
  }
  std::vector<int64_t> hd(static_cast<size_t>(n), c.head_dim), kv(static_cast<size_t>(n), c.num_key_value_heads);
  const json& p = j.at("per_layer_config");
  if (!p.is_null() && !p.is_object()) cfg::fail(where, "per_layer_config", "expected an object of layer index -> overrides");
  const json overrides = p.is_null() ? json::object() : p;  // named: items() refers to it
  for (const auto& [key, ov] : overrides.items()) {
    const auto i = static_cast<size_t>(layer_index(key, n, where));
    const std::string w = where + " (per_layer_config." + key + ")";
    if (!ov.is_object()) cfg::fail(where, "per_layer_config." + key, "expected an object of overrides");
    for (const auto& [attr, v] : ov.items()) {
      if (attr == "head_dim") hd[i] = cfg::get_int(ov, "head_dim", w);
      else if (attr == "num_key_value_heads") kv[i] = cfg::get_int(ov, "num_key_value_heads", w);
      else cfg::fail(where, "per_layer_config." + key + "." + attr, "only head_dim and num_key_value_heads may differ per layer");
    }
  }
  int64_t type_hd[2] = {-1, -1}, type_kv[2] = {-1, -1};  // [full, sliding]
  for (int64_t i = 0; i < n; ++i) {
    const int t = c.is_sliding(i) ? 1 : 0;
    const auto u = static_cast<size_t>(i);
    if (type_hd[t] < 0) type_hd[t] = hd[u], type_kv[t] = kv[u];
    if (hd[u] != type_hd[t] || kv[u] != type_kv[t])
      cfg::fail(where, "per_layer_config", "layer " + std::to_string(i) + "'s head_dim / num_key_value_heads differ from " +
                                          "those of the other " + (t ? "sliding" : "full") + " attention layers");
  }
  if (type_hd[1] > 0) c.head_dim = type_hd[1], c.num_key_value_heads = type_kv[1];
  c.global_head_dim = type_hd[0] > 0 ? type_hd[0] : c.head_dim;
  c.global_kv_heads = type_kv[0] > 0 ? type_kv[0] : c.num_key_value_heads;
}

// Gemma 4's KV sharing (transformers' kv_sharing_modes): each of the last num_kv_shared_layers layers
// attends over the keys and values of the last earlier layer of its type.
void parse_kv_sharing(const json& j, const std::string& where, DecoderConfig& c) {
  const int64_t n = c.num_hidden_layers, shared = cfg::get_int(j, "num_kv_shared_layers", where, 0);
  if (shared == 0) return;
  if (shared < 0 || shared >= n) cfg::fail(where, "num_kv_shared_layers", "must be in [0, num_hidden_layers = " + std::to_string(n) + ")");
  const int64_t first = n - shared;
  c.kv_source.assign(static_cast<size_t>(n), -1);
  for (int64_t i = first; i < n; ++i) {
    int64_t src = first - 1;
    while (src >= 0 && c.is_sliding(src) != c.is_sliding(i)) --src;
    if (src < 0)
      cfg::fail(where, "num_kv_shared_layers", "layer " + std::to_string(i) + " would reuse the keys and values of an earlier " +
                                              (c.is_sliding(i) ? "sliding" : "full") + " attention layer, and none of the first " +
                                              std::to_string(first) + " layers is one");
    c.kv_source[static_cast<size_t>(i)] = src;
  }
}

// Gemma 4's mixture-of-experts form (enable_moe_block, gemma-4-26B-A4B): every layer's MoE beside its
// MLP, num_experts experts of moe_intermediate_size, top_k_experts a token (no class defaults: each
// key is required), Gemma4TextRouter's routing (renormalised, fp32 weights scaled per expert), the
// experts' activation the model's hidden_activation.
void parse_gemma4_moe(const json& j, const std::string& where, DecoderConfig& c) {
  if (!cfg::get_bool(j, "enable_moe_block", where, false)) return;
  for (const char* key : {"num_experts", "top_k_experts", "moe_intermediate_size"})
    if (!cfg::present(j, key)) cfg::fail(where, key, "is missing: enable_moe_block is true, and the MoE layers need it");
  parse_moe(j, where, c, "num_experts", 0, 0, "moe_intermediate_size", "top_k_experts");
  c.moe.norm_topk_prob = true;
  c.moe.fp32_weights = true;
  c.moe.scaled_router = true;
  c.moe.norm_eps = c.rms_norm_eps;
  c.moe.activation = c.activation == modules::MlpActivation::kGeluTanh ? modules::ExpertActivation::kGeluTanh
                                                                       : modules::ExpertActivation::kSwiglu;
}

// Gemma 4 (see decoder_config.h), dense or with its MoE (parse_gemma4_moe).
void parse_gemma4(const json& j, const std::string& where, DecoderConfig& c) {
  parse_gemma4_moe(j, where, c);
  c.norm = modules::RmsScale::kWeightFp32;
  c.v_norm = true;
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  c.query_pre_attn_scalar = 1.0;  // scores are q.k unscaled: q and k come out of RMSNorms
  c.final_logit_softcapping = cfg::softcap(j, "final_logit_softcapping", where, std::nullopt);
  c.attention_k_eq_v = cfg::get_bool(j, "attention_k_eq_v", where, false);
  parse_gemma4_heads(j, where, c);
  parse_kv_sharing(j, where, c);
  c.double_wide_mlp = cfg::get_bool(j, "use_double_wide_mlp", where, false);
  // null switches the per-layer inputs off, as 0 does; absent means the class's 256.
  const char* ple = "hidden_size_per_layer_input";
  c.per_layer_input_dim = !j.contains(ple) ? 256 : cfg::present(j, ple) ? cfg::get_int(j, ple, where) : 0;
  if (c.per_layer_input_dim < 0) cfg::fail(where, ple, "must be 0 (none) or positive");
  c.per_layer_input_vocab = cfg::get_int(j, "vocab_size_per_layer_input", where, 262144);
  if (c.per_layer_input_dim > 0 && c.per_layer_input_vocab <= 0)
    cfg::fail(where, "vocab_size_per_layer_input", "must be positive");
  // Image tokens embed (and give per-layer inputs) as this token before their features replace them.
  c.image_pad_token_id = cfg::present(j, "pad_token_id") ? cfg::get_int(j, "pad_token_id", where) : 0;
}

bool gemma4_slides(const json&, const std::string&, int64_t layer) { return (layer + 1) % 6 != 0; }  // its class's fixed 5:1

// Gemma 4's full layers' head size (global_head_dim; head_dim when the config gives none).
int64_t gemma4_full_head_dim(const DecoderConfig& c) { return c.global_head_dim > 0 ? c.global_head_dim : c.head_dim; }

// What llama.cpp's gemma4 fixes: plain RoPE over all of head_dim on sliding layers, no scaling on full
// ones (their proportional share is the rope_freqs tensor), one per-layer table row a token, and the
// layers the KV-shared ones read: the last non-shared layer for full layers, the one before it for
// sliding layers (as Gemma 4's checkpoints lay them out).
void check_gemma4(const DecoderConfig& c, const std::string& where) {
  if (!c.sliding_window) refuse_gguf(where, c, "sliding_window", "null: llama.cpp's gemma4 always has sliding layers");
  const modules::RopeParams local = c.local_rope.value_or(modules::RopeParams{});
  const bool local_partial = local.proportional && local.proportional->partial_rotary_factor != 1.0;
  if (local.linear_factor != 1.0 || local.llama3 || local.yarn || local_partial)
    refuse_gguf(where, c, "rope_parameters.sliding_attention",
           "llama.cpp's gemma4 rotates sliding layers with plain RoPE over all of head_dim, unscaled");
  if (c.rope_linear_factor != 1.0 || c.rope_scaling || c.rope_yarn)
    refuse_gguf(where, c, "rope_parameters.full_attention",
           "llama.cpp's gemma4 reads no RoPE scaling for its full layers (only the proportional rotary share)");
  if (c.per_layer_input_dim > 0 && c.per_layer_input_vocab != c.vocab_size)
    refuse_gguf(where, c, "vocab_size_per_layer_input",
           std::to_string(c.per_layer_input_vocab) + " != vocab_size " + std::to_string(c.vocab_size) +
               ": llama.cpp's gemma4 takes one per-layer table row a token");
  const auto n = static_cast<int64_t>(c.kv_source.size());
  int64_t first = n;
  while (first > 0 && c.is_kv_shared(first - 1)) --first;
  for (int64_t i = first; i < n; ++i) {
    const int64_t theirs = first - (c.is_sliding(i) ? 2 : 1), ours = c.kv_source[static_cast<size_t>(i)];
    if (ours != theirs)
      refuse_gguf(where, c, "num_kv_shared_layers",
             "layer " + std::to_string(i) + " reuses layer " + std::to_string(ours) + "'s keys and values where " +
                 "llama.cpp's gemma4 reads layer " + std::to_string(theirs) + "'s (shared full layers read the last " +
                 "non-shared layer, shared sliding ones the layer before it: layer_types must make those a full " +
                 "and a sliding layer)");
  }
}

// The rope_freqs tensor of llama.cpp's gemma4, read by its full layers only: ggml's NeoX RoPE over
// all of global_head_dim, each frequency divided by its entry; 1e30 stops the angles past the
// proportional share (those dimensions pass through, as transformers' zeroed frequencies do).
std::vector<float> gemma4_rope_divisors(const DecoderConfig& c) {
  const int64_t half = gemma4_full_head_dim(c) / 2;
  int64_t angles = half;
  if (c.rope_proportional)  // transformers' int(factor * head_dim // 2)
    angles = static_cast<int64_t>(std::floor(c.rope_proportional->partial_rotary_factor * static_cast<double>(half)));
  std::vector<float> out(static_cast<size_t>(half), 1e30f);
  std::fill(out.begin(), out.begin() + angles, 1.0f);
  return out;
}

// Gemma 4's per-layer sizes and sharing as llama.cpp's gemma4 reads them: the full layers' head
// size as key_length (the sliding ones' as *_swa), per-layer kv heads and MLP widths as arrays where
// they differ, the sliding layers as a bool array.
void add_gemma4_keys(const DecoderConfig& c, const std::string&, GgufAdditions& out) {
  const auto u32 = [](int64_t v) { return GgufValue(static_cast<uint32_t>(v)); };
  const int64_t n = c.num_hidden_layers, full = gemma4_full_head_dim(c);
  std::vector<bool> swa;
  std::vector<int32_t> kv, ff;
  for (int64_t i = 0; i < n; ++i) {
    swa.push_back(c.is_sliding(i));
    kv.push_back(static_cast<int32_t>(c.layer_kv_heads(i)));
    ff.push_back(static_cast<int32_t>(c.layer_intermediate(i)));
  }
  const bool kv_differ = std::adjacent_find(kv.begin(), kv.end(), std::not_equal_to<>()) != kv.end();
  int64_t shared = 0;
  for (int64_t i = 0; i < n; ++i) shared += c.is_kv_shared(i) ? 1 : 0;
  const std::pair<const char*, GgufValue> keys[] = {
      {"attention.key_length", u32(full)},
      {"attention.value_length", u32(full)},
      {"attention.key_length_swa", u32(c.head_dim)},
      {"attention.value_length_swa", u32(c.head_dim)},
      {"rope.dimension_count", u32(full)},
      {"rope.dimension_count_swa", u32(c.rope_dim())},
      {"rope.freq_base_swa", GgufValue(static_cast<float>(c.local_rope.value_or(modules::RopeParams{}).theta))},
      {"attention.head_count_kv", kv_differ ? GgufValue(kv) : u32(c.num_key_value_heads)},
      {"feed_forward_length", c.double_wide_mlp ? GgufValue(ff) : u32(c.intermediate_size)},
      {"attention.sliding_window_pattern", GgufValue(swa)},
      {"attention.shared_kv_layers", u32(shared)},
      {"embedding_length_per_layer_input", u32(c.per_layer_input_dim)}};
  for (const auto& [key, v] : keys) out.keys.emplace_back(key, v);
  if (c.final_logit_softcapping)
    out.keys.emplace_back("final_logit_softcapping", static_cast<float>(*c.final_logit_softcapping));
  if (!c.moe_layers.empty()) out.keys.emplace_back("expert_feed_forward_length", u32(c.moe.inter));
  out.extra.push_back({"rope_freqs.weight", gemma4_rope_divisors(c)});
}

// Gemma 4's tensors beyond Gemma 3's block (llama.cpp's names): the per-layer inputs' table,
// projection and norm, and in each layer their gate, projection and norm and the layer_scalar; a MoE
// layer's router scales and its norms.
std::optional<TensorPlan> gemma4_tensor(const std::string& hf, const DecoderConfig&) {
  static const std::map<std::string, std::string> model = {
      {"model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight"},
      {"model.per_layer_model_projection.weight", "per_layer_model_proj.weight"},
      {"model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight"}};
  static const std::map<std::string, std::string> layer = {
      {"per_layer_input_gate.weight", "inp_gate.weight"},
      {"per_layer_projection.weight", "proj.weight"},
      {"post_per_layer_input_norm.weight", "post_norm.weight"},
      {"layer_scalar", "layer_output_scale.weight"},
      // The MoE layers' (the router's projection is ffn_gate_inp, the experts ffn_gate_up_exps / ffn_down_exps).
      {"router.scale", "ffn_gate_inp.scale"},
      {"router.per_expert_scale", "ffn_down_exps.scale"},
      {"pre_feedforward_layernorm_2.weight", "pre_ffw_norm_2.weight"},
      {"post_feedforward_layernorm_1.weight", "post_ffw_norm_1.weight"},
      {"post_feedforward_layernorm_2.weight", "post_ffw_norm_2.weight"}};
  if (const auto it = model.find(hf); it != model.end()) {
    TensorPlan t{it->second};
    t.no_lora = it->first == "model.per_layer_model_projection.weight";
    return t;
  }
  static const std::regex in_layer(R"(model\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(hf, m, in_layer)) return std::nullopt;
  if (const auto it = layer.find(m[2].str()); it != layer.end())
    return TensorPlan{"blk." + m[1].str() + "." + it->second};
  return std::nullopt;
}

}  // namespace

const Family& gemma4_family() {
  static const Family f = [] {
    Family f;
    f.name = "gemma4";
    f.model_types = {"gemma4_text"};
    f.architecture = gemma4_architecture;
    f.multimodal = Family::Multimodal{"gemma4",
                                      R"({"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216,
                                          "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
                                          "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": 1})",
                                      true, false, /*image_token_id=*/258880};
    f.head_dim = 256;
    f.tie_word_embeddings = true;
    f.rope_theta = 1e6;
    f.activation = modules::MlpActivation::kGeluTanh;
    f.proportional_rope = 0.25;  // the full layers': proportional RoPE over a quarter of global_head_dim
    f.local_rope = LocalRope::kOwnBase;
    f.sliding_window = 512;
    f.slides = gemma4_slides;
    f.last_layer_full = true;
    f.bidirectional_vision = true;
    f.parse = parse_gemma4;
    f.gguf.arch = "gemma4";
    f.gguf.tensors = gemma_tensor_names(true);
    f.gguf.window_key = true;
    f.gguf.check = check_gemma4;
    f.gguf.add = add_gemma4_keys;
    f.gguf.tensor = gemma4_tensor;
    f.gguf.fused_gate_up_exps = true;
    f.vision_tower = vision::load_gemma4_tower;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
