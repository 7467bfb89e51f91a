// A decoder-only model's architecture description, parsed from a Hugging Face config.json.
// One struct serves every family we load (all are decoder-only transformers); the family decides which weights exist (models/architecture.h) and the
// fields below say what its compute does differently:
//   llama, mistral  Llama-2, Llama-3/3.1 (GQA, llama3 RoPE scaling), Mistral (sliding window)
//   qwen2           Qwen2/2.5: q/k/v biases
//   qwen3           Qwen3: per-head RMSNorm on q and k
//   gemma2          (1 + w) norms, sqrt(hidden) embedding scale, four norms a block, soft-capping,
//                   query_pre_attn_scalar, sliding window on alternate layers, GeGLU (gelu tanh)
//   gemma3_text     Gemma 2's norms plus q/k norms, local:global layers with their own RoPE
//   phi3            fused qkv_proj and gate_up_proj
//   smollm3         SmolLM3: Llama's block, no RoPE on the layers no_rope_layers marks (NoPE)
//   olmo2, olmo3    OLMo 2/3: no input norms, post-norms closing each branch, q/k RMSNorm over all
//                   heads; OLMo 3 slides on three of four layers, YaRN RoPE on its full layers
//   qwen3_5_text    Qwen3.5: three of four layers are Gated DeltaNet (linear_attention), the rest
//                   full attention with a sigmoid output gate packed into q_proj, (1 + w) q/k norms
//                   and rotary on the first partial_rotary_factor of head_dim; (1 + w) norms
//   qwen3_5         the Hub's Qwen3.5 (Qwen3_5ForConditionalGeneration): the qwen3_5_text language
//                   model of its text_config beside a vision tower (copied, never computed)
//   gemma4_text     Gemma 4 (dense): w-scaled fp32 norms (not 1 + w), q/k norms and a weightless v
//                   norm with attention scale 1, sliding layers and full layers with their own
//                   head_dim / kv heads (global_head_dim) and proportional RoPE, per-layer input
//                   embeddings (PLE), a layer_scalar per layer, KV sharing across the last layers,
//                   attention_k_eq_v (v = k on full layers), double-wide MLPs on KV-shared layers
//   gemma4          the Hub's Gemma 4 (Gemma4ForConditionalGeneration): gemma4_text's language
//                   model of its text_config beside vision and audio towers (copied, never computed)
//   gemma3          the Hub's Gemma 3 4B/12B/27B (Gemma3ForConditionalGeneration): the gemma3_text
//                   language model of its text_config; the vision tower is never computed (its
//                   weights are copied into merged exports), its weights' prefixes: key_layout.h
// Keys we do not model are ignored (HF configs carry many training/generation keys); keys we
// model but whose value we cannot honour (another rope type, MLP biases, another activation, a
// vision tower) are errors naming the key, because a silently different model is worse than none.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qlora/modules/options.h"

namespace qlora::models {

using modules::Llama3RopeScaling;

enum class Family { kLlama, kQwen2, kQwen3, kGemma2, kGemma3, kPhi3, kSmolLM3, kOlmo2, kQwen35, kGemma4 };
// Gemma 2 and 3: (1 + w) norms, the embedding scaled by sqrt(hidden), a default window.
inline bool is_gemma2_or_3(Family f) { return f == Family::kGemma2 || f == Family::kGemma3; }
// Every Gemma (2, 3 and 4): GeGLU, four norms a block.
inline bool is_any_gemma(Family f) { return is_gemma2_or_3(f) || f == Family::kGemma4; }
// The multimodal Gemma 3's model_type; its language model is Family::kGemma3.
inline constexpr const char* kGemma3Multimodal = "gemma3";
// The multimodal Qwen3.5's model_type; its language model is Family::kQwen35.
inline constexpr const char* kQwen35Multimodal = "qwen3_5";
// The multimodal Gemma 4's model_type; its language model is Family::kGemma4.
inline constexpr const char* kGemma4Multimodal = "gemma4";
using modules::MlpActivation;

struct DecoderConfig {
  std::string model_type;  // as config.json spells it: "llama", "mistral", "qwen2", ...
  Family family = Family::kLlama;
  // The language model of a multimodal checkpoint (gemma3): these settings are its text_config's,
  // and its weights sit under a language-model prefix beside a vision tower (key_layout.h).
  bool multimodal = false;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads (plain MHA)
  int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<Llama3RopeScaling> rope_scaling;  // llama3 scaling; nullopt: none
  double rope_linear_factor = 1.0;                // "linear" scaling (Gemma 3's global layers)
  std::optional<modules::YarnRope> rope_yarn;     // "yarn" scaling (OLMo 3's full layers)
  std::optional<modules::ProportionalRope> rope_proportional;  // "proportional" (Gemma 4's full layers)
  // Gemma 3, OLMo 3: the sliding-window layers' own RoPE (Gemma 3: rope_local_base_freq, unscaled).
  // nullopt: every layer uses the RoPE above.
  std::optional<modules::RopeParams> local_rope;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // the HF key may be an int or a list

  // Sliding-window attention: a query at position i sees keys j with i - window < j <= i, on the
  // layers marked in sliding_layers (one entry a layer; all false without a window).
  std::optional<int64_t> sliding_window;
  std::vector<bool> sliding_layers;  // empty: no layer slides
  // SmolLM3's NoPE layers: queries and keys are not rotated there (one entry a layer; empty: every
  // layer rotates).
  std::vector<bool> nope_layers;
  // Qwen3.5: the layers whose mixer is a Gated DeltaNet (layer_types "linear_attention"; one entry
  // a layer, empty: every layer is attention), and that mixer's sizes.
  std::vector<bool> linear_layers;
  modules::GatedDeltaDims gated_delta;
  // Rotary embeddings turn the first rotary_dim of each head's head_dim (Qwen3.5: a quarter); the
  // rest passes through. 0: all of head_dim.
  int64_t rotary_dim = 0;
  // Qwen3.5: q_proj also yields a per-head gate; attention's output is multiplied by its sigmoid.
  bool attn_output_gate = false;
  // Gemma 4: the full-attention layers' head_dim and key/value heads (0: head_dim,
  // num_key_value_heads); their values are their keys' projection under attention_k_eq_v.
  int64_t global_head_dim = 0, global_kv_heads = 0;
  bool attention_k_eq_v = false;
  // Gemma 4's KV sharing: per layer, the earlier layer whose keys and values it attends over (it
  // has no k/v projections of its own), or -1; empty: no layer shares.
  std::vector<int64_t> kv_source;
  bool double_wide_mlp = false;  // KV-shared layers' MLPs are 2 * intermediate_size wide
  // Gemma 4's per-layer input embeddings (hidden_size_per_layer_input; 0: none) and their table's rows.
  int64_t per_layer_input_dim = 0, per_layer_input_vocab = 0;
  // Qwen3.5: the rope dict's mrope_section (rotary frequencies per position axis: text, height,
  // width). Text positions are the same on every axis, so a text model's RoPE does not depend on it;
  // GGUF writes it (rope.dimension_sections). Empty: the config has none.
  std::vector<int64_t> mrope_section;

  MlpActivation activation = MlpActivation::kSilu;
  bool attention_bias = false;     // q/k/v/o biases (Llama/Qwen3 attention_bias); Qwen2: q/k/v always
  modules::RmsScale norm = modules::RmsScale::kWeight;  // Gemma 2/3: (1 + w) in fp32; Gemma 4: w in fp32
  double embed_scale = 1.0;        // Gemma: sqrt(hidden_size), applied in the compute dtype
  std::optional<double> query_pre_attn_scalar;   // Gemma: attention scale = this^-0.5
  std::optional<double> attn_logit_softcapping;  // Gemma 2: tanh soft-cap of attention logits
  std::optional<double> final_logit_softcapping; // Gemma 2: tanh soft-cap of output logits

  int64_t kv_groups() const { return num_attention_heads / num_key_value_heads; }
  bool is_sliding(int64_t layer) const {
    return !sliding_layers.empty() && sliding_layers.at(static_cast<size_t>(layer));
  }
  bool uses_rope(int64_t layer) const {
    return nope_layers.empty() || !nope_layers.at(static_cast<size_t>(layer));
  }
  bool is_linear(int64_t layer) const {
    return !linear_layers.empty() && linear_layers.at(static_cast<size_t>(layer));
  }
  int64_t rope_dim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  // The full-attention layers' rotary dims (Gemma 4: global_head_dim).
  int64_t global_rope_dim() const { return global_head_dim > 0 ? global_head_dim : rope_dim(); }
  bool is_kv_shared(int64_t layer) const {
    return !kv_source.empty() && kv_source.at(static_cast<size_t>(layer)) >= 0;
  }
  // Whether a later layer attends over this layer's keys and values.
  bool is_kv_source(int64_t layer) const;
  // Layer `layer`'s sizes (Gemma 4's full layers and KV-shared layers differ; others: the globals).
  int64_t layer_head_dim(int64_t layer) const;
  int64_t layer_kv_heads(int64_t layer) const;
  int64_t layer_intermediate(int64_t layer) const;
  modules::RopeParams rope() const {
    return {rope_theta, rope_scaling, rope_linear_factor, rope_yarn, rope_proportional};
  }
  // Throws std::invalid_argument (prefixed with `where`) when sizes are inconsistent.
  void validate(const std::string& where) const;
};

// Parses JSON text; `where` (usually the file path) prefixes every error message.
DecoderConfig parse_llama_config(const std::string& json_text, const std::string& where);
// Reads `path`: a config.json file or a checkpoint directory containing one.
DecoderConfig load_decoder_config(const std::string& path);
// The eos_token_id(s) of `dir`/generation_config.json (what transformers' generate stops at; an
// instruct model lists its end-of-turn there, e.g. Gemma's <end_of_turn>); none without the file.
std::vector<int64_t> load_generation_eos_ids(const std::string& dir);
// "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, gemma3", for messages.
std::string supported_model_types();

}  // namespace qlora::models
