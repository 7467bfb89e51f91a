// Qwen3.5-MoE (qwen3_5_moe_text: Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's Gated DeltaNet
// hybrid (qwen3_5.cpp: layer types, attention, DeltaNet, norms) with a Mixture of Experts in every
// layer: a router over num_experts experts of moe_intermediate_size, softmax in fp32 over all of
// them, the top num_experts_per_tok always renormalised and cast to the compute dtype; beside it a
// shared expert every token takes, a gated MLP of shared_expert_intermediate_size
// (mlp.shared_expert.{gate,up,down}_proj, held as DecoderConfig::intermediate_size: there is no
// other dense MLP) scaled by sigmoid(mlp.shared_expert_gate(x)), added to the routed experts' sum.
// No router auxiliary loss (its class adds one only under output_router_logits). qwen3_5_moe is the
// Hub's form (Qwen3_5MoeForConditionalGeneration): this language model beside a vision tower (copied,
// never computed), as qwen3_5's. The MTP block (mtp.*) is copied into merged exports, never computed.
// llama.cpp's "qwen35moe": qwen35's tensors and keys with the router as ffn_gate_inp, the experts
// stacked into ffn_{gate,up,down}_exps, the shared expert as ffn_{gate,up,down}_shexp and its gate as
// ffn_gate_inp_shexp, their widths as expert_feed_forward_length and expert_shared_feed_forward_length.
#include <nlohmann/json.hpp>

#include <regex>

#include "qlora/models/config_json.h"
#include "qlora/models/families/blocks.h"
#include "qlora/models/families/qwen3_5.h"
#include "qlora/models/family.h"
#include "qlora/models/vision/tower.h"

namespace qlora::models {
namespace {

using modules::DecoderLayer;

const Architecture& qwen3_5_moe_architecture() {
  static const Architecture a = [] {
    const auto shared = [](const char* short_name, const char* peft, const char* module,
                           modules::LoraLinear DecoderLayer::*member, Dim out, Dim in) {
      return ProjectionRow{short_name, peft,        module,      member, out, in, {}, Bias::kNone,
                           Mixer::kAny, "shared_expert"};
    };
    const std::vector<ProjectionRow> ffn = {
        shared("shared_gate", "shared_expert.gate_proj", "model.layers.{i}.mlp.shared_expert.gate_proj",
               &DecoderLayer::shared_gate_proj, Dim::kIntermediate, Dim::kHidden),
        shared("shared_up", "shared_expert.up_proj", "model.layers.{i}.mlp.shared_expert.up_proj",
               &DecoderLayer::shared_up_proj, Dim::kIntermediate, Dim::kHidden),
        shared("shared_down", "shared_expert.down_proj", "model.layers.{i}.mlp.shared_expert.down_proj",
               &DecoderLayer::shared_down_proj, Dim::kHidden, Dim::kIntermediate)};
    std::vector<NormRow> norms = families::qwen35_norms();
    norms.push_back({"mlp.shared_expert_gate", "model.layers.{i}.mlp.shared_expert_gate",
                     &DecoderLayer::shared_expert_gate, Dim::kOne, Mixer::kAny, false, 2, {Dim::kHidden, Dim::kOne}});
    Architecture a = families::make_architecture("qwen3_5_moe", families::qwen35_rows(ffn), norms);
    a.experts = ExpertsRow{"model.layers.{i}.mlp.gate", "model.layers.{i}.mlp.experts", "gate_proj", "up_proj",
                           "down_proj", "model.layers.{i}.mlp.gate", "model.layers.{i}.mlp.experts"};
    return a;
  }();
  return a;
}

void parse_qwen3_5_moe(const nlohmann::json& j, const std::string& where, DecoderConfig& c) {
  families::parse_qwen35(j, where, c);
  families::parse_moe(j, where, c, "num_experts", 256, 8, "moe_intermediate_size");
  c.moe.norm_topk_prob = true;  // the class always renormalises (it has no norm_topk_prob key)
}

void add_qwen3_5_moe_gguf(const DecoderConfig& c, const std::string& where, GgufAdditions& out) {
  families::add_qwen35_keys(c, where, out);
  out.keys.emplace_back("expert_feed_forward_length", static_cast<uint32_t>(c.moe.inter));
  out.keys.emplace_back("expert_shared_feed_forward_length", static_cast<uint32_t>(c.intermediate_size));
}

// The shared expert's gate [1, hidden] as llama.cpp's qwen35moe loads it: ffn_gate_inp_shexp [hidden].
std::optional<TensorPlan> qwen3_5_moe_tensor(const std::string& hf, const DecoderConfig& c) {
  static const std::regex gate(R"(model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight)");
  std::smatch m;
  if (!std::regex_match(hf, m, gate)) return families::qwen35_tensor(hf, c);
  TensorPlan t{"blk." + m[1].str() + ".ffn_gate_inp_shexp.weight"};
  t.squeeze = true;
  return t;
}

}  // namespace

const Family& qwen3_5_moe_family() {
  static const Family f = [] {
    Family f;
    families::qwen35_family_base(f);
    f.name = "qwen3_5_moe";
    f.model_types = {"qwen3_5_moe_text"};
    f.architecture = qwen3_5_moe_architecture;
    f.multimodal = Family::Multimodal{"qwen3_5_moe",
                                      R"({"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                                          "num_attention_heads": 16, "num_key_value_heads": 2,
                                          "max_position_embeddings": 32768})",
                                      false, false, /*image_token_id=*/248056, /*spatial_merge=*/2};
    f.parse = parse_qwen3_5_moe;
    f.intermediate_key = "shared_expert_intermediate_size";
    f.intermediate_default = 512;
    f.gguf.arch = "qwen35moe";
    f.gguf.tensors.insert(f.gguf.tensors.end(), {{"mlp.shared_expert.gate_proj", "ffn_gate_shexp"},
                                                 {"mlp.shared_expert.up_proj", "ffn_up_shexp"},
                                                 {"mlp.shared_expert.down_proj", "ffn_down_shexp"}});
    f.gguf.add = add_qwen3_5_moe_gguf;
    f.gguf.tensor = qwen3_5_moe_tensor;
    f.vision_tower = vision::load_qwen3_5_tower;  // Qwen3_5MoeVisionModel: Qwen3.5's tower
    return f;
  }();
  return f;
}

}  // namespace qlora::models
