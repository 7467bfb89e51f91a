// Mixtral (8x7B, 8x22B): Mistral's attention with a Mixture of Experts in every layer: a router over
// num_local_experts experts of intermediate_size, softmax in fp32, the top num_experts_per_tok always
// renormalised, the weights kept in fp32 (its class never casts them back). The Hub's checkpoints
// hold each expert as block_sparse_moe.experts.<e>.w1 (gate), w3 (up), w2 (down) beside
// block_sparse_moe.gate (transformers 5 fuses them into mlp.experts on load, and writes them back so).
// router_jitter_noise (training-time input noise) is refused: no checkpoint ships with it.
// llama.cpp reads Mixtral as its "llama" architecture with expert_count > 0: Mistral's tensors, the
// router as ffn_gate_inp, the experts stacked into ffn_{gate,up,down}_exps (gguf/arch.h,
// expert_tensors), feed_forward_length the experts' width; every layer MoE, the top k renormalised,
// as Mixtral's class computes them.
#include <nlohmann/json.hpp>

#include "qlora/models/config_json.h"
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

const Architecture& mixtral_architecture() {
  static const Architecture a = [] {
    std::vector<ProjectionRow> rows;
    for (const ProjectionRow& row : families::dense_mlp_rows(families::llama_rows()))
      if (row.mixer != Mixer::kDenseMlp) rows.push_back(row);  // every layer is MoE
    Architecture a = families::make_architecture("mixtral", rows, {families::kInputNorm, families::kPostAttnNorm});
    a.experts = ExpertsRow{"model.layers.{i}.block_sparse_moe.gate", "model.layers.{i}.block_sparse_moe.experts",
                           "w1", "w3", "w2", "model.layers.{i}.mlp.gate", "model.layers.{i}.mlp.experts"};
    return a;
  }();
  return a;
}

void parse_mixtral(const nlohmann::json& j, const std::string& where, DecoderConfig& c) {
  families::parse_moe(j, where, c, "num_local_experts", 8, 2, "intermediate_size");
  c.moe.norm_topk_prob = true;
  c.moe.fp32_weights = true;
  if (cfg::get_num(j, "router_jitter_noise", where, 0.0) != 0.0)
    cfg::fail(where, "router_jitter_noise", "must be 0: qlora does not add noise to the router's input");
}

}  // namespace

const Family& mixtral_family() {
  static const Family f = [] {
    Family f;
    f.name = "mixtral";
    f.model_types = {"mixtral"};
    f.architecture = mixtral_architecture;
    f.rms_norm_eps = 1e-5;
    f.rope_theta = 1e6;
    f.parse = parse_mixtral;
    f.gguf.arch = "llama";
    f.gguf.tensors = families::llama_tensor_names();
    f.gguf.permute_qk = true;
    f.gguf.window_as_context = true;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
