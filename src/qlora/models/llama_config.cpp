#include "qlora/models/llama_config.h"
#include "qlora/io/read_file.h"

#include <nlohmann/json.hpp>

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

// RoPE: transformers <= 4.x wrote rope_theta at top level and scaling in rope_scaling; 5.x writes
// one rope_parameters dict holding rope_theta and rope_type. Accept both.
void parse_rope(const json& j, const std::string& where, LlamaConfig& c) {
  c.rope_theta = get_num(j, "rope_theta", where, 10000.0);
  const char* key = present(j, "rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (!present(j, key)) return;
  const json& r = j.at(key);
  if (!r.is_object()) fail(where, key, "expected an object or null, got " + r.dump());
  const std::string sub = std::string(key) + ".";
  if (present(r, "rope_theta")) c.rope_theta = get_num(r, "rope_theta", where + " (" + key + ")");
  std::string type = "default";
  if (present(r, "rope_type")) type = get_str(r, "rope_type", where + " (" + key + ")");
  else if (present(r, "type")) type = get_str(r, "type", where + " (" + key + ")");
  if (type == "default") return;
  if (type != "llama3") {
    fail(where, sub + "rope_type", "'" + type + "' is not supported (only default and llama3)");
  }
  Llama3RopeScaling s;
  const std::string w = where + " (" + key + ")";
  s.factor = get_num(r, "factor", w);
  s.low_freq_factor = get_num(r, "low_freq_factor", w);
  s.high_freq_factor = get_num(r, "high_freq_factor", w);
  // transformers falls back to max_position_embeddings when this is absent.
  s.original_max_position_embeddings =
      get_int(r, "original_max_position_embeddings", w, get_int(j, "max_position_embeddings", where, 2048));
  if (!(s.factor > 0) || !(s.high_freq_factor > s.low_freq_factor) || !(s.low_freq_factor > 0)) {
    fail(where, sub + "factor", "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0");
  }
  c.rope_scaling = s;
}

}  // namespace

void LlamaConfig::validate(const std::string& where) const {
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
}

LlamaConfig parse_llama_config(const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(where + ": expected a JSON object");
  LlamaConfig c;
  c.model_type = get_str(j, "model_type", where);
  if (c.model_type != "llama" && c.model_type != "mistral") {
    fail(where, "model_type", "'" + c.model_type + "' is not supported (llama or mistral)");
  }
  c.hidden_size = get_int(j, "hidden_size", where);
  c.intermediate_size = get_int(j, "intermediate_size", where);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", where);
  c.num_attention_heads = get_int(j, "num_attention_heads", where);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", where, c.num_attention_heads);
  c.vocab_size = get_int(j, "vocab_size", where);
  if (c.num_attention_heads <= 0) fail(where, "num_attention_heads", "must be positive");
  c.head_dim = get_int(j, "head_dim", where, c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps = get_num(j, "rms_norm_eps", where, 1e-6);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", where, 2048);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", where, false);
  parse_rope(j, where, c);
  if (present(j, "bos_token_id")) c.bos_token_id = get_int(j, "bos_token_id", where);
  if (present(j, "eos_token_id")) {
    const json& e = j.at("eos_token_id");
    if (e.is_number_integer()) {
      c.eos_token_ids.push_back(e.get<int64_t>());
    } else if (e.is_array()) {
      for (const json& v : e) {
        if (!v.is_number_integer()) fail(where, "eos_token_id", "list entries must be integers");
        c.eos_token_ids.push_back(v.get<int64_t>());
      }
    } else {
      fail(where, "eos_token_id", "expected an integer or a list of integers, got " + e.dump());
    }
  }
  if (present(j, "sliding_window")) c.sliding_window = get_int(j, "sliding_window", where);
  const std::string act = present(j, "hidden_act") ? get_str(j, "hidden_act", where) : "silu";
  if (act != "silu") fail(where, "hidden_act", "'" + act + "' is not supported (only silu)");
  if (get_bool(j, "attention_bias", where, false)) fail(where, "attention_bias", "biases are not supported");
  if (get_bool(j, "mlp_bias", where, false)) fail(where, "mlp_bias", "biases are not supported");
  // pretraining_tp only changes how HF splits matmuls (same maths up to rounding): ignored.
  c.validate(where);
  return c;
}

LlamaConfig load_llama_config(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  if (fs::is_directory(p)) p /= "config.json";
  const auto text = io::read_file(p.string());
  if (!text) throw std::invalid_argument(p.string() + ": cannot open config file");
  return parse_llama_config(*text, p.string());
}

}  // namespace qlora::models
