#include "qlora/models/decoder_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "qlora/io/read_file.h"
#include "qlora/models/config_json.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

using namespace cfg;

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

// partial_rotary_factor, at the top level or in the RoPE dict: a family with a default share
// (Qwen3.5's class: 0.25) rotates that much of head_dim; the others rotate all of it and take only 1.
void parse_partial_rotary(const json& j, const char* rope_key, const std::string& where, DecoderConfig& c) {
  const bool partial_ok = c.family->partial_rotary_factor > 0;
  std::string key = "partial_rotary_factor";
  double factor = partial_ok ? c.family->partial_rotary_factor : 1.0;
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

// RoPE: transformers <= 4.x wrote rope_theta at top level and scaling in rope_scaling; 5.x writes
// one rope_parameters dict holding rope_theta and rope_type, or (Gemma 3) one dict per layer type.
// Gemma 3's older form: rope_theta + rope_scaling for global layers, rope_local_base_freq for local.
// The sliding layers' RoPE is the family's (Family::local_rope).
void parse_rope(const json& j, const std::string& where, DecoderConfig& c) {
  const Family& f = *c.family;
  modules::RopeParams global;
  global.theta = get_num(j, "rope_theta", where, f.rope_theta);
  if (f.proportional_rope > 0) global.proportional = modules::ProportionalRope{f.proportional_rope};
  modules::RopeParams local;
  local.theta = f.local_rope == LocalRope::kFullBase ? global.theta : get_num(j, "rope_local_base_freq", where, 10000.0);
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
  if (f.local_rope != LocalRope::kNone) c.local_rope = local;
}

// model_type -> family; another multimodal checkpoint or another family is refused by name.
const Family* parse_family(const json& j, const std::string& where, const std::string& type) {
  if (present(j, "vision_config") || present(j, "text_config")) {
    std::string forms;
    for (const Family* f : all_families())
      if (f->multimodal) forms += (forms.empty() ? "" : ", ") + std::string(f->multimodal->model_type) + "'s";
    fail(where, present(j, "vision_config") ? "vision_config" : "text_config",
         "'" + type + "' is a multimodal checkpoint (a vision tower beside the language model); of those only " + forms +
             " language models are supported, otherwise text-only decoders (" + supported_model_types() + ")");
  }
  for (const Family* f : all_families())
    for (const char* t : f->model_types)
      if (type == t) return f;
  fail(where, "model_type", "'" + type + "' is not supported (supported: " + supported_model_types() + ")");
}

// Which layers use the sliding window: layer_types when the config lists them (transformers 5),
// else each family's rule for its older configs.
void parse_sliding(const json& j, const std::string& where, DecoderConfig& c) {
  const Family& f = *c.family;
  std::optional<int64_t> window;
  if (present(j, "sliding_window")) window = get_int(j, "sliding_window", where);
  else if (!j.contains("sliding_window")) window = f.sliding_window;
  if (f.sliding_needs_flag && !get_bool(j, "use_sliding_window", where, false)) window.reset();
  // Gemma 4 writes "vision" (image tokens see each other; text stays causal) or "all" (an encoder).
  const bool bidirectional = f.bidirectional_vision && present(j, "use_bidirectional_attention")
                                 ? get_str(j, "use_bidirectional_attention", where) != "vision"
                                 : get_bool(j, "use_bidirectional_attention", where, false);
  if (bidirectional) fail(where, "use_bidirectional_attention", "bidirectional (encoder) attention is not supported");
  if (f.bidirectional_vision && present(j, "use_bidirectional_attention"))
    c.image_attention = DecoderConfig::ImageAttention::kSlidingLayers;  // "vision"
  const int64_t n = c.num_hidden_layers;
  c.sliding_layers.assign(static_cast<size_t>(n), false);
  const bool linear = f.gated_delta_layers;
  if (linear) {
    window.reset();  // never slides; its other mixer is the Gated DeltaNet
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
    for (int64_t i = 0; i < n; ++i) {
      const json& v = t.at(static_cast<size_t>(i));
      if (v == "sliding_attention" && !linear) c.sliding_layers[static_cast<size_t>(i)] = true;
      else if (v == "linear_attention" && linear) c.linear_layers[static_cast<size_t>(i)] = true;
      else if (v != "full_attention")
        fail(where, "layer_types", "entry " + std::to_string(i) + " is " + v.dump() + " (supported: \"full_attention\", " +
                                       (linear ? "\"linear_attention\")" : "\"sliding_attention\")"));
    }
  } else if (window) {
    for (int64_t i = 0; i < n; ++i) c.sliding_layers[static_cast<size_t>(i)] = !f.slides || f.slides(j, where, i);
  }
  // Gemma 4's class makes the last layer full attention whatever layer_types says (with a warning).
  if (f.last_layer_full) c.sliding_layers.back() = false;
  const bool any = std::find(c.sliding_layers.begin(), c.sliding_layers.end(), true) != c.sliding_layers.end();
  if (any && !window) fail(where, "sliding_window", "layer_types has sliding layers but no window is set");
  if (any) c.sliding_window = window;
}

// SmolLM3's NoPE layers: no_rope_layers lists 1 for a layer that rotates and 0 for one that does
// not; without it, every no_rope_layer_interval-th layer (4) goes without, as the class defaults.
void parse_nope(const json& j, const std::string& where, DecoderConfig& c) {
  if (!c.family->nope_layers) return;
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

MlpActivation parse_activation(const json& j, const std::string& where, const Family& f) {
  const char* key = present(j, "hidden_activation") ? "hidden_activation" : "hidden_act";
  const bool gelu = f.activation == MlpActivation::kGeluTanh;
  const std::string act = present(j, key) ? get_str(j, key, where) : gelu ? "gelu_pytorch_tanh" : "silu";
  if (act == "silu") return MlpActivation::kSilu;
  if (act == "gelu_pytorch_tanh") return MlpActivation::kGeluTanh;
  fail(where, key, "'" + act + "' is not supported (silu or gelu_pytorch_tanh)");
}

// What the family computes beyond a Llama block (its Family::parse), after the keys every family reads.
void parse_family_numerics(const json& j, const std::string& where, DecoderConfig& c) {
  const Family& f = *c.family;
  c.activation = parse_activation(j, where, f);
  if (f.attention_bias == AttentionBiasKey::kRefused) {
    if (j.contains("attention_bias") && get_bool(j, "attention_bias", where, false))
      fail(where, "attention_bias", std::string(f.name) + " has no attention biases");
  } else if (f.attention_bias == AttentionBiasKey::kRead) {
    c.attention_bias = get_bool(j, "attention_bias", where, false);
  }
  if (get_bool(j, "mlp_bias", where, false)) fail(where, "mlp_bias", "MLP biases are not supported");
  if (f.parse) f.parse(j, where, c);
}

}  // namespace

void DecoderConfig::validate(const std::string& where) const {
  auto positive = [&](int64_t v, const char* key) {
    if (v <= 0) fail(where, key, "must be positive, got " + std::to_string(v));
  };
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, family ? family->intermediate_key : "intermediate_size");
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
  const char* inter_key = c.family->intermediate_key;
  c.intermediate_size = c.family->intermediate_default > 0
                            ? get_int(j, inter_key, where, c.family->intermediate_default)
                            : get_int(j, inter_key, where);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", where);
  c.num_attention_heads = get_int(j, "num_attention_heads", where);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", where, c.num_attention_heads);
  c.vocab_size = get_int(j, "vocab_size", where);
  if (c.num_attention_heads <= 0) fail(where, "num_attention_heads", "must be positive");
  if (c.num_hidden_layers <= 0) fail(where, "num_hidden_layers", "must be positive");
  const Family& f = *c.family;
  c.head_dim = get_int(j, "head_dim", where, f.head_dim > 0 ? f.head_dim : c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps = get_num(j, "rms_norm_eps", where, f.rms_norm_eps);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", where, 2048);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", where, f.tie_word_embeddings);
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

// A checkpoint whose language model sits beside a vision tower (Family::multimodal): the language
// model is text_config, of the family's first model_type. A config.json may list only the keys that
// differ from the text class's defaults (the Hub's gemma-3-4b/12b/27b do: no vocab_size,
// num_attention_heads, ...), so the defaults our parser does not share are filled in first. The
// tower's settings are nobody's business here (its weights are copied, never computed).
DecoderConfig parse_multimodal(const json& j, const std::string& where, const Family& family) {
  const Family::Multimodal& form = *family.multimodal;
  const char* text_type = family.model_types.at(0);
  if (!present(j, "text_config"))
    fail(where, "text_config",
         std::string("missing (a ") + form.model_type + " config keeps its language model's settings there)");
  const json& t = j.at("text_config");
  if (!t.is_object()) fail(where, "text_config", "expected an object, got " + t.dump());
  json text = json::parse(form.text_defaults);
  text["model_type"] = text_type;
  text.update(t);
  // The model class ties its head by the top-level key, and its generation stops at the top-level
  // eos_token_id when there is one (Gemma 3's lists <end_of_turn> too).
  text["tie_word_embeddings"] = get_bool(j, "tie_word_embeddings", where, form.tie_word_embeddings);
  if (present(j, "eos_token_id")) text["eos_token_id"] = j.at("eos_token_id");
  const std::string text_where = where + " (text_config)";
  if (get_str(text, "model_type", text_where) != text_type)
    fail(text_where, "model_type", std::string("expected \"") + text_type + "\", got " + text.at("model_type").dump());
  DecoderConfig c = parse_text_config(text, text_where);
  c.model_type = form.model_type;
  c.multimodal = true;
  if (form.images_bidirectional) c.image_attention = DecoderConfig::ImageAttention::kAllLayers;
  c.image_token_id = form.image_token_id;
  for (const char* key : {"image_token_id", "image_token_index"})
    if (present(j, key)) c.image_token_id = get_int(j, key, where);
  c.image_spatial_merge = form.spatial_merge;
  if (present(j, "vision_config") && j.at("vision_config").is_object() &&
      present(j.at("vision_config"), "spatial_merge_size"))
    c.image_spatial_merge = get_int(j.at("vision_config"), "spatial_merge_size", where + " (vision_config)");
  if (c.image_spatial_merge < 1) fail(where, "vision_config.spatial_merge_size", "must be >= 1");
  return c;
}

}  // namespace

DecoderConfig parse_decoder_config(const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(where + ": expected a JSON object");
  const std::string type = get_str(j, "model_type", where);
  for (const Family* f : all_families())
    if (f->multimodal && type == f->multimodal->model_type) return parse_multimodal(j, where, *f);
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
  for (const Family* f : all_families())
    for (const char* t : f->model_types) out += (out.empty() ? "" : ", ") + std::string(t);
  for (const Family* f : all_families())
    if (f->multimodal) out += std::string(", ") + f->multimodal->model_type;
  return out;
}

DecoderConfig load_decoder_config(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  if (fs::is_directory(p)) p /= "config.json";
  const auto text = io::read_file(p.string());
  if (!text) throw std::invalid_argument(p.string() + ": cannot open config file");
  return io::naming_file(p.string(), [&] { return parse_decoder_config(*text, p.string()); });
}

}  // namespace qlora::models
