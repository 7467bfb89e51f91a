#include "qlora/models/families/blocks.h"

#include <stdexcept>

#include "qlora/models/config_json.h"
#include "qlora/models/family.h"

namespace qlora::models::families {

using modules::DecoderLayer;

std::vector<ProjectionRow> llama_rows(Bias attn_bias, Bias o_bias) {
  return {
      {"q", "q_proj", "model.layers.{i}.self_attn.q_proj", &DecoderLayer::q_proj, Dim::kQHeads, Dim::kHidden, {},
       attn_bias},
      {"k", "k_proj", "model.layers.{i}.self_attn.k_proj", &DecoderLayer::k_proj, Dim::kKvHeads, Dim::kHidden, {},
       attn_bias},
      {"v", "v_proj", "model.layers.{i}.self_attn.v_proj", &DecoderLayer::v_proj, Dim::kKvHeads, Dim::kHidden, {},
       attn_bias},
      {"o", "o_proj", "model.layers.{i}.self_attn.o_proj", &DecoderLayer::o_proj, Dim::kHidden, Dim::kQHeads, {},
       o_bias},
      {"gate", "gate_proj", "model.layers.{i}.mlp.gate_proj", &DecoderLayer::gate_proj, Dim::kIntermediate,
       Dim::kHidden, {}},
      {"up", "up_proj", "model.layers.{i}.mlp.up_proj", &DecoderLayer::up_proj, Dim::kIntermediate, Dim::kHidden, {}},
      {"down", "down_proj", "model.layers.{i}.mlp.down_proj", &DecoderLayer::down_proj, Dim::kHidden,
       Dim::kIntermediate, {}},
      {"output", "lm_head", "lm_head", nullptr, Dim::kVocab, Dim::kHidden, {}},
  };
}

std::vector<ProjectionRow> llama_rows() { return llama_rows(Bias::kIfAttentionBias, Bias::kIfAttentionBias); }

std::vector<ProjectionRow> dense_mlp_rows(std::vector<ProjectionRow> rows) {
  for (ProjectionRow& row : rows) {
    if (row.member == &DecoderLayer::gate_proj || row.member == &DecoderLayer::up_proj ||
        row.member == &DecoderLayer::down_proj)
      row.mixer = Mixer::kDenseMlp;
  }
  return rows;
}

void parse_moe(const nlohmann::json& j, const std::string& where, DecoderConfig& c, const char* experts_key,
               int64_t experts_default, int64_t top_k_default, const char* inter_key, const char* top_k_key) {
  modules::MoeDims& m = c.moe;
  // transformers maps num_experts and num_local_experts onto each other (attribute_map) and writes
  // either: Qwen3-MoE's config.json as saved by transformers 5 says num_local_experts.
  const char* alias = std::string(experts_key) == "num_experts" ? "num_local_experts" : "num_experts";
  if (!cfg::present(j, experts_key) && cfg::present(j, alias)) experts_key = alias;
  m.num_experts = cfg::get_int(j, experts_key, where, experts_default);
  m.top_k = cfg::get_int(j, top_k_key, where, top_k_default);
  m.inter = cfg::get_int(j, inter_key, where);
  if (m.num_experts < 1) cfg::fail(where, experts_key, "must be at least 1, got " + std::to_string(m.num_experts));
  if (m.top_k < 1 || m.top_k > m.num_experts)
    cfg::fail(where, top_k_key,
              "asks for " + std::to_string(m.top_k) + " experts per token of " + std::to_string(m.num_experts) +
                  " (" + experts_key + "); expected 1.." + std::to_string(m.num_experts));
  if (m.inter < 1) cfg::fail(where, inter_key, "must be at least 1, got " + std::to_string(m.inter));
  c.moe_layers.assign(static_cast<size_t>(c.num_hidden_layers), true);
}

Architecture make_architecture(const char* family, std::vector<ProjectionRow> rows, std::vector<NormRow> norms) {
  return {family, std::move(rows), std::move(norms), "model.embed_tokens.weight", "model.norm.weight"};
}

TensorNames llama_tensor_names() {
  return {{"self_attn.q_proj", "attn_q"},     {"self_attn.k_proj", "attn_k"}, {"self_attn.v_proj", "attn_v"},
          {"self_attn.o_proj", "attn_output"}, {"mlp.gate_proj", "ffn_gate"},  {"mlp.up_proj", "ffn_up"},
          {"mlp.down_proj", "ffn_down"},       {"input_layernorm", "attn_norm"}, {"post_attention_layernorm", "ffn_norm"}};
}

TensorNames post_norm_tensor_names(bool qk_norms) {
  TensorNames t = llama_tensor_names();
  t.back().second = "post_attention_norm";
  if (qk_norms) t.insert(t.end(), {{"self_attn.q_norm", "attn_q_norm"}, {"self_attn.k_norm", "attn_k_norm"}});
  return t;
}

TensorNames gemma_tensor_names(bool qk_norms) {
  TensorNames t = post_norm_tensor_names(qk_norms);
  t.insert(t.end(), {{"pre_feedforward_layernorm", "ffn_norm"}, {"post_feedforward_layernorm", "post_ffw_norm"}});
  return t;
}

bool qwen_slides(const nlohmann::json& j, const std::string& where, int64_t layer) {
  return layer >= cfg::get_int(j, "max_window_layers", where, 0);
}

std::string sliding_mismatch(const DecoderConfig& c, int64_t period) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.is_sliding(i) != (i % period < period - 1))
      return "layer " + std::to_string(i) + " is " + (c.is_sliding(i) ? "sliding" : "full") +
             " attention where llama.cpp makes every layer i with i % " + std::to_string(period) + " < " +
             std::to_string(period - 1) + " sliding and the others full";
  }
  return "";
}

}  // namespace qlora::models::families

namespace qlora::models {

void refuse_gguf(const std::string& where, const DecoderConfig& c, const std::string& key, const std::string& why) {
  throw std::invalid_argument(where + ": config key '" + key + "': " + why + "; llama.cpp's " + c.family->gguf.arch +
                              " architecture would compute a different model, so no GGUF is written");
}

}  // namespace qlora::models
