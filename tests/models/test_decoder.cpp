// Tests for the Llama config parser and the model: loading tests/data/tiny_llama, NF4 vs full
// precision, KV cache, activation checkpointing, LoRA parameter names.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/safetensors.h"
#include "qlora/models/decoder.h"
#include "qlora/models/decoder_config.h"
#include "qlora/models/key_layout.h"
#include "fixtures.h"

using namespace qlora;
using namespace qlora::models;
namespace fs = std::filesystem;

namespace {

using qlora::models::test_fixtures::error_of;
using qlora::models::test_fixtures::max_abs;
using qlora::models::test_fixtures::tiny_llama;

at::Tensor tokens() {  // [2, 7]
  return at::tensor({1, 17, 200, 3, 45, 99, 255, 7, 8, 9, 10, 11, 12, 13}, at::kLong).view({2, 7});
}

// Fixed nonzero lora_B (they start at zero), so gradients reach every lora_A.
void randomize_lora_b(const DecoderModel& m) {
  at::NoGradGuard ng;
  uint64_t s = 5;
  for (auto& [name, t] : m.lora_parameters())
    if (name.find("lora_B") != std::string::npos)
      t.copy_(at::randn(t.sizes(), at::make_generator<at::CPUGeneratorImpl>(s++)) * 0.05);
}

}  // namespace

TEST(DecoderConfig, Llama2Defaults) {
  DecoderConfig c = parse_decoder_config(R"({"model_type":"llama","hidden_size":4096,"intermediate_size":11008,
    "num_hidden_layers":32,"num_attention_heads":32,"vocab_size":32000,"rms_norm_eps":1e-5,
    "bos_token_id":1,"eos_token_id":2,"torch_dtype":"float16","architectures":["LlamaForCausalLM"],
    "pretraining_tp":1,"rope_scaling":null})", "cfg.json");
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({2}));
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.sliding_window.has_value());
}

TEST(DecoderConfig, Llama31OldAndNewRopeFormats) {
  const std::string common = R"("model_type":"llama","hidden_size":4096,"intermediate_size":14336,
    "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,
    "max_position_embeddings":131072,"eos_token_id":[128001,128008,128009],"bos_token_id":128000,)";
  DecoderConfig old_fmt = parse_decoder_config("{" + common + R"("rope_theta":500000.0,
    "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
    "original_max_position_embeddings":8192,"rope_type":"llama3"}})", "cfg.json");
  DecoderConfig new_fmt = parse_decoder_config("{" + common + R"("rope_parameters":{"rope_theta":500000.0,
    "factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
    "original_max_position_embeddings":8192,"rope_type":"llama3"}})", "cfg.json");
  for (const DecoderConfig& c : {old_fmt, new_fmt}) {
    EXPECT_EQ(c.kv_groups(), 4);
    EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
    ASSERT_TRUE(c.rope_scaling.has_value());
    EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 8.0);
    EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 8192);
    EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({128001, 128008, 128009}));
  }
}

TEST(DecoderConfig, MistralSlidingWindow) {
  DecoderConfig c = parse_decoder_config(R"({"model_type":"mistral","hidden_size":4096,"intermediate_size":14336,
    "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":32000,
    "rope_theta":10000.0,"sliding_window":4096,"head_dim":null})", "cfg.json");
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.head_dim, 128);
}

TEST(DecoderConfig, MixtureOfExpertsLayersAndRouter) {
  const std::string qwen = R"("model_type":"qwen3_moe","hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":10,"moe_intermediate_size":32)";
  // transformers writes the expert count as num_local_experts (Qwen3-MoE's attribute_map).
  DecoderConfig c = parse_decoder_config("{" + qwen + R"(,"num_local_experts":6,"num_experts_per_tok":2,
    "decoder_sparse_step":2,"mlp_only_layers":[3]})", "cfg.json");
  EXPECT_EQ(c.moe.num_experts, 6);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.inter, 32);
  EXPECT_FALSE(c.moe.norm_topk_prob);  // the class default
  EXPECT_FALSE(c.moe.fp32_weights);
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, true, false, false}));  // (i + 1) % 2 == 0, less layer 3
  c = parse_decoder_config("{" + qwen + R"(,"num_experts":16,"norm_topk_prob":true})", "cfg.json");
  EXPECT_EQ(c.moe.num_experts, 16);
  EXPECT_EQ(c.moe.top_k, 8);  // Qwen3MoeConfig's default
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{true, true, true, true}));
  DecoderConfig m = parse_decoder_config(R"({"model_type":"mixtral","hidden_size":64,"intermediate_size":32,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":10})", "cfg.json");
  EXPECT_EQ(m.moe.num_experts, 8);  // MixtralConfig's defaults
  EXPECT_EQ(m.moe.top_k, 2);
  EXPECT_EQ(m.moe.inter, 32);
  EXPECT_TRUE(m.moe.norm_topk_prob);
  EXPECT_TRUE(m.moe.fp32_weights);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-5);
  EXPECT_EQ(m.moe_layers, (std::vector<bool>{true, true}));
}

TEST(DecoderConfig, MixtureOfExpertsErrorsNameTheKey) {
  const std::string qwen = R"("model_type":"qwen3_moe","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
    "num_attention_heads":4,"vocab_size":10,"moe_intermediate_size":32,"num_experts":4)";
  std::string e = error_of("{" + qwen + "}");  // the class's 8 a token
  EXPECT_NE(e.find("8 experts per token of 4"), std::string::npos) << e;
  e = error_of("{" + qwen + R"(,"num_experts_per_tok":5})");
  EXPECT_NE(e.find("num_experts_per_tok"), std::string::npos) << e;
  EXPECT_NE(e.find("5 experts per token of 4"), std::string::npos) << e;
  e = error_of("{" + qwen + R"(,"num_experts_per_tok":2,"mlp_only_layers":[2]})");
  EXPECT_NE(e.find("mlp_only_layers"), std::string::npos) << e;
  e = error_of("{" + qwen + R"(,"num_experts_per_tok":2,"decoder_sparse_step":0})");
  EXPECT_NE(e.find("decoder_sparse_step"), std::string::npos) << e;
  e = error_of(R"({"model_type":"mixtral","hidden_size":64,"intermediate_size":32,"num_hidden_layers":2,
    "num_attention_heads":4,"vocab_size":10,"router_jitter_noise":0.1})");
  EXPECT_NE(e.find("router_jitter_noise"), std::string::npos) << e;
}

// Qwen3.5-MoE: Qwen3.5's hybrid (layer types, DeltaNet sizes, output gate) with every layer MoE,
// always renormalised, and the shared expert's width as the dense MLP's.
TEST(DecoderConfig, MixtureOfExpertsQwen35) {
  const std::string base = R"("model_type":"qwen3_5_moe_text","hidden_size":64,"num_hidden_layers":4,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":10,"linear_num_key_heads":2,
    "linear_key_head_dim":8,"linear_num_value_heads":4,"linear_value_head_dim":8,"moe_intermediate_size":32)";
  DecoderConfig c = parse_decoder_config("{" + base + R"(,"num_experts":8,"num_experts_per_tok":2,
    "shared_expert_intermediate_size":48})", "cfg.json");
  EXPECT_STREQ(c.family->name, "qwen3_5_moe");
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.inter, 32);
  EXPECT_TRUE(c.moe.norm_topk_prob);  // the class always renormalises
  EXPECT_FALSE(c.moe.fp32_weights);   // and casts the weights to the logits' dtype
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{true, true, true, true}));
  EXPECT_TRUE(c.is_linear(0) && c.is_linear(2) && !c.is_linear(3));  // full_attention_interval 4
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.gated_delta.num_value_heads, 4);
  const Architecture& arch = architecture_of(c);
  EXPECT_EQ(projection_shape(*find_projection(arch, "shared_gate"), c, 0), (std::vector<int64_t>{48, 64}));
  EXPECT_EQ(projection_shape(*find_projection(arch, "shared_expert.down_proj"), c, 3), (std::vector<int64_t>{64, 48}));
  EXPECT_EQ(hf_key(*find_projection(arch, "shared_up"), 1), "model.layers.1.mlp.shared_expert.up_proj.weight");
  EXPECT_EQ(find_projection(arch, "gate_proj"), nullptr);  // no dense MLP
  const auto gate = std::find_if(arch.layer_norms.begin(), arch.layer_norms.end(),
                                 [](const NormRow& n) { return std::string(n.name) == "mlp.shared_expert_gate"; });
  ASSERT_NE(gate, arch.layer_norms.end());
  EXPECT_EQ(norm_shape(*gate, c, 2), (std::vector<int64_t>{1, 64}));
  EXPECT_EQ(hf_key(*gate, 2), "model.layers.2.mlp.shared_expert_gate.weight");
  c = parse_decoder_config("{" + base + "}", "cfg.json");  // Qwen3_5MoeTextConfig's defaults
  EXPECT_EQ(c.moe.num_experts, 256);
  EXPECT_EQ(c.moe.top_k, 8);
  EXPECT_EQ(c.intermediate_size, 512);
  std::string e = error_of("{" + base + R"(,"num_experts":4})");
  EXPECT_NE(e.find("8 experts per token of 4"), std::string::npos) << e;
  e = error_of("{" + base + R"(,"shared_expert_intermediate_size":0})");
  EXPECT_NE(e.find("shared_expert_intermediate_size"), std::string::npos) << e;
  e = error_of(R"({"model_type":"qwen3_5_moe_text","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
    "vocab_size":10})");
  EXPECT_NE(e.find("moe_intermediate_size"), std::string::npos) << e;
  // The Hub's form: the language model is text_config.
  c = parse_decoder_config(R"({"model_type":"qwen3_5_moe","text_config":{)" + base + R"(,"num_experts":8}})", "cfg.json");
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_TRUE(c.multimodal);
  EXPECT_EQ(c.moe.num_experts, 8);
  // lora.targets: shared_expert names its gate, up and down; experts the routed ones.
  EXPECT_EQ(peft_targets(architecture_of(c), {"shared_expert", "experts", "q"}),
            (std::vector<std::string>{"experts", "q_proj", "shared_expert.down_proj", "shared_expert.gate_proj",
                                      "shared_expert.up_proj"}));
  EXPECT_TRUE(is_known_target("shared_expert"));
  EXPECT_THROW(peft_targets(architecture_of(c), {"gate"}), std::invalid_argument);  // no dense MLP
  EXPECT_THROW(peft_targets(llama_architecture(), {"shared_expert"}), std::invalid_argument);
  // A multimodal adapter's pattern: a module's last name picks the row it ends (as PEFT matches names).
  EXPECT_EQ(peft_target_pattern(architecture_of(c), KeyLayout::kModelLanguage, {"gate_proj"}),
            "model\\.(?:language_model\\.)?layers\\.\\d+\\.mlp\\.shared_expert\\.gate_proj");
}

TEST(DecoderConfig, ErrorsNameFileAndKey) {
  const std::string base = R"("model_type":"llama","intermediate_size":8,"num_hidden_layers":1,
    "num_attention_heads":2,"vocab_size":10)";
  std::string e = error_of("{" + base + "}");
  EXPECT_NE(e.find("cfg.json"), std::string::npos) << e;
  EXPECT_NE(e.find("hidden_size"), std::string::npos) << e;
  e = error_of("{" + base + R"(,"hidden_size":"8"})");
  EXPECT_NE(e.find("expected an integer"), std::string::npos) << e;
  e = error_of("{" + base + R"(,"hidden_size":8,"rope_scaling":{"rope_type":"dynamic","factor":4.0}})");
  EXPECT_NE(e.find("dynamic"), std::string::npos) << e;
  e = error_of("{" + base + R"(,"hidden_size":8,"hidden_act":"gelu"})");
  EXPECT_NE(e.find("hidden_act"), std::string::npos) << e;
  e = error_of("{" + base + R"(,"hidden_size":8,"num_key_value_heads":3})");
  EXPECT_NE(e.find("num_key_value_heads"), std::string::npos) << e;
  e = error_of(R"({"model_type":"gpt2"})");
  EXPECT_NE(e.find("model_type"), std::string::npos) << e;
  EXPECT_EQ(error_of("{" + base + R"(,"hidden_size":8,"some_future_key":{"x":1}})"), "");  // ignored
  EXPECT_THROW(load_decoder_config("/nonexistent/dir"), std::invalid_argument);
}

TEST(DecoderModel, TinyLlamaLoadsAndRuns) {
  DecoderModel m = load_decoder(tiny_llama(), {});
  EXPECT_EQ(m.config.num_key_value_heads, 2);
  at::NoGradGuard ng;
  at::Tensor logits = m.forward(tokens());
  ASSERT_EQ(logits.sizes(), at::IntArrayRef({2, 7, 256}));
  EXPECT_EQ(logits.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::isfinite(logits).all().item<bool>());
  EXPECT_GT(max_abs(logits), 0.0);
  EXPECT_THROW(m.forward(at::tensor({1, 256}, at::kLong).view({1, 2})), std::invalid_argument);
}

TEST(DecoderModel, Nf4BaseCloseToFullPrecision) {
  at::NoGradGuard ng;
  DecoderLoadOptions o;
  at::Tensor full = load_decoder(tiny_llama(), o).forward(tokens());
  o.base_in_nf4 = true;
  DecoderModel m = load_decoder(tiny_llama(), o);
  ASSERT_TRUE(m.layers[0].q_proj.base_nf4.defined());
  ASSERT_FALSE(m.layers[0].q_proj.base_dense.defined());
  at::Tensor nf4 = m.forward(tokens());
  // NF4 has 16 levels per 64-weight block: ~10% relative error per weight, which through two
  // layers moves logits by a fraction of their spread. The tolerance is relative to the logits'
  // scale; a wrong dequantization (layout, scalers) makes the logits uncorrelated.
  const double rel = max_abs(nf4 - full) / max_abs(full);
  EXPECT_LT(rel, 0.3) << rel;
  const double cos = at::cosine_similarity(nf4.flatten(), full.flatten(), 0).item<double>();
  EXPECT_GT(cos, 0.95) << cos;
  EXPECT_FALSE(at::equal(nf4, full));
}

TEST(DecoderModel, Bf16ComputeCloseToFp32) {
  at::NoGradGuard ng;
  DecoderLoadOptions o;
  at::Tensor f32 = load_decoder(tiny_llama(), o).forward(tokens());
  o.compute_dtype = at::kBFloat16;
  at::Tensor b16 = load_decoder(tiny_llama(), o).forward(tokens());
  EXPECT_EQ(b16.scalar_type(), at::kFloat);
  // bf16 keeps 8 mantissa bits (rel. 4e-3 per rounding); a few dozen roundings deep.
  EXPECT_LT(max_abs(b16 - f32) / max_abs(f32), 0.05);
}

TEST(DecoderModel, KvCacheStepByStepEqualsFullForward) {
  for (bool nf4 : {false, true}) {
    DecoderLoadOptions o;
    o.base_in_nf4 = nf4;
    DecoderModel m = load_decoder(tiny_llama(), o);
    at::NoGradGuard ng;
    const at::Tensor t = tokens();
    const at::Tensor full = m.forward(t);  // [2, 7, vocab]
    modules::KvCache cache;
    std::vector<at::Tensor> parts;
    parts.push_back(m.forward(t.narrow(1, 0, 3), &cache));  // prefill 3
    parts.push_back(m.forward(t.narrow(1, 3, 1), &cache));  // one token
    parts.push_back(m.forward(t.narrow(1, 4, 2), &cache));  // a chunk of 2 after a cache (offset mask)
    parts.push_back(m.forward(t.narrow(1, 6, 1), &cache));
    EXPECT_EQ(cache.length(), 7);
    at::Tensor stepped = at::cat(parts, 1);
    // Same maths over differently shaped matmuls: fp32 rounding only.
    EXPECT_LT(max_abs(stepped - full), 1e-4) << "nf4=" << nf4;
  }
}

TEST(DecoderModel, LoraParameterNamesAndShapes) {
  DecoderLoadOptions o;
  o.base_in_nf4 = true;
  o.lora_targets = {"q_proj", "k", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"};
  o.lora_r = 4;
  o.lora_alpha = 8;
  DecoderModel m = load_decoder(tiny_llama(), o);
  auto params = m.lora_parameters();
  ASSERT_EQ(params.size(), 2u * 7 * 2 + 2);
  EXPECT_EQ(params[0].first, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(params[0].second.sizes(), at::IntArrayRef({4, 128}));
  EXPECT_EQ(params[3].first, "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight");
  EXPECT_EQ(params[3].second.sizes(), at::IntArrayRef({64, 4}));  // GQA: 2 kv heads of 32
  EXPECT_EQ(params[8].first, "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight");
  EXPECT_EQ(params.back().first, "base_model.model.lm_head.lora_B.weight");
  EXPECT_EQ(params.back().second.sizes(), at::IntArrayRef({256, 4}));
  for (const auto& [name, t] : params) {
    EXPECT_TRUE(t.requires_grad()) << name;
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
  }
  // Same seed, same adapters; B = 0 so the adapted model starts equal to the base.
  DecoderModel m2 = load_decoder(tiny_llama(), o);
  EXPECT_TRUE(at::equal(m2.lora_parameters()[0].second, params[0].second));
  at::NoGradGuard ng;
  DecoderLoadOptions base_only;
  base_only.base_in_nf4 = true;
  EXPECT_TRUE(at::equal(m.forward(tokens()), load_decoder(tiny_llama(), base_only).forward(tokens())));
  o.lora_targets = {"qkv"};
  EXPECT_THROW(load_decoder(tiny_llama(), o), std::invalid_argument);
}

TEST(DecoderModel, ActivationCheckpointingGivesIdenticalGradients) {
  DecoderLoadOptions o;
  o.base_in_nf4 = true;
  o.lora_targets = {"q_proj", "v_proj", "down_proj"};
  o.lora_r = 4;
  o.lora_dropout = 0.1;
  auto grads = [&](bool ckpt) {
    o.activation_checkpointing = ckpt;
    DecoderModel m = load_decoder(tiny_llama(), o);
    m.training = true;
    randomize_lora_b(m);
    at::manual_seed(11);
    at::Tensor logits = m.forward(tokens());
    at::log_softmax(logits, -1).select(-1, 3).mean().neg().backward();
    std::vector<at::Tensor> g;
    for (auto& [name, t] : m.lora_parameters()) {
      EXPECT_TRUE(t.grad().defined()) << name;
      g.push_back(t.grad().clone());
    }
    return g;
  };
  auto plain = grads(false), ckpt = grads(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << i;
    EXPECT_GT(max_abs(plain[i]), 0.0) << i;
  }
}

// UnitHooks come in execution order, with and without activation checkpointing (the replays in
// backward are bracketed as recompute), and none come when the forward records no graph.
TEST(DecoderModel, UnitHooksFireInExecutionOrder) {
  DecoderLoadOptions o;
  o.base_in_nf4 = true;
  o.lora_targets = {"q_proj"};
  const std::vector<std::string> fwd = {"bf-1", "af-1", "bf0", "af0", "bf1", "af1", "bf2", "af2"};
  for (const bool ckpt : {false, true}) {
    o.activation_checkpointing = ckpt;
    DecoderModel m = load_decoder(tiny_llama(), o);
    auto rec = std::make_shared<test_fixtures::HookRecorder>();
    m.hooks = rec;
    m.forward(tokens()).sum().backward();
    std::vector<std::string> want = fwd;
    const std::vector<std::string> bwd =
        ckpt ? std::vector<std::string>{"bb2", "ab2", "bb1", "bf1r", "af1r", "ab1", "bb0", "bf0r", "af0r"}
             : std::vector<std::string>{"bb2", "ab2", "bb1", "ab1", "bb0"};
    want.insert(want.end(), bwd.begin(), bwd.end());
    EXPECT_EQ(rec->events, want) << "activation checkpointing " << ckpt;
    rec->events.clear();
    {
      at::NoGradGuard ng;
      m.forward(tokens());
    }
    EXPECT_EQ(rec->events, fwd) << "no-grad forward: forward hooks only";
  }
}

// Mistral's sliding window (what transformers computes is checked in
// conformance.families_transformers): positions before the window's end see everything either way,
// later ones differ from full attention, and a KV cache fed token by token gives the same logits.
TEST(DecoderModel, SlidingWindowMasksFarKeysAlsoWithACache) {
  const fs::path dir = fs::temp_directory_path() / "qlora_test_sliding";
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(tiny_llama())) {
    if (e.path().filename() != "config.json") fs::copy_file(e.path(), dir / e.path().filename());
  }
  std::ifstream in(tiny_llama() + "/config.json");
  std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  cfg.insert(cfg.find('{') + 1, "\"sliding_window\": 3,");
  std::ofstream(dir / "config.json") << cfg;
  const DecoderModel full = load_decoder(tiny_llama(), {});
  const DecoderModel slide = load_decoder(dir.string(), {});
  at::NoGradGuard ng;
  const at::Tensor t = tokens();  // [b, s], s > 3
  const at::Tensor a = full.forward(t), b = slide.forward(t);
  // Equal up to fp32 rounding: full causal attention runs blocked_causal_attention, a window SDPA.
  EXPECT_LT((a.narrow(1, 0, 3) - b.narrow(1, 0, 3)).abs().max().item<float>(), 1e-5);
  EXPECT_GT((a.narrow(1, 3, t.size(1) - 3) - b.narrow(1, 3, t.size(1) - 3)).abs().max().item<float>(), 1e-4);
  modules::KvCache cache;
  for (int64_t i = 0; i < t.size(1); ++i) {
    const at::Tensor step = slide.forward(t.narrow(1, i, 1), &cache);  // [b, 1, vocab]
    EXPECT_LT((step[0][0] - b[0][i]).abs().max().item<float>(), 1e-5) << "position " << i;
  }
  fs::remove_all(dir);
}

TEST(DecoderModel, MissingTensorNamesCheckpointAndKey) {
  const fs::path dir = fs::temp_directory_path() / "qlora_test_missing";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(tiny_llama() + "/config.json", dir / "config.json");
  const auto ckpt = io::CheckpointDir::open(tiny_llama());
  std::vector<std::pair<std::string, at::Tensor>> kept;
  for (const std::string& n : ckpt.tensor_names()) {
    if (n != "model.layers.1.mlp.up_proj.weight") kept.emplace_back(n, ckpt.tensor(n));
  }
  io::save_safetensors((dir / "model.safetensors").string(), kept);
  for (bool nf4 : {false, true}) {
    DecoderLoadOptions o;
    o.base_in_nf4 = nf4;
    try {
      load_decoder(dir.string(), o);
      ADD_FAILURE() << "expected an error, nf4=" << nf4;
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << msg;
      EXPECT_NE(msg.find(dir.string()), std::string::npos) << msg;
    }
  }
  fs::remove_all(dir);
}

// ---- Sequence packing: several samples per row, per-token positions, block-causal mask ----
namespace {

// Two samples (lengths 5 and 7) packed into rows of 16 with 4 padding tokens. Row 0 holds A then
// B, row 1 holds B then A, so the per-row RoPE tables really differ between rows.
struct Packed {
  at::Tensor a, b;                   // [1, 5], [1, 7]
  at::Tensor tokens, positions, mask;  // [2, 16], [2, 16], [2, 16, 16]
  int64_t a_off[2], b_off[2];        // where A and B start in each row
};

// The rule of data::block_causal_mask, restated (qlora_models must not depend on qlora_data):
// query i may see key j when j <= i and both carry the same document id; padding (-1) is one more
// document, so its rows are causal among themselves and never all-false.
at::Tensor block_causal(const at::Tensor& doc) {  // [b, s] -> [b, s, s]
  const int64_t s = doc.size(1);
  return doc.unsqueeze(2).eq(doc.unsqueeze(1)).logical_and(at::ones({s, s}, at::kBool).tril());
}

Packed make_packed() {
  Packed p;
  p.a = at::tensor({5, 17, 200, 3, 45}, at::kLong).view({1, 5});
  p.b = at::tensor({99, 255, 7, 8, 9, 10, 11}, at::kLong).view({1, 7});
  const at::Tensor pad = at::zeros({1, 4}, at::kLong);
  p.tokens = at::cat({at::cat({p.a, p.b, pad}, 1), at::cat({p.b, p.a, pad}, 1)}, 0);
  auto pos = [](int64_t n) { return at::arange(n, at::kLong).view({1, n}); };
  p.positions = at::cat({at::cat({pos(5), pos(7), pos(4)}, 1), at::cat({pos(7), pos(5), pos(4)}, 1)}, 0);
  auto ids = [](int64_t n, int64_t id) { return at::full({1, n}, id, at::kLong); };
  const at::Tensor doc = at::cat({at::cat({ids(5, 0), ids(7, 1), ids(4, -1)}, 1),
                                  at::cat({ids(7, 0), ids(5, 1), ids(4, -1)}, 1)}, 0);  // [2, 16]
  p.mask = block_causal(doc);
  p.a_off[0] = 0;
  p.b_off[0] = 5;
  p.b_off[1] = 0;
  p.a_off[1] = 7;
  return p;
}

}  // namespace

TEST(DecoderModel, PackedForwardEqualsPerSampleForward) {
  const Packed p = make_packed();
  for (bool nf4 : {false, true}) {
    DecoderLoadOptions o;
    o.base_in_nf4 = nf4;
    DecoderModel m = load_decoder(tiny_llama(), o);
    at::NoGradGuard ng;
    const at::Tensor packed = m.forward(p.tokens, p.positions, p.mask);  // [2, 16, vocab]
    ASSERT_EQ(packed.sizes(), at::IntArrayRef({2, 16, 256}));
    const at::Tensor la = m.forward(p.a), lb = m.forward(p.b);  // [1, 5, vocab], [1, 7, vocab]
    for (int row = 0; row < 2; ++row) {
      // Same maths; masked keys add exactly 0 after softmax, so only matmul/SDPA accumulation
      // order over different shapes differs: fp32 rounding (logits are O(1)).
      EXPECT_LT(max_abs(packed[row].narrow(0, p.a_off[row], 5) - la[0]), 1e-5) << "nf4=" << nf4 << " row " << row;
      EXPECT_LT(max_abs(packed[row].narrow(0, p.b_off[row], 7) - lb[0]), 1e-5) << "nf4=" << nf4 << " row " << row;
    }
    EXPECT_TRUE(at::isfinite(packed).all().item<bool>());  // padding rows too: no all-false mask row
    // Position ids reach RoPE. (A constant shift per sample would not show it: RoPE scores depend
    // only on relative positions, so 0..15 with this mask gives B's logits too. All-zero positions
    // erase the relative distances.)
    EXPECT_GT(max_abs(m.forward(p.tokens, at::zeros_like(p.positions), p.mask)[0].narrow(0, 5, 7) - lb[0]), 1e-3);
  }
}

TEST(DecoderModel, PackedForwardRejectsBadInputs) {
  DecoderModel m = load_decoder(tiny_llama(), {});
  at::NoGradGuard ng;
  const Packed p = make_packed();
  {  // Not bad: packed rows into a cache (a generation batch's path) give the packed logits.
    modules::KvCache cache;
    EXPECT_LT(max_abs(m.forward(p.tokens, p.positions, p.mask, &cache) - m.forward(p.tokens, p.positions, p.mask)), 1e-5);
    EXPECT_EQ(cache.length(), p.tokens.size(1));
    // The next slot's mask must cover the cached keys too.
    EXPECT_THROW(m.forward(p.tokens.narrow(1, 0, 1), p.positions.narrow(1, 0, 1), p.mask.narrow(1, 0, 1).narrow(2, 0, 1),
                           &cache),
                 std::invalid_argument);
  }
  EXPECT_THROW(m.forward(p.tokens, p.positions.narrow(1, 0, 15), p.mask), std::invalid_argument);
  EXPECT_THROW(m.forward(p.tokens, p.positions, p.mask.to(at::kFloat)), std::invalid_argument);
  EXPECT_THROW(m.forward(p.tokens, p.positions, p.mask.narrow(0, 0, 1)), std::invalid_argument);
  at::Tensor holes = p.mask.clone();
  holes[0][3].fill_(false);  // query 3 of row 0 may see nothing
  try {
    m.forward(p.tokens, p.positions, holes);
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no allowed key"), std::string::npos) << e.what();
  }
}

TEST(DecoderModel, PackedGradientsEqualSumOfPerSampleGradients) {
  const Packed p = make_packed();
  DecoderLoadOptions o;
  o.base_in_nf4 = true;
  o.lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "lm_head"};
  o.lora_r = 4;  // no dropout: packed and per-sample runs would draw different masks
  for (bool ckpt : {false, true}) {
    o.activation_checkpointing = ckpt;
    DecoderModel m = load_decoder(tiny_llama(), o);
    m.training = true;
    randomize_lora_b(m);
    auto take_grads = [&]() {
      std::vector<at::Tensor> g;
      for (auto& [name, t] : m.lora_parameters()) {
        EXPECT_TRUE(t.grad().defined()) << name;
        g.push_back(t.grad().clone());
        t.mutable_grad().reset();
      }
      return g;
    };
    // A summed (not averaged) loss, so the packed loss is exactly the sum of the per-sample ones.
    auto loss_of = [](const at::Tensor& logits) { return at::log_softmax(logits, -1).select(-1, 3).sum().neg(); };
    // Row 0 only (A then B then padding); padding positions are left out of the loss.
    const at::Tensor logits = m.forward(p.tokens.narrow(0, 0, 1), p.positions.narrow(0, 0, 1), p.mask.narrow(0, 0, 1));
    (loss_of(logits.narrow(1, 0, 5)) + loss_of(logits.narrow(1, 5, 7))).backward();
    const auto packed = take_grads();
    loss_of(m.forward(p.a)).backward();
    const auto ga = take_grads();
    loss_of(m.forward(p.b)).backward();
    const auto gb = take_grads();
    ASSERT_EQ(packed.size(), ga.size());
    for (size_t i = 0; i < packed.size(); ++i) {
      const at::Tensor want = ga[i] + gb[i];
      // fp32 accumulation over differently shaped matmuls; relative to the gradient's scale.
      EXPECT_LT(max_abs(packed[i] - want), 1e-5 * std::max(1.0, max_abs(want))) << "ckpt=" << ckpt << " " << i;
      EXPECT_GT(max_abs(want), 0.0) << i;
    }
  }
}

// Frozen bf16 storage of embed_tokens / lm_head under fp32 compute, on a bf16 checkpoint: the
// stored values are the checkpoint's, widening bf16 -> fp32 is exact, and with the whole vocab
// in one lm_head chunk (tiny_llama: 256 <= 4096 rows) the fp32 computation is the same calls on the
// same values, so logits and LoRA gradients (lm_head adapter included) are bit-identical.
// With several chunks the forward is still exact per output column, but the backward's grad wrt h
// sums over the vocab chunk by chunk (a different fp32 accumulation order), so gradients agree to
// fp32 rounding only: checked to a relative 1e-5.
TEST(DecoderModel, FrozenBf16StorageEqualsFp32Storage) {
  DecoderLoadOptions o;
  o.base_in_nf4 = true;
  o.compute_dtype = at::kFloat;
  o.lora_targets = {"q_proj", "v_proj", "down_proj", "lm_head"};
  o.lora_r = 4;
  o.lora_dropout = 0.1;
  o.activation_checkpointing = true;
  struct Run {
    at::Tensor logits;
    std::vector<at::Tensor> grads;
  };
  auto run = [&](at::ScalarType frozen, int64_t chunk_rows) {
    o.frozen_dtype = frozen;
    DecoderModel m = load_decoder(tiny_llama(), o);
    m.lm_head_chunk_rows = chunk_rows;
    if (frozen == at::kBFloat16) {
      EXPECT_EQ(m.frozen_dtype, at::kBFloat16);
      EXPECT_EQ(m.embed_tokens.scalar_type(), at::kBFloat16);
      EXPECT_EQ(m.lm_head.base_dense.scalar_type(), at::kBFloat16);
      EXPECT_EQ(m.norm.scalar_type(), at::kFloat);
    } else {
      EXPECT_EQ(m.frozen_dtype, at::kFloat);
      EXPECT_EQ(m.embed_tokens.scalar_type(), at::kFloat);
    }
    m.training = true;
    randomize_lora_b(m);
    at::manual_seed(11);
    Run r;
    r.logits = m.forward(tokens());
    at::log_softmax(r.logits, -1).select(-1, 3).mean().neg().backward();
    for (auto& [name, t] : m.lora_parameters()) {
      EXPECT_TRUE(t.grad().defined()) << name;
      r.grads.push_back(t.grad().clone());
    }
    return r;
  };
  const Run ref = run(at::ScalarType::Undefined, 4096);
  const Run one_chunk = run(at::kBFloat16, 4096);
  const Run chunked = run(at::kBFloat16, 100);  // 256 rows: chunks of 100, 100, 56
  EXPECT_EQ(ref.logits.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(ref.logits, one_chunk.logits));
  EXPECT_TRUE(at::allclose(ref.logits, chunked.logits, 0.0, 1e-6 * max_abs(ref.logits)));
  ASSERT_EQ(ref.grads.size(), one_chunk.grads.size());
  ASSERT_EQ(ref.grads.size(), chunked.grads.size());
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    EXPECT_GT(max_abs(ref.grads[i]), 0.0) << i;
    EXPECT_TRUE(at::equal(ref.grads[i], one_chunk.grads[i])) << i;
    EXPECT_LE(max_abs(ref.grads[i] - chunked.grads[i]), 1e-5 * max_abs(ref.grads[i])) << i;
  }
  // Inference (no grad, KV cache) works with bf16 storage too.
  o.frozen_dtype = at::kBFloat16;
  o.lora_targets.clear();
  o.activation_checkpointing = false;
  DecoderModel m = load_decoder(tiny_llama(), o);
  at::NoGradGuard ng;
  modules::KvCache cache;
  at::Tensor full = m.forward(tokens());
  at::Tensor a = m.forward(tokens().narrow(1, 0, 4), &cache), b = m.forward(tokens().narrow(1, 4, 3), &cache);
  EXPECT_LE(max_abs(at::cat({a, b}, 1) - full), 1e-4);
  // Any other frozen dtype is rejected.
  o.frozen_dtype = at::kHalf;
  EXPECT_THROW(load_decoder(tiny_llama(), o), std::invalid_argument);
  o.compute_dtype = at::kBFloat16;
  o.frozen_dtype = at::kFloat;
  EXPECT_THROW(load_decoder(tiny_llama(), o), std::invalid_argument);
}
