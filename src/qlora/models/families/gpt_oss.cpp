// gpt-oss (gpt-oss-20b, 120b): a Mixture of Experts in every layer, beside attention with q/k/v/o
// biases and a learned sink logit per head (self_attn.sinks: one more entry in each row's softmax,
// attending to nothing), alternating sliding-window (even layers, window 128) and full layers, YaRN on
// every layer (the class's default: factor 32 over 4096 positions, truncate false, base 150000), and
// RMSNorms whose fp32 weight multiplies the fp32 normed row (transformers keeps them in fp32).
// The router has a bias: the top num_experts_per_tok of its logits, softmax over those k in the logits'
// dtype. The experts (num_local_experts of intermediate_size) have biases and a clamped SwiGLU: gate
// capped above at swiglu_limit, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(1.702 gate).
// Its module holds the experts transposed, gate and up interleaved (architecture.h, ExpertsRow);
// qlora loads them into its own layout and writes them back in gpt-oss's.
// llama.cpp's "gpt-oss" computes all of it, with the activation's constants fixed (alpha 1.702, limit
// 7) and YaRN's ramp rounded to whole dimensions (a note says so where truncate is false).
#include <nlohmann/json.hpp>

#include <cmath>

#include "qlora/models/config_json.h"
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

using modules::DecoderLayer;

constexpr NormRow kSinks{"sinks", "model.layers.{i}.self_attn.sinks", &DecoderLayer::sinks, Dim::kHeads,
                         Mixer::kAttention, /*bare=*/true};

const Architecture& gpt_oss_architecture() {
  static const Architecture a = [] {
    std::vector<ProjectionRow> rows;
    for (const ProjectionRow& row : families::dense_mlp_rows(families::llama_rows()))
      if (row.mixer != Mixer::kDenseMlp) rows.push_back(row);  // every layer is MoE
    Architecture a =
        families::make_architecture("gpt_oss", rows, {families::kInputNorm, families::kPostAttnNorm, kSinks});
    ExpertsRow e{"model.layers.{i}.mlp.router", "model.layers.{i}.mlp.experts", "gate_proj", "up_proj",
                 "down_proj", "model.layers.{i}.mlp.router", "model.layers.{i}.mlp.experts"};
    e.transposed_interleaved = true;
    e.biases = true;
    a.experts = e;
    return a;
  }();
  return a;
}

// The class's layer_types when config.json has none: sliding on even layers.
bool gpt_oss_slides(const nlohmann::json&, const std::string&, int64_t layer) { return layer % 2 == 0; }

void parse_gpt_oss(const nlohmann::json& j, const std::string& where, DecoderConfig& c) {
  families::parse_moe(j, where, c, "num_local_experts", 128, 4, "intermediate_size");
  c.moe.softmax_after_topk = true;
  c.moe.activation = modules::ExpertActivation::kClampedSwiglu;
  c.moe.swiglu_alpha = cfg::get_num(j, "swiglu_alpha", where, 1.702);
  c.moe.swiglu_limit = cfg::get_num(j, "swiglu_limit", where, 7.0);
  if (!(c.moe.swiglu_limit > 0)) cfg::fail(where, "swiglu_limit", "must be positive");
  c.attention_bias = cfg::get_bool(j, "attention_bias", where, true);  // the class's default
  c.norm = modules::RmsScale::kWeightFp32;
  if (!cfg::present(j, "rope_parameters") && !cfg::present(j, "rope_scaling")) {  // the class's default RoPE
    modules::YarnRope y;
    y.factor = 32.0;
    y.attention_factor = 0.1 * std::log(32.0) + 1.0;
    y.original_max_position_embeddings = 4096;
    y.truncate = false;
    c.rope_yarn = y;
  }
}

// What llama.cpp's gpt-oss fixes: the activation's constants (build_moe_ffn's swiglu_oai: alpha 1.702,
// limit 7), a window on the even layers (attention.sliding_window_pattern 2).
void check_gpt_oss_gguf(const DecoderConfig& c, const std::string& where) {
  if (c.moe.swiglu_alpha != 1.702 || c.moe.swiglu_limit != 7.0)
    refuse_gguf(where, c, c.moe.swiglu_limit != 7.0 ? "swiglu_limit" : "swiglu_alpha",
                "llama.cpp's gpt-oss clamps at 7 with alpha 1.702 whatever the file says");
  if (!c.sliding_window) refuse_gguf(where, c, "sliding_window", "null: llama.cpp's gpt-oss reads a window");
  const std::string pattern = families::sliding_mismatch(c, 2);
  if (!pattern.empty()) refuse_gguf(where, c, "layer_types", pattern);
}

void add_gpt_oss_gguf(const DecoderConfig& c, const std::string&, GgufAdditions& out) {
  out.keys.emplace_back("expert_feed_forward_length", static_cast<uint32_t>(c.moe.inter));
}

// The tensors no row names: the sinks ([heads], a parameter without .weight) and the router's bias.
std::optional<TensorPlan> gpt_oss_tensor(const std::string& hf, const DecoderConfig& c) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string blk = "blk." + std::to_string(i) + ".";
    if (hf == hf_module(kSinks.hf_module, i)) return TensorPlan{blk + "attn_sinks.weight"};
    if (hf == hf_module(gpt_oss_architecture().experts->fused_router, i) + ".bias")
      return TensorPlan{blk + "ffn_gate_inp.bias"};
  }
  return std::nullopt;
}

}  // namespace

const Family& gpt_oss_family() {
  static const Family f = [] {
    Family f;
    f.name = "gpt_oss";
    f.model_types = {"gpt_oss"};
    f.architecture = gpt_oss_architecture;
    f.rms_norm_eps = 1e-5;
    f.rope_theta = 150000.0;
    f.sliding_window = 128;
    f.slides = gpt_oss_slides;
    f.parse = parse_gpt_oss;
    // llama.cpp's "gpt-oss": the router as ffn_gate_inp (with its bias), the experts split into
    // ffn_{gate,up,down}_exps with their biases (gguf/arch.h, expert_tensors), the sinks as attn_sinks.
    f.gguf.arch = "gpt-oss";
    f.gguf.tensors = {{"self_attn.q_proj", "attn_q"},       {"self_attn.k_proj", "attn_k"},
                      {"self_attn.v_proj", "attn_v"},       {"self_attn.o_proj", "attn_output"},
                      {"input_layernorm", "attn_norm"},     {"post_attention_layernorm", "post_attention_norm"}};
    f.gguf.attn_bias = true;
    f.gguf.window_key = true;
    f.gguf.yarn_rope = true;
    f.gguf.yarn_untruncated_note = true;
    f.gguf.check = check_gpt_oss_gguf;
    f.gguf.add = add_gpt_oss_gguf;
    f.gguf.tensor = gpt_oss_tensor;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
