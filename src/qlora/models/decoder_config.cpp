#include "qlora/models/decoder_config.h"
#include "qlora/io/read_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace qlora::models {
namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& what) {
  throw std::invalid_argument(where + ": config key '" + key + "': " + what);
}

// HF writes null for "use the default" (e.g. head_dim: null), so null counts as absent.
bool present(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

int64_t get_int(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) fail(where, key, "missing (required)");
  const json& v = j.at(key);
  if (!v.is_number_integer()) fail(where, key, "expected an integer, got " + v.dump());
  return v.get<int64_t>();
}
int64_t get_int(const json& j, const char* key, const std::string& where, int64_t dflt) {
  return present(j, key) ? get_int(j, key, where) : dflt;
}
double get_num(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) fail(where, key, "missing (required)");
  const json& v = j.at(key);
  if (!v.is_number()) fail(where, key, "expected a number, got " + v.dump());
  return v.get<double>();
}
double get_num(const json& j, const char* key, const std::string& where, double dflt) {
  return present(j, key) ? get_num(j, key, where) : dflt;
}
bool get_bool(const json& j, const char* key, const std::string& where, bool dflt) {
  if (!present(j, key)) return dflt;
  const json& v = j.at(key);
  if (!v.is_boolean()) fail(where, key, "expected true/false, got " + v.dump());
  return v.get<bool>();
}
std::string get_str(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) fail(where, key, "missing (required)");
  const json& v = j.at(key);
  if (!v.is_string()) fail(where, key, "expected a string, got " + v.dump());
  return v.get<std::string>();
}

// eos_token_id: an integer or a list of them; absent: none.
std::vector<int64_t> eos_ids(const json& j, const std::string& where) {
  std::vector<int64_t> out;
  if (!present(j, "eos_token_id")) return out;
  const json& e = j.at("eos_token_id");
  if (e.is_number_integer()) {
    out.push_back(e.get<int64_t>());
  } else if (e.is_array()) {
    for (const json& v : e) {
      if (!v.is_number_integer()) fail(where, "eos_token_id", "list entries must be integers");
      out.push_back(v.get<int64_t>());
    }
  } else {
    fail(where, "eos_token_id", "expected an integer or a list of integers, got " + e.dump());
  }
  return out;
}

// YaRN's parameters as transformers resolves them: the factor from the context lengths when
// absent, the attention factor from mscale / mscale_all_dim or 0.1 ln(factor) + 1 when absent.
modules::YarnRope parse_yarn(const json& r, const json& top, const std::string& w, const std::string& key) {
  modules::YarnRope y;
  const int64_t max_pos = get_int(top, "max_position_embeddings", w, 2048);
  y.original_max_position_embeddings = get_int(r, "original_max_position_embeddings", w, max_pos);
  if (y.original_max_position_embeddings <= 0) fail(w, key + ".original_max_position_embeddings", "must be positive");
  y.factor = get_num(r, "factor", w, static_cast<double>(max_pos) / static_cast<double>(y.original_max_position_embeddings));
  if (!(y.factor > 0)) fail(w, key + ".factor", "yarn scaling needs factor > 0");
  const auto mscale = [&](double m) { return y.factor <= 1 ? 1.0 : 0.1 * m * std::log(y.factor) + 1.0; };
  const double m = get_num(r, "mscale", w, 0.0), m_all = get_num(r, "mscale_all_dim", w, 0.0);
  y.attention_factor = get_num(r, "attention_factor", w, m != 0 && m_all != 0 ? mscale(m) / mscale(m_all) : mscale(1.0));
  y.beta_fast = get_num(r, "beta_fast", w, 32.0);
  y.beta_slow = get_num(r, "beta_slow", w, 1.0);
  y.truncate = get_bool(r, "truncate", w, true);
  return y;
}

// One RoPE dict ({rope_type, rope_theta, factor, ...}) over `p`, whose theta is the default.
modules::RopeParams parse_rope_dict(const json& r, const json& top, const std::string& w, const std::string& key,
                                    modules::RopeParams p) {
  if (!r.is_object()) fail(w, key, "expected an object or null, got " + r.dump());
  if (present(r, "rope_theta")) p.theta = get_num(r, "rope_theta", w);
  std::string type = "default";
  if (present(r, "rope_type")) type = get_str(r, "rope_type", w);
  else if (present(r, "type")) type = get_str(r, "type", w);
  p.proportional.reset();  // a layer type's dict says all of its RoPE (a default may have been proportional)
  if (type == "default") return p;
  if (type == "proportional") {
    const double f = get_num(r, "partial_rotary_factor", w, 1.0);
    if (!(f > 0 && f <= 1)) fail(w, key + ".partial_rotary_factor", "must be in (0, 1]");
    p.proportional = modules::ProportionalRope{f};
    p.linear_factor = get_num(r, "factor", w, 1.0);
    if (!(p.linear_factor > 0)) fail(w, key + ".factor", "proportional scaling needs factor > 0");
    return p;
  }
  if (type == "linear") {
    p.linear_factor = get_num(r, "factor", w);
    if (!(p.linear_factor > 0)) fail(w, key + ".factor", "linear scaling needs factor > 0");
    return p;
  }
  if (type == "yarn") {
    p.yarn = parse_yarn(r, top, w, key);
    return p;
  }
  if (type != "llama3") {
    fail(w, key + ".rope_type", "'" + type + "' is not supported (only default, linear, llama3, yarn and proportional)");
  }
  Llama3RopeScaling s;
  s.factor = get_num(r, "factor", w);
  s.low_freq_factor = get_num(r, "low_freq_factor", w);
  s.high_freq_factor = get_num(r, "high_freq_factor", w);
  // transformers falls back to max_position_embeddings when this is absent.
  s.original_max_position_embeddings =
      get_int(r, "original_max_position_embeddings", w, get_int(top, "max_position_embeddings", w, 2048));
  if (!(s.factor > 0) || !(s.high_freq_factor > s.low_freq_factor) || !(s.low_freq_factor > 0)) {
    fail(w, key + ".factor", "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0");
  }
  p.llama3 = s;
  return p;
}

// partial_rotary_factor, at the top level or in the RoPE dict: Qwen3.5 rotates the first quarter of
// head_dim by default (its class sets 0.25); the other families rotate all of it and take only 1.
void parse_partial_rotary(const json& j, const char* rope_key, const std::string& where, DecoderConfig& c) {
  const bool partial_ok = c.family == Family::kQwen35;
  std::string key = "partial_rotary_factor";
  double factor = partial_ok ? 0.25 : 1.0;
  if (present(j, "partial_rotary_factor")) factor = get_num(j, "partial_rotary_factor", where);
  if (present(j, rope_key) && j.at(rope_key).is_object() && present(j.at(rope_key), "partial_rotary_factor")) {
    key = std::string(rope_key) + ".partial_rotary_factor";
    factor = get_num(j.at(rope_key), "partial_rotary_factor", where);
  }
  if (!partial_ok && factor != 1.0) fail(where, key, "partial rotary embeddings are not supported here (only 1.0)");
  if (!(factor > 0 && factor <= 1)) fail(where, key, "must be in (0, 1]");
  const auto dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * factor);  // transformers' int()
  if (dim <= 0 || dim % 2 != 0) fail(where, key, "head_dim x factor must be a positive even number, got " + std::to_string(dim));
  c.rotary_dim = dim == c.head_dim ? 0 : dim;
}

// Qwen3.5's rope_parameters.mrope_section (or rope_scaling's): a list of non-negative integers.
std::vector<int64_t> mrope_section(const json& j, const std::string& where) {
  std::vector<int64_t> out;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!present(j, key) || !j.at(key).is_object() || !present(j.at(key), "mrope_section")) continue;
    const json& s = j.at(key).at("mrope_section");
    const std::string name = std::string(key) + ".mrope_section";
    if (!s.is_array()) fail(where, name, "expected a list of integers, got " + s.dump());
    for (const json& v : s) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) fail(where, name, "entries must be non-negative integers");
      out.push_back(v.get<int64_t>());
    }
    break;
  }
  return out;
}

// RoPE: transformers <= 4.x wrote rope_theta at top level and scaling in rope_scaling; 5.x writes
// one rope_parameters dict holding rope_theta and rope_type, or (Gemma 3) one dict per layer type.
// Gemma 3's older form: rope_theta + rope_scaling for global layers, rope_local_base_freq for local.
// OLMo 3 gives its sliding layers the base theta unscaled, its full layers the scaling too.
void parse_rope(const json& j, const std::string& where, DecoderConfig& c) {
  const bool gemma3 = c.family == Family::kGemma3, olmo = c.family == Family::kOlmo2;
  const bool gemma4 = c.family == Family::kGemma4;
  modules::RopeParams global;
  global.theta = get_num(j, "rope_theta", where, gemma3 || gemma4 ? 1e6 : 10000.0);
  // Gemma 4's class default for its full layers: proportional RoPE over a quarter of global_head_dim.
  if (gemma4) global.proportional = modules::ProportionalRope{0.25};
  modules::RopeParams local;
  local.theta = olmo ? global.theta : get_num(j, "rope_local_base_freq", where, 10000.0);
  const char* key = present(j, "rope_parameters") ? "rope_parameters" : "rope_scaling";
  parse_partial_rotary(j, key, where, c);
  if (present(j, key)) {
    const json& r = j.at(key);
    const std::string w = where + " (" + key + ")";
    if (r.is_object() && (r.contains("full_attention") || r.contains("sliding_attention"))) {
      if (present(r, "full_attention"))
        global = parse_rope_dict(r.at("full_attention"), j, w, std::string(key) + ".full_attention", global);
      if (present(r, "sliding_attention"))
        local = parse_rope_dict(r.at("sliding_attention"), j, w, std::string(key) + ".sliding_attention", local);
    } else {
      global = parse_rope_dict(r, j, w, key, global);
    }
  }
  c.rope_theta = global.theta;
  c.rope_scaling = global.llama3;
  c.rope_linear_factor = global.linear_factor;
  c.rope_yarn = global.yarn;
  c.rope_proportional = global.proportional;
  if (gemma3 || olmo || gemma4) c.local_rope = local;
}

struct FamilyName {
  const char* model_type;
  Family family;
};
constexpr FamilyName kFamilies[] = {{"llama", Family::kLlama},   {"mistral", Family::kLlama},
                                    {"qwen2", Family::kQwen2},   {"qwen3", Family::kQwen3},
                                    {"gemma2", Family::kGemma2}, {"gemma3_text", Family::kGemma3},
                                    {"phi3", Family::kPhi3},     {"smollm3", Family::kSmolLM3},
                                    {"olmo2", Family::kOlmo2},   {"olmo3", Family::kOlmo2},
                                    {"qwen3_5_text", Family::kQwen35}, {"gemma4_text", Family::kGemma4}};

// model_type -> family; another multimodal checkpoint or another family is refused by name.
Family parse_family(const json& j, const std::string& where, const std::string& type) {
  if (present(j, "vision_config") || present(j, "text_config")) {
    fail(where, present(j, "vision_config") ? "vision_config" : "text_config",
         "'" + type + "' is a multimodal checkpoint (a vision tower beside the language model); of those only "
         "gemma3's, gemma4's and qwen3_5's language models are supported, otherwise text-only decoders (" + supported_model_types() + ")");
  }
  for (const FamilyName& f : kFamilies)
    if (type == f.model_type) return f.family;
  fail(where, "model_type", "'" + type + "' is not supported (supported: " + supported_model_types() + ")");
}

// HF's per-class defaults for keys a config.json may leave out.

// A soft-cap key: absent means the family's default, null means none.
std::optional<double> softcap(const json& j, const char* key, const std::string& where, std::optional<double> dflt) {
  if (!j.contains(key)) return dflt;
  if (j.at(key).is_null()) return std::nullopt;
  const double v = get_num(j, key, where);
  if (!(v > 0)) fail(where, key, "must be positive or null, got " + j.at(key).dump());
  return v;
}

// Which layers use the sliding window: layer_types when the config lists them (transformers 5),
// else each family's rule for its older configs.
void parse_sliding(const json& j, const std::string& where, DecoderConfig& c) {
  const Family f = c.family;
  // Qwen's and SmolLM3's classes slide only under use_sliding_window.
  const bool qwen = f == Family::kQwen2 || f == Family::kQwen3 || f == Family::kSmolLM3;
  std::optional<int64_t> window;
  if (present(j, "sliding_window")) window = get_int(j, "sliding_window", where);
  else if ((is_gemma2_or_3(f) || c.model_type == "olmo3") && !j.contains("sliding_window")) window = 4096;
  else if (f == Family::kGemma4 && !j.contains("sliding_window")) window = 512;
  if (qwen && !get_bool(j, "use_sliding_window", where, false)) window.reset();
  // Gemma 4 writes "vision" (image tokens see each other; text stays causal) or "all" (an encoder).
  const bool bidirectional = f == Family::kGemma4 && present(j, "use_bidirectional_attention")
                                 ? get_str(j, "use_bidirectional_attention", where) != "vision"
                                 : get_bool(j, "use_bidirectional_attention", where, false);
  if (bidirectional) fail(where, "use_bidirectional_attention", "bidirectional (encoder) attention is not supported");
  const int64_t n = c.num_hidden_layers;
  c.sliding_layers.assign(static_cast<size_t>(n), false);
  if (f == Family::kQwen35) {
    window.reset();  // Qwen3.5 never slides; its other mixer is the Gated DeltaNet
    c.linear_layers.assign(static_cast<size_t>(n), false);
    if (!present(j, "layer_types")) {  // the class's rule: every full_attention_interval-th layer attends
      const int64_t every = get_int(j, "full_attention_interval", where, 4);
      if (every <= 0) fail(where, "full_attention_interval", "must be positive");
      for (int64_t i = 0; i < n; ++i) c.linear_layers[static_cast<size_t>(i)] = (i + 1) % every != 0;
    }
  }
  if (present(j, "layer_types")) {
    const json& t = j.at("layer_types");
    if (!t.is_array() || static_cast<int64_t>(t.size()) != n) {
      fail(where, "layer_types", "expected a list of " + std::to_string(n) + " layer types (num_hidden_layers)");
    }
    const bool qwen35 = f == Family::kQwen35;
    for (int64_t i = 0; i < n; ++i) {
      const json& v = t.at(static_cast<size_t>(i));
      if (v == "sliding_attention" && !qwen35) c.sliding_layers[static_cast<size_t>(i)] = true;
      else if (v == "linear_attention" && qwen35) c.linear_layers[static_cast<size_t>(i)] = true;
      else if (v != "full_attention")
        fail(where, "layer_types", "entry " + std::to_string(i) + " is " + v.dump() + " (supported: \"full_attention\", " +
                                       (qwen35 ? "\"linear_attention\")" : "\"sliding_attention\")"));
    }
  } else if (window) {
    const int64_t pattern = get_int(j, "sliding_window_pattern", where, 6);
    const int64_t max_window_layers = get_int(j, "max_window_layers", where, 0);
    for (int64_t i = 0; i < n; ++i) {
      bool s = true;  // llama/mistral/phi3: every layer
      if (f == Family::kGemma2) s = i % 2 == 0;
      if (f == Family::kGemma3) s = pattern <= 0 || (i + 1) % pattern != 0;
      if (f == Family::kGemma4) s = (i + 1) % 6 != 0;  // its class's fixed 5:1
      if (qwen) s = i >= max_window_layers;
      if (c.model_type == "olmo3") s = (i + 1) % 4 != 0;
      c.sliding_layers[static_cast<size_t>(i)] = s;
    }
  }
  // Gemma 4's class makes the last layer full attention whatever layer_types says (with a warning).
  if (f == Family::kGemma4) c.sliding_layers.back() = false;
  const bool any = std::find(c.sliding_layers.begin(), c.sliding_layers.end(), true) != c.sliding_layers.end();
  if (any && !window) fail(where, "sliding_window", "layer_types has sliding layers but no window is set");
  if (any) c.sliding_window = window;
}

// SmolLM3's NoPE layers: no_rope_layers lists 1 for a layer that rotates and 0 for one that does
// not; without it, every no_rope_layer_interval-th layer (4) goes without, as the class defaults.
void parse_nope(const json& j, const std::string& where, DecoderConfig& c) {
  if (c.family != Family::kSmolLM3) return;
  const int64_t n = c.num_hidden_layers;
  c.nope_layers.assign(static_cast<size_t>(n), false);
  if (present(j, "no_rope_layers")) {
    const json& t = j.at("no_rope_layers");
    if (!t.is_array() || static_cast<int64_t>(t.size()) != n)
      fail(where, "no_rope_layers", "expected a list of " + std::to_string(n) + " entries (num_hidden_layers)");
    for (int64_t i = 0; i < n; ++i) {
      const json& v = t.at(static_cast<size_t>(i));
      if (v != 0 && v != 1) fail(where, "no_rope_layers", "entry " + std::to_string(i) + " is " + v.dump() + " (0 or 1)");
      c.nope_layers[static_cast<size_t>(i)] = v == 0;
    }
    return;
  }
  const int64_t every = get_int(j, "no_rope_layer_interval", where, 4);
  if (every <= 0) fail(where, "no_rope_layer_interval", "must be positive");
  for (int64_t i = 0; i < n; ++i) c.nope_layers[static_cast<size_t>(i)] = (i + 1) % every == 0;
}

MlpActivation parse_activation(const json& j, const std::string& where, Family f) {
  const char* key = present(j, "hidden_activation") ? "hidden_activation" : "hidden_act";
  const bool gelu = is_any_gemma(f);
  const std::string act = present(j, key) ? get_str(j, key, where) : gelu ? "gelu_pytorch_tanh" : "silu";
  if (act == "silu") return MlpActivation::kSilu;
  if (act == "gelu_pytorch_tanh") return MlpActivation::kGeluTanh;
  fail(where, key, "'" + act + "' is not supported (silu or gelu_pytorch_tanh)");
}

// Gemma 4's layer index keys in per_layer_config: "5", or zero-padded "05" as transformers writes them.
int64_t layer_index(const std::string& key, int64_t n, const std::string& where) {
  const bool digits = !key.empty() && key.size() < 10 && key.find_first_not_of("0123456789") == std::string::npos;
  const int64_t i = digits ? std::stoll(key) : -1;
  if (i < 0 || i >= n) fail(where, "per_layer_config." + key, "expected a layer index in [0, " + std::to_string(n) + ")");
  return i;
}

// Gemma 4's full-attention layers' head_dim and kv heads. transformers writes per_layer_config (each
// layer's overrides); the Hub's configs give global_head_dim (the class's default: 512) and, under
// attention_k_eq_v, num_global_key_value_heads. Each layer type has one size, as its RoPE table does.
void parse_gemma4_heads(const json& j, const std::string& where, DecoderConfig& c) {
  const int64_t n = c.num_hidden_layers;
  if (!j.contains("per_layer_config")) {
    c.global_head_dim = get_int(j, "global_head_dim", where, 512);
    c.global_kv_heads = c.attention_k_eq_v ? get_int(j, "num_global_key_value_heads", where, c.num_key_value_heads)
                                           : c.num_key_value_heads;
    return;
  }
  std::vector<int64_t> hd(static_cast<size_t>(n), c.head_dim), kv(static_cast<size_t>(n), c.num_key_value_heads);
  const json& p = j.at("per_layer_config");
  if (!p.is_null() && !p.is_object()) fail(where, "per_layer_config", "expected an object of layer index -> overrides");
  const json overrides = p.is_null() ? json::object() : p;  // named: items() refers to it
  for (const auto& [key, ov] : overrides.items()) {
    const auto i = static_cast<size_t>(layer_index(key, n, where));
    const std::string w = where + " (per_layer_config." + key + ")";
    if (!ov.is_object()) fail(where, "per_layer_config." + key, "expected an object of overrides");
    for (const auto& [attr, v] : ov.items()) {
      if (attr == "head_dim") hd[i] = get_int(ov, "head_dim", w);
      else if (attr == "num_key_value_heads") kv[i] = get_int(ov, "num_key_value_heads", w);
      else fail(where, "per_layer_config." + key + "." + attr, "only head_dim and num_key_value_heads may differ per layer");
    }
  }
  int64_t type_hd[2] = {-1, -1}, type_kv[2] = {-1, -1};  // [full, sliding]
  for (int64_t i = 0; i < n; ++i) {
    const int t = c.is_sliding(i) ? 1 : 0;
    const auto u = static_cast<size_t>(i);
    if (type_hd[t] < 0) type_hd[t] = hd[u], type_kv[t] = kv[u];
    if (hd[u] != type_hd[t] || kv[u] != type_kv[t])
      fail(where, "per_layer_config", "layer " + std::to_string(i) + "'s head_dim / num_key_value_heads differ from " +
                                          "those of the other " + (t ? "sliding" : "full") + " attention layers");
  }
  if (type_hd[1] > 0) c.head_dim = type_hd[1], c.num_key_value_heads = type_kv[1];
  c.global_head_dim = type_hd[0] > 0 ? type_hd[0] : c.head_dim;
  c.global_kv_heads = type_kv[0] > 0 ? type_kv[0] : c.num_key_value_heads;
}

// Gemma 4's KV sharing (transformers' kv_sharing_modes): each of the last num_kv_shared_layers layers
// attends over the keys and values of the last earlier layer of its type.
void parse_kv_sharing(const json& j, const std::string& where, DecoderConfig& c) {
  const int64_t n = c.num_hidden_layers, shared = get_int(j, "num_kv_shared_layers", where, 0);
  if (shared == 0) return;
  if (shared < 0 || shared >= n) fail(where, "num_kv_shared_layers", "must be in [0, num_hidden_layers = " + std::to_string(n) + ")");
  const int64_t first = n - shared;
  c.kv_source.assign(static_cast<size_t>(n), -1);
  for (int64_t i = first; i < n; ++i) {
    int64_t src = first - 1;
    while (src >= 0 && c.is_sliding(src) != c.is_sliding(i)) --src;
    if (src < 0)
      fail(where, "num_kv_shared_layers", "layer " + std::to_string(i) + " would reuse the keys and values of an earlier " +
                                              (c.is_sliding(i) ? "sliding" : "full") + " attention layer, and none of the first " +
                                              std::to_string(first) + " layers is one");
    c.kv_source[static_cast<size_t>(i)] = src;
  }
}

// Gemma 4 (see decoder_config.h); its mixture-of-experts form is refused.
void parse_gemma4(const json& j, const std::string& where, DecoderConfig& c) {
  if (get_bool(j, "enable_moe_block", where, false))
    fail(where, "enable_moe_block", "Gemma 4's mixture-of-experts layers (gemma-4-26B-A4B) are not supported; fine-tune "
                                    "a dense Gemma 4 (E2B, E4B, 31B) instead");
  c.norm = modules::RmsScale::kWeightFp32;
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  c.query_pre_attn_scalar = 1.0;  // scores are q.k unscaled: q and k come out of RMSNorms
  c.final_logit_softcapping = softcap(j, "final_logit_softcapping", where, std::nullopt);
  c.attention_k_eq_v = get_bool(j, "attention_k_eq_v", where, false);
  parse_gemma4_heads(j, where, c);
  parse_kv_sharing(j, where, c);
  c.double_wide_mlp = get_bool(j, "use_double_wide_mlp", where, false);
  // null switches the per-layer inputs off, as 0 does; absent means the class's 256.
  const char* ple = "hidden_size_per_layer_input";
  c.per_layer_input_dim = !j.contains(ple) ? 256 : present(j, ple) ? get_int(j, ple, where) : 0;
  if (c.per_layer_input_dim < 0) fail(where, ple, "must be 0 (none) or positive");
  c.per_layer_input_vocab = get_int(j, "vocab_size_per_layer_input", where, 262144);
  if (c.per_layer_input_dim > 0 && c.per_layer_input_vocab <= 0)
    fail(where, "vocab_size_per_layer_input", "must be positive");
}

// What the family computes beyond a Llama block (see decoder_config.h).
void parse_family_numerics(const json& j, const std::string& where, DecoderConfig& c) {
  c.activation = parse_activation(j, where, c.family);
  const Family f = c.family;
  if (f == Family::kPhi3) {
    if (j.contains("attention_bias") && get_bool(j, "attention_bias", where, false))
      fail(where, "attention_bias", "Phi-3 has no attention biases");
  } else if (f != Family::kQwen2) {
    c.attention_bias = get_bool(j, "attention_bias", where, false);
  }
  if (get_bool(j, "mlp_bias", where, false)) fail(where, "mlp_bias", "MLP biases are not supported");
  if (f == Family::kQwen35) {
    c.norm = modules::RmsScale::kOnePlusWeight;  // every RMSNorm but the DeltaNet's gated one
    c.attn_output_gate = true;
    modules::GatedDeltaDims& g = c.gated_delta;
    g.conv_kernel = get_int(j, "linear_conv_kernel_dim", where, 4);
    g.key_head_dim = get_int(j, "linear_key_head_dim", where, 128);
    g.value_head_dim = get_int(j, "linear_value_head_dim", where, 128);
    g.num_key_heads = get_int(j, "linear_num_key_heads", where, 16);
    g.num_value_heads = get_int(j, "linear_num_value_heads", where, 32);
    c.mrope_section = mrope_section(j, where);
    return;
  }
  if (f == Family::kGemma4) return parse_gemma4(j, where, c);
  if (!is_gemma2_or_3(f)) return;
  c.norm = modules::RmsScale::kOnePlusWeight;
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  c.query_pre_attn_scalar = get_num(j, "query_pre_attn_scalar", where, 256.0);
  if (!(*c.query_pre_attn_scalar > 0)) fail(where, "query_pre_attn_scalar", "must be positive");
  const bool g2 = f == Family::kGemma2;
  c.attn_logit_softcapping = softcap(j, "attn_logit_softcapping", where, g2 ? std::optional<double>(50.0) : std::nullopt);
  c.final_logit_softcapping = softcap(j, "final_logit_softcapping", where, g2 ? std::optional<double>(30.0) : std::nullopt);
}

}  // namespace

void DecoderConfig::validate(const std::string& where) const {
  auto positive = [&](int64_t v, const char* key) {
    if (v <= 0) fail(where, key, "must be positive, got " + std::to_string(v));
  };
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(vocab_size, "vocab_size");
  if (num_attention_heads % num_key_value_heads != 0) {
    fail(where, "num_key_value_heads", "must divide num_attention_heads (" +
                                           std::to_string(num_attention_heads) + "), got " +
                                           std::to_string(num_key_value_heads));
  }
  if (head_dim % 2 != 0) fail(where, "head_dim", "rotate-half RoPE needs an even head_dim");
  if (!(rms_norm_eps > 0)) fail(where, "rms_norm_eps", "must be positive");
  if (!(rope_theta > 0)) fail(where, "rope_theta", "must be positive");
  if (sliding_window && *sliding_window <= 0) fail(where, "sliding_window", "must be positive or null");
  if (!sliding_layers.empty() && static_cast<int64_t>(sliding_layers.size()) != num_hidden_layers)
    fail(where, "layer_types", "needs one entry per layer");
  if (global_head_dim < 0 || global_head_dim % 2 != 0) fail(where, "global_head_dim", "must be even and positive");
  if (global_kv_heads > 0 && num_attention_heads % global_kv_heads != 0)
    fail(where, "num_global_key_value_heads", "must divide num_attention_heads (" + std::to_string(num_attention_heads) +
                                                  "), got " + std::to_string(global_kv_heads));
  if (rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 != 0)
    fail(where, "partial_rotary_factor", "the rotary part of head_dim must be even and at most head_dim");
  if (std::find(linear_layers.begin(), linear_layers.end(), true) == linear_layers.end()) return;
  const modules::GatedDeltaDims& g = gated_delta;
  positive(g.conv_kernel, "linear_conv_kernel_dim");
  positive(g.key_head_dim, "linear_key_head_dim");
  positive(g.value_head_dim, "linear_value_head_dim");
  positive(g.num_key_heads, "linear_num_key_heads");
  positive(g.num_value_heads, "linear_num_value_heads");
  if (g.num_value_heads % g.num_key_heads != 0)
    fail(where, "linear_num_value_heads", "must be a multiple of linear_num_key_heads (" +
                                              std::to_string(g.num_key_heads) + "), got " +
                                              std::to_string(g.num_value_heads));
}

bool DecoderConfig::is_kv_source(int64_t layer) const {
  return std::find(kv_source.begin(), kv_source.end(), layer) != kv_source.end();
}
int64_t DecoderConfig::layer_head_dim(int64_t layer) const {
  return global_head_dim > 0 && !is_sliding(layer) ? global_head_dim : head_dim;
}
int64_t DecoderConfig::layer_kv_heads(int64_t layer) const {
  return global_kv_heads > 0 && !is_sliding(layer) ? global_kv_heads : num_key_value_heads;
}
int64_t DecoderConfig::layer_intermediate(int64_t layer) const {
  return double_wide_mlp && is_kv_shared(layer) ? 2 * intermediate_size : intermediate_size;
}

namespace {

// A text-only decoder's config.json, or a multimodal one's text_config (defaults filled in).
DecoderConfig parse_text_config(const json& j, const std::string& where) {
  DecoderConfig c;
  c.model_type = get_str(j, "model_type", where);
  c.family = parse_family(j, where, c.model_type);
  c.hidden_size = get_int(j, "hidden_size", where);
  c.intermediate_size = get_int(j, "intermediate_size", where);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", where);
  c.num_attention_heads = get_int(j, "num_attention_heads", where);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", where, c.num_attention_heads);
  c.vocab_size = get_int(j, "vocab_size", where);
  if (c.num_attention_heads <= 0) fail(where, "num_attention_heads", "must be positive");
  if (c.num_hidden_layers <= 0) fail(where, "num_hidden_layers", "must be positive");
  // Gemma's classes default head_dim to 256 rather than hidden / heads.
  const bool head_256 = is_gemma2_or_3(c.family) || c.family == Family::kQwen35 || c.family == Family::kGemma4;
  c.head_dim = get_int(j, "head_dim", where, head_256 ? 256 : c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps =
      get_num(j, "rms_norm_eps", where, c.family == Family::kPhi3 || c.family == Family::kOlmo2 ? 1e-5 : 1e-6);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", where, 2048);
  c.tie_word_embeddings =
      get_bool(j, "tie_word_embeddings", where,
               is_gemma2_or_3(c.family) || c.family == Family::kSmolLM3 || c.family == Family::kGemma4);
  parse_rope(j, where, c);
  if (present(j, "bos_token_id")) c.bos_token_id = get_int(j, "bos_token_id", where);
  c.eos_token_ids = eos_ids(j, where);
  parse_sliding(j, where, c);
  parse_nope(j, where, c);
  parse_family_numerics(j, where, c);
  // pretraining_tp only changes how HF splits matmuls (same maths up to rounding): ignored. So are
  // dropout probabilities (attention_dropout, resid_pdrop, ...): the base is frozen and run in
  // eval form; only the LoRA path has dropout (lora.dropout).
  c.validate(where);
  return c;
}

// Gemma3Config's text_config (transformers' Gemma3TextConfig): a config.json may list only the
// keys that differ from the class's defaults (the Hub's gemma-3-4b/12b/27b do: no vocab_size,
// num_attention_heads, ...), so the defaults our parser does not share are filled in first.
// Defaults it shares (head_dim 256, RoPE bases 1e6 / 1e4, window 4096, gelu_pytorch_tanh,
// query_pre_attn_scalar 256, no soft-capping) are the parser's own for gemma3_text.
json gemma3_text_defaults() {
  return {{"model_type", "gemma3_text"}, {"vocab_size", 262208},      {"hidden_size", 2304},
          {"intermediate_size", 9216},   {"num_hidden_layers", 26},   {"num_attention_heads", 8},
          {"num_key_value_heads", 4},    {"max_position_embeddings", 131072},
          {"bos_token_id", 2},           {"eos_token_id", 1}};
}

// Qwen3_5Config's text_config (Qwen3_5TextConfig): the class defaults our parser does not share
// (head_dim 256, the linear_* sizes, partial rotary 0.25 and the layer pattern are the parser's own).
json qwen35_text_defaults() {
  return {{"model_type", "qwen3_5_text"}, {"vocab_size", 248320},     {"hidden_size", 4096},
          {"intermediate_size", 12288},   {"num_hidden_layers", 32},  {"num_attention_heads", 16},
          {"num_key_value_heads", 4},     {"max_position_embeddings", 32768}};
}

// Gemma4Config's text_config (Gemma4TextConfig): the class defaults our parser does not share (head_dim
// 256, window 512, the RoPE pair, global_head_dim 512 and the per-layer input sizes are its own).
json gemma4_text_defaults() {
  return {{"model_type", "gemma4_text"}, {"vocab_size", 262144},     {"hidden_size", 2304},
          {"intermediate_size", 9216},   {"num_hidden_layers", 30},  {"num_attention_heads", 8},
          {"num_key_value_heads", 4},    {"max_position_embeddings", 131072},
          {"bos_token_id", 2},           {"eos_token_id", 1}};
}

// A checkpoint whose language model sits beside a vision tower: the language model is text_config
// (of model_type text_type); the tower's settings are nobody's business here (its weights are
// copied, never computed).
struct MultimodalForm {
  const char* model_type;
  const char* text_type;
  json (*text_defaults)();
  bool tie_default;  // the class's tie_word_embeddings
};
constexpr MultimodalForm kMultimodal[] = {{kGemma3Multimodal, "gemma3_text", gemma3_text_defaults, true},
                                          {kQwen35Multimodal, "qwen3_5_text", qwen35_text_defaults, false},
                                          {kGemma4Multimodal, "gemma4_text", gemma4_text_defaults, true}};

DecoderConfig parse_multimodal(const json& j, const std::string& where, const MultimodalForm& form) {
  if (!present(j, "text_config"))
    fail(where, "text_config",
         std::string("missing (a ") + form.model_type + " config keeps its language model's settings there)");
  const json& t = j.at("text_config");
  if (!t.is_object()) fail(where, "text_config", "expected an object, got " + t.dump());
  json text = form.text_defaults();
  text.update(t);
  // The model class ties its head by the top-level key, and its generation stops at the top-level
  // eos_token_id when there is one (Gemma 3's lists <end_of_turn> too).
  text["tie_word_embeddings"] = get_bool(j, "tie_word_embeddings", where, form.tie_default);
  if (present(j, "eos_token_id")) text["eos_token_id"] = j.at("eos_token_id");
  const std::string text_where = where + " (text_config)";
  if (get_str(text, "model_type", text_where) != form.text_type)
    fail(text_where, "model_type", std::string("expected \"") + form.text_type + "\", got " + text.at("model_type").dump());
  DecoderConfig c = parse_text_config(text, text_where);
  c.model_type = form.model_type;
  c.multimodal = true;
  return c;
}

}  // namespace

DecoderConfig parse_llama_config(const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(where + ": expected a JSON object");
  const std::string type = get_str(j, "model_type", where);
  for (const MultimodalForm& form : kMultimodal)
    if (type == form.model_type) return parse_multimodal(j, where, form);
  return parse_text_config(j, where);
}

std::vector<int64_t> load_generation_eos_ids(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "generation_config.json").string();
  const auto text = io::read_file(path);
  if (!text) return {};
  json j;
  try {
    j = json::parse(*text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(path + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(path + ": expected a JSON object");
  return io::naming_file(path, [&] { return eos_ids(j, path); });
}

std::string supported_model_types() {
  std::string out;
  for (const FamilyName& f : kFamilies) out += (out.empty() ? "" : ", ") + std::string(f.model_type);
  for (const MultimodalForm& form : kMultimodal) out += std::string(", ") + form.model_type;
  return out;
}

DecoderConfig load_decoder_config(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  if (fs::is_directory(p)) p /= "config.json";
  const auto text = io::read_file(p.string());
  if (!text) throw std::invalid_argument(p.string() + ": cannot open config file");
  return io::naming_file(p.string(), [&] { return parse_llama_config(*text, p.string()); });
}

}  // namespace qlora::models
