// A decoder-only model's architecture description, parsed from a Hugging Face config.json.
// One struct serves every family we load (all are decoder-only transformers): the family
// (models/family.h; one file each in models/families/) says which model_types it is, its class's
// defaults, which weights exist (architecture.h) and how llama.cpp writes it; the fields below say
// what its compute does differently (the family's file says which it sets and why).
// Keys we do not model are ignored (HF configs carry many training/generation keys); keys we
// model but whose value we cannot honour (another rope type, MLP biases, another activation, a
// vision tower) are errors naming the key, because a silently different model is worse than none.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qlora/models/family.h"
#include "qlora/modules/moe.h"
#include "qlora/modules/options.h"

namespace qlora::models {

using modules::Llama3RopeScaling;

using modules::MlpActivation;

struct DecoderConfig {
  std::string model_type;  // as config.json spells it: "llama", "mistral", "qwen2", ...
  const Family* family = &default_family();
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
  bool v_norm = false;  // Gemma 4: values RMS-normalised (no weight) per head, as keys are by k_norm
  // Gemma 4's KV sharing: per layer, the earlier layer whose keys and values it attends over (it
  // has no k/v projections of its own), or -1; empty: no layer shares.
  std::vector<int64_t> kv_source;
  bool double_wide_mlp = false;  // KV-shared layers' MLPs are 2 * intermediate_size wide
  // Gemma 4's per-layer input embeddings (hidden_size_per_layer_input; 0: none) and their table's rows.
  int64_t per_layer_input_dim = 0, per_layer_input_vocab = 0;
  // Images (models/multimodal.h): which layers let an image's tokens attend to all of that image's
  // tokens (the text stays causal): Gemma 3 on every layer, Gemma 4 on its sliding layers under
  // use_bidirectional_attention "vision"; and the token image tokens are embedded as before their
  // features replace them (Gemma 4's per-layer inputs read it: its pad_token_id; -1: their own id).
  enum class ImageAttention { kCausal, kAllLayers, kSlidingLayers };
  ImageAttention image_attention = ImageAttention::kCausal;
  int64_t image_pad_token_id = -1;
  // A multimodal checkpoint's image token (config image_token_id / image_token_index; -1: none) and its
  // tower's spatial merge (vision_config.spatial_merge_size: Qwen3.5's M-RoPE grid is the merged one).
  int64_t image_token_id = -1, image_spatial_merge = 1;
  // Qwen3.5: the rope dict's mrope_section (rotary frequencies per position axis: temporal, height,
  // width; [11, 11, 10] where the config has none, as transformers). Text positions are the same on
  // every axis, so text alone does not depend on it; image tokens do (modules::mrope_tables). GGUF
  // writes it (rope.dimension_sections). Empty: not Qwen3.5.
  std::vector<int64_t> mrope_section;

  // Mixture-of-Experts (Qwen3-MoE, Mixtral): the router's settings and an expert's width, and the
  // layers whose feed-forward is the MoE (one entry a layer; empty: none, every layer is dense).
  modules::MoeDims moe;
  std::vector<bool> moe_layers;
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
  bool is_moe(int64_t layer) const {
    return !moe_layers.empty() && moe_layers.at(static_cast<size_t>(layer));
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
DecoderConfig parse_decoder_config(const std::string& json_text, const std::string& where);
// Reads `path`: a config.json file or a checkpoint directory containing one.
DecoderConfig load_decoder_config(const std::string& path);
// The eos_token_id(s) of `dir`/generation_config.json (what transformers' generate stops at; an
// instruct model lists its end-of-turn there, e.g. Gemma's <end_of_turn>); none without the file.
std::vector<int64_t> load_generation_eos_ids(const std::string& dir);
// Every model_type the families read, then the multimodal ones ("llama, mistral, qwen2, ..."), for messages.
std::string supported_model_types();

}  // namespace qlora::models
