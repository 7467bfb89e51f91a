// The Llama-family architecture description, parsed from a Hugging Face config.json.
// Covers Llama-2, Llama-3/3.1 (GQA, llama3 RoPE scaling) and Mistral-7B. Keys we do not model
// are ignored (HF configs carry many training/generation keys); keys we model but whose value we
// cannot honour (another rope type, attention/MLP biases, an activation other than SiLU) are
// errors, because silently ignoring them would give a model that differs from the checkpoint's.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qlora/modules/rope_scaling.h"

namespace qlora::models {

using modules::Llama3RopeScaling;

struct LlamaConfig {
  std::string model_type;  // "llama" or "mistral"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads (plain MHA)
  int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<Llama3RopeScaling> rope_scaling;  // nullopt: plain RoPE
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // the HF key may be an int or a list
  // Mistral's sliding-window attention. We implement full causal attention only, which equals
  // sliding-window attention as long as seq_len <= sliding_window; forward() checks that.
  std::optional<int64_t> sliding_window;

  int64_t kv_groups() const { return num_attention_heads / num_key_value_heads; }
  // Throws std::invalid_argument (prefixed with `where`) when sizes are inconsistent.
  void validate(const std::string& where) const;
};

// Parses JSON text; `where` (usually the file path) prefixes every error message.
LlamaConfig parse_llama_config(const std::string& json_text, const std::string& where);
// Reads `path`: a config.json file or a checkpoint directory containing one.
LlamaConfig load_llama_config(const std::string& path);

}  // namespace qlora::models
