// Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norms) with a Mixture of Experts as
// the feed-forward: a router over num_experts experts of moe_intermediate_size, softmax in fp32 over
// all of them, the top num_experts_per_tok, renormalised only under norm_topk_prob, cast to the
// compute dtype. A layer is MoE unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0;
// the others keep a dense MLP of intermediate_size. No router auxiliary loss (its class adds one only
// under output_router_logits).
// llama.cpp's "qwen3moe": Qwen3's tensors with the router as ffn_gate_inp and the experts stacked
// into ffn_{gate,up,down}_exps (gguf/arch.h, expert_tensors), their width as expert_feed_forward_length.
// Its graph makes every layer MoE and always renormalises the top k (build_moe_ffn's norm_w is true;
// no key says otherwise): a config with dense layers or norm_topk_prob false is refused.
#include <nlohmann/json.hpp>

#include "qlora/models/config_json.h"
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

const Architecture& qwen3_moe_architecture() {
  static const Architecture a = [] {
    Architecture a = families::make_architecture(
        "qwen3_moe", families::dense_mlp_rows(families::llama_rows()),
        {families::kInputNorm, families::kPostAttnNorm, families::kQNorm, families::kKNorm});
    a.experts = ExpertsRow{"model.layers.{i}.mlp.gate", "model.layers.{i}.mlp.experts", "gate_proj", "up_proj",
                           "down_proj", "model.layers.{i}.mlp.gate", "model.layers.{i}.mlp.experts"};
    return a;
  }();
  return a;
}

void parse_qwen3_moe(const nlohmann::json& j, const std::string& where, DecoderConfig& c) {
  families::parse_moe(j, where, c, "num_experts", 128, 8, "moe_intermediate_size");
  c.moe.norm_topk_prob = cfg::get_bool(j, "norm_topk_prob", where, false);
  const int64_t step = cfg::get_int(j, "decoder_sparse_step", where, 1);
  if (step < 1) cfg::fail(where, "decoder_sparse_step", "must be at least 1, got " + std::to_string(step));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.moe_layers[static_cast<size_t>(i)] = (i + 1) % step == 0;
  if (cfg::present(j, "mlp_only_layers")) {
    const nlohmann::json& dense = j.at("mlp_only_layers");
    if (!dense.is_array()) cfg::fail(where, "mlp_only_layers", "expected a list of layer indices");
    for (const nlohmann::json& v : dense) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_hidden_layers)
        cfg::fail(where, "mlp_only_layers",
                  "expected layer indices in 0.." + std::to_string(c.num_hidden_layers - 1) + ", got " + v.dump());
      c.moe_layers[v.get<size_t>()] = false;
    }
  }
}

// What llama.cpp's qwen3moe fixes: every layer MoE, the top-k weights renormalised.
void check_qwen3_moe_gguf(const DecoderConfig& c, const std::string& where) {
  if (!c.moe.norm_topk_prob)
    refuse_gguf(where, c, "norm_topk_prob",
                "false: llama.cpp's qwen3moe always renormalises the top num_experts_per_tok routing weights to sum "
                "to 1 (it reads no key for it)");
  std::vector<int64_t> dense;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (!c.is_moe(i)) dense.push_back(i);
  if (dense.empty()) return;
  // decoder_sparse_step s > 1 leaves exactly the layers with (i + 1) % s != 0 dense; the first MoE layer is s - 1.
  int64_t step = 0;
  for (int64_t i = 0; i < c.num_hidden_layers && step == 0; ++i)
    if (c.is_moe(i)) step = i + 1;
  bool by_step = step > 1;
  for (int64_t i = 0; i < c.num_hidden_layers && by_step; ++i) by_step = c.is_moe(i) == ((i + 1) % step == 0);
  refuse_gguf(where, c, by_step ? "decoder_sparse_step" : "mlp_only_layers",
              "layer " + std::to_string(dense.front()) + " has a dense MLP where llama.cpp's qwen3moe makes every "
              "layer a Mixture of Experts (it has no dense-layer tensors for this architecture)");
}

void add_qwen3_moe_gguf(const DecoderConfig& c, const std::string&, GgufAdditions& out) {
  out.keys.emplace_back("expert_feed_forward_length", static_cast<uint32_t>(c.moe.inter));
}

}  // namespace

const Family& qwen3_moe_family() {
  static const Family f = [] {
    Family f;
    f.name = "qwen3_moe";
    f.model_types = {"qwen3_moe"};
    f.architecture = qwen3_moe_architecture;
    f.sliding_needs_flag = true;
    f.slides = families::qwen_slides;
    f.parse = parse_qwen3_moe;
    f.gguf.arch = "qwen3moe";
    f.gguf.tensors = families::llama_tensor_names();
    f.gguf.tensors.insert(f.gguf.tensors.end(),
                          {{"self_attn.q_norm", "attn_q_norm"}, {"self_attn.k_norm", "attn_k_norm"}});
    f.gguf.window_refused = true;
    f.gguf.check = check_qwen3_moe_gguf;
    f.gguf.add = add_qwen3_moe_gguf;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
