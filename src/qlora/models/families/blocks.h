// What several families' files share: Llama's block as architecture rows (most families are it,
// with other norms), the norm rows, llama.cpp's names for that block's tensors, and the check of a
// sliding-layer pattern llama.cpp fixes.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "qlora/models/architecture.h"
#include "qlora/models/decoder_config.h"

namespace qlora::models::families {

// Llama's q, k, v, o, gate, up, down and output rows; `attn_bias` is the bias rule of q/k/v
// (o_proj's: `o_bias`).
std::vector<ProjectionRow> llama_rows(Bias attn_bias, Bias o_bias);
// llama_rows with attention biases under the config's attention_bias key.
std::vector<ProjectionRow> llama_rows();

constexpr NormRow kInputNorm{"input_layernorm", "model.layers.{i}.input_layernorm", &modules::DecoderLayer::input_layernorm};
constexpr NormRow kPostAttnNorm{"post_attention_layernorm", "model.layers.{i}.post_attention_layernorm",
                                &modules::DecoderLayer::post_attention_layernorm};
constexpr NormRow kPreFfnNorm{"pre_feedforward_layernorm", "model.layers.{i}.pre_feedforward_layernorm",
                              &modules::DecoderLayer::pre_feedforward_layernorm};
constexpr NormRow kPostFfnNorm{"post_feedforward_layernorm", "model.layers.{i}.post_feedforward_layernorm",
                               &modules::DecoderLayer::post_feedforward_layernorm};
// Per-head q/k norms (Qwen3, Gemma 3/4, Qwen3.5).
constexpr NormRow kQNorm{"q_norm", "model.layers.{i}.self_attn.q_norm", &modules::DecoderLayer::q_norm, Dim::kHeadDim};
constexpr NormRow kKNorm{"k_norm", "model.layers.{i}.self_attn.k_norm", &modules::DecoderLayer::k_norm, Dim::kHeadDim};

// The rows with the gated MLP's (gate, up, down) held only by dense layers (Mixer::kDenseMlp): a
// MoE family whose MoE replaces the MLP on the layers DecoderConfig::is_moe names.
std::vector<ProjectionRow> dense_mlp_rows(std::vector<ProjectionRow> rows);

// A MoE config's router and layers (DecoderConfig::moe, moe_layers): the expert count from
// `experts_key` (or its alias: num_experts and num_local_experts are one setting in transformers),
// top_k from num_experts_per_tok, the experts' width from `inter_key`; every layer is MoE unless `is_moe` says otherwise.
// Refuses top_k outside [1, experts] and a width of 0, naming the key.
// `top_k_key`: the top-k's key where a family names it otherwise (Gemma 4: top_k_experts).
void parse_moe(const nlohmann::json& j, const std::string& where, DecoderConfig& c, const char* experts_key,
               int64_t experts_default, int64_t top_k_default, const char* inter_key,
               const char* top_k_key = "num_experts_per_tok");

// An architecture with the usual embedding and final norm keys.
Architecture make_architecture(const char* family, std::vector<ProjectionRow> rows, std::vector<NormRow> norms);

using TensorNames = std::vector<std::pair<const char*, const char*>>;
// llama.cpp's names for Llama's block: attn_q ... ffn_down, attn_norm, and the post-attention norm
// as ffn_norm.
TensorNames llama_tensor_names();
// The same block with the post-attention norm closing the attention branch (post_attention_norm),
// as Gemma, OLMo and Qwen3.5 have it; with q/k norms (attn_q_norm, attn_k_norm) when `qk_norms`.
TensorNames post_norm_tensor_names(bool qk_norms);
// Gemma's four norms a block: post-attention, pre- and post-feed-forward; q/k norms when `qk_norms`.
TensorNames gemma_tensor_names(bool qk_norms);

// Qwen's and SmolLM3's classes, under use_sliding_window: the layers from max_window_layers on.
bool qwen_slides(const nlohmann::json& config, const std::string& where, int64_t layer);

// Which layers llama.cpp slides on, for the architectures that fix it (gemma2: even layers; gemma3:
// five of every six; OLMo 3: three of four); "" when the config's layers are those.
std::string sliding_mismatch(const DecoderConfig& c, int64_t period);

}  // namespace qlora::models::families
