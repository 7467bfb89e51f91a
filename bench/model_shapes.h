// Real model shapes for the benches, as the published config.json files spell them: each shape is
// built by parsing its config.json text through models::parse_decoder_config, so the families' own
// parsing (defaults, sliding layers, RoPE, soft-caps) decides what the bench runs. Only the keys
// that decide sizes and compute are kept; the parser ignores the others.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "qlora/models/decoder_config.h"

namespace qlora::bench {

struct ModelShape {
  const char* name;         // what --shape takes
  const char* config_json;  // the published config.json (architecture keys)
};

// Sources (the values were copied from these public copies of the Hub files; "LLM-Prof" is
// github.com/citsjtu2020/LLM-Prof sglang/Model_Config.md @8434c8d, verbatim config.json files):
inline constexpr ModelShape kModelShapes[] = {
    // meta-llama/Llama-2-7b-hf config.json (the shape random_llama2_7b built before shapes had names).
    {"llama2-7b", R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_scaling": null,
      "tie_word_embeddings": false, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2})"},
    // meta-llama/Llama-3.1-8B config.json: LLM-Prof (verbatim).
    {"llama3.1-8b", R"({"model_type": "llama", "attention_bias": false, "hidden_act": "silu",
      "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 128256,
      "bos_token_id": 128000, "eos_token_id": 128001})"},
    // mistralai/Mistral-7B-v0.3 config.json: github.com/dotnet/machinelearning
    // src/Microsoft.ML.GenAI.Mistral/Resource/Config/mistral-7B-instruct-v0.3.json @7bd9338 (the
    // Instruct-v0.3 file; the base v0.3 has the same architecture keys, as Lightning-AI/litgpt
    // litgpt/config.py's Mistral-7B-v0.3 entry confirms: vocab 32768, no sliding window).
    {"mistral-7b", R"({"model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
      "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
      "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
      "sliding_window": null, "tie_word_embeddings": false, "vocab_size": 32768,
      "bos_token_id": 1, "eos_token_id": 2})"},
    // Qwen/Qwen2.5-7B config.json: LLM-Prof (verbatim).
    {"qwen2.5-7b", R"({"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
      "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
      "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": false,
      "use_sliding_window": false, "vocab_size": 152064, "bos_token_id": 151643, "eos_token_id": 151643})"},
    // Qwen/Qwen3-8B config.json: LLM-Prof (verbatim).
    {"qwen3-8b", R"({"model_type": "qwen3", "attention_bias": false, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
      "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
      "tie_word_embeddings": false, "use_sliding_window": false, "vocab_size": 151936,
      "bos_token_id": 151643, "eos_token_id": 151645})"},
    // google/gemma-2-9b config.json: Lightning-AI/litgpt litgpt/config.py's Gemma-2-9b entry (which
    // cites that file: 3584 x 42 layers, 16 heads / 8 kv of 256, 14336, vocab 256000, query scalar
    // 256, window 4096 on even layers, soft-caps 50 / 30), keys as the Hub file spells them.
    {"gemma2-9b", R"({"model_type": "gemma2", "attention_bias": false, "attn_logit_softcapping": 50.0,
      "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
      "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
      "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
      "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
      "sliding_window": 4096, "vocab_size": 256000, "bos_token_id": 2, "eos_token_id": 1})"},
    // google/gemma-3-12b-pt, its text_config as a text-only gemma3_text config.json: the sizes of
    // AI-Hypercomputer/maxtext src/MaxText/utils/ckpt_conversion/utils/hf_model_configs.py
    // (gemma3_12b_config.text_config) and litgpt's Gemma-3-12b entry; the keys the Hub file leaves
    // to Gemma3TextConfig's defaults (transformers 5.23) written out: vocab 262208, rope_theta 1e6
    // (global, linear x8), rope_local_base_freq 1e4, query scalar 256, 5 local : 1 global layers.
    {"gemma3-12b", R"({"model_type": "gemma3_text", "attention_bias": false, "head_dim": 256,
      "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3840, "intermediate_size": 15360,
      "max_position_embeddings": 131072, "num_attention_heads": 16, "num_hidden_layers": 48,
      "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
      "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0,
      "rope_local_base_freq": 10000.0, "sliding_window": 1024, "sliding_window_pattern": 6,
      "attn_logit_softcapping": null, "final_logit_softcapping": null, "vocab_size": 262208,
      "bos_token_id": 2, "eos_token_id": [1, 106]})"},
    // Qwen/Qwen3.5-9B's text_config (the Hub's config is Qwen3_5ForConditionalGeneration; its language
    // model as a text-only qwen3_5_text config.json). Values as a public test pins them against the Hub
    // file (medrl's QWEN35_9B_EXPECTATIONS TEXT_CONFIG): 4096 x 32 layers, 3 Gated DeltaNet : 1 full
    // attention, 16 heads / 4 kv of 256 with a quarter rotary at theta 1e7, DeltaNet 16 key heads and
    // 32 value heads of 128, conv 4, MLP 12288, vocab 248320, untied.
    {"qwen3.5-9b", R"({"model_type": "qwen3_5_text", "attention_bias": false, "head_dim": 256,
      "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
      "num_attention_heads": 16, "num_key_value_heads": 4, "full_attention_interval": 4,
      "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
      "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
      "rms_norm_eps": 1e-06, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
      "partial_rotary_factor": 0.25, "mrope_interleaved": true, "mrope_section": [11, 11, 10]},
      "tie_word_embeddings": false, "vocab_size": 248320, "eos_token_id": 248044})"},
    // microsoft/Phi-3-mini-4k-instruct config.json: github.com/dotnet/machinelearning
    // src/Microsoft.ML.GenAI.Phi/Resource/Config/phi-3-mini-4k-instruct-config.json @17b689a.
    {"phi3-mini", R"({"model_type": "phi3", "hidden_act": "silu", "hidden_size": 3072,
      "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 32,
      "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
      "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0, "sliding_window": 2047,
      "tie_word_embeddings": false, "vocab_size": 32064, "bos_token_id": 1, "eos_token_id": 32000})"},
};

inline std::string model_shape_names() {
  std::string out;
  for (const ModelShape& s : kModelShapes) out += (out.empty() ? "" : "|") + std::string(s.name);
  return out;
}

inline const ModelShape& model_shape(const std::string& name) {
  for (const ModelShape& s : kModelShapes)
    if (name == s.name) return s;
  throw std::invalid_argument("unknown shape '" + name + "' (expected " + model_shape_names() + ")");
}

// The shape's config with its first `layers` layers (0: all of them), parsed as a checkpoint's
// config.json is; per-layer rules (sliding layers, local RoPE) follow the truncated depth as they
// would for a checkpoint of that many layers.
inline models::DecoderConfig model_shape_config(const std::string& name, int64_t layers = 0) {
  nlohmann::json j = nlohmann::json::parse(model_shape(name).config_json);
  if (layers > 0) j["num_hidden_layers"] = layers;
  return models::parse_decoder_config(j.dump(), "bench shape " + name);
}

}  // namespace qlora::bench
