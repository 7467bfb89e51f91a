// llama-quantize's default per-tensor type choice (quant_mix.h) on synthetic tensor lists: the rules
// one by one. conformance.gguf_kquants checks the same choices against llama.cpp itself.
#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/gguf/quant_mix.h"

namespace qlora::gguf {
namespace {

// A llama-shaped tensor list in the converter's order (layer 10 after layer 1, as a file has it).
std::vector<TensorSpec> llama(int layers, int64_t hidden, int64_t kv, int64_t ffn, bool tied) {
  std::vector<TensorSpec> t{{"token_embd.weight", {1000, hidden}}, {"output_norm.weight", {hidden}}};
  if (!tied) t.push_back({"output.weight", {1000, hidden}});
  for (int i = 0; i < layers; ++i) {
    const std::string b = "blk." + std::to_string(i) + ".";
    t.push_back({b + "attn_norm.weight", {hidden}});
    t.push_back({b + "attn_q.weight", {hidden, hidden}});
    t.push_back({b + "attn_k.weight", {kv, hidden}});
    t.push_back({b + "attn_v.weight", {kv, hidden}});
    t.push_back({b + "attn_output.weight", {hidden, hidden}});
    t.push_back({b + "ffn_gate.weight", {ffn, hidden}});
    t.push_back({b + "ffn_up.weight", {ffn, hidden}});
    t.push_back({b + "ffn_down.weight", {hidden, ffn}});
    t.push_back({b + "ffn_norm.weight", {hidden}});
  }
  return t;
}

std::map<std::string, GgmlType> mix(const std::vector<TensorSpec>& t, GgmlType main, ModelFacts f = {}) {
  if (f.n_layer == 0) {
    for (const auto& s : t)
      if (s.name.rfind("blk.", 0) == 0) f.n_layer = std::max<int64_t>(f.n_layer, std::stoi(s.name.substr(4)) + 1);
    f.n_head = 8;
    f.n_head_kv = 2;
  }
  const std::vector<GgmlType> types = choose_types(t, f, main);
  std::map<std::string, GgmlType> out;
  for (size_t i = 0; i < t.size(); ++i) out[t[i].name] = types[i];
  return out;
}

std::string blk(int i, const char* part) { return "blk." + std::to_string(i) + "." + part + ".weight"; }

TEST(GgufQuantMix, Q4KMediumOnWholeBlocks) {
  const auto m = mix(llama(16, 256, 128, 512, false), GgmlType::Q4_K);
  EXPECT_EQ(m.at("output.weight"), GgmlType::Q6_K);
  EXPECT_EQ(m.at("token_embd.weight"), GgmlType::Q4_K);  // not the head: untied
  EXPECT_EQ(m.at("output_norm.weight"), GgmlType::F32);
  // use_more_bits(i, 16): i < 2, i >= 14, (i - 2) % 3 == 2.
  for (int i = 0; i < 16; ++i) {
    const bool more = i < 2 || i >= 14 || (i - 2) % 3 == 2;
    const GgmlType want = more ? GgmlType::Q6_K : GgmlType::Q4_K;
    EXPECT_EQ(m.at(blk(i, "attn_v")), want) << i;
    EXPECT_EQ(m.at(blk(i, "ffn_down")), want) << i;
    EXPECT_EQ(m.at(blk(i, "attn_q")), GgmlType::Q4_K) << i;
    EXPECT_EQ(m.at(blk(i, "ffn_up")), GgmlType::Q4_K) << i;
    EXPECT_EQ(m.at(blk(i, "attn_norm")), GgmlType::F32) << i;
  }
}

TEST(GgufQuantMix, FallbacksWhenRowsAreNotWhole256Blocks) {
  // SmolLM2's shapes: hidden 576 (not 256-blocks), ffn 1536 (256-blocks), tied embeddings.
  const auto t = llama(30, 576, 192, 1536, true);
  auto m = mix(t, GgmlType::Q4_K);
  EXPECT_EQ(m.at("token_embd.weight"), GgmlType::Q8_0);  // the tied head, rows of 576
  EXPECT_EQ(m.at(blk(5, "attn_q")), GgmlType::Q5_0);
  EXPECT_EQ(m.at(blk(0, "attn_v")), GgmlType::Q8_0);  // q6_K, fallen back
  EXPECT_EQ(m.at(blk(4, "attn_v")), GgmlType::Q5_0);
  EXPECT_EQ(m.at(blk(0, "ffn_down")), GgmlType::Q6_K);  // rows of 1536: no fallback
  EXPECT_EQ(m.at(blk(4, "ffn_down")), GgmlType::Q4_K);
  m = mix(t, GgmlType::Q5_K);
  EXPECT_EQ(m.at(blk(5, "ffn_up")), GgmlType::Q5_1);
  m = mix(t, GgmlType::Q6_K);
  EXPECT_EQ(m.at(blk(5, "ffn_up")), GgmlType::Q8_0);
  EXPECT_EQ(m.at(blk(5, "ffn_down")), GgmlType::Q6_K);
  m = mix(t, GgmlType::Q4_0);
  EXPECT_EQ(m.at("token_embd.weight"), GgmlType::Q8_0);  // q6_K's fallback
  EXPECT_EQ(m.at(blk(0, "attn_v")), GgmlType::Q4_0);
  m = mix(llama(2, 40, 40, 40, false), GgmlType::Q4_K);  // not even 32-blocks: f16
  EXPECT_EQ(m.at(blk(1, "attn_q")), GgmlType::F16);
  EXPECT_EQ(m.at("output.weight"), GgmlType::F16);
}

TEST(GgufQuantMix, LegacyAndPlainTypes) {
  const auto t = llama(8, 256, 128, 512, false);
  auto m = mix(t, GgmlType::Q8_0);
  for (const auto& [name, type] : m) EXPECT_EQ(type, name.find("norm") != std::string::npos ? GgmlType::F32 : GgmlType::Q8_0) << name;
  m = mix(t, GgmlType::Q4_0);
  EXPECT_EQ(m.at("output.weight"), GgmlType::Q6_K);
  EXPECT_EQ(m.at(blk(0, "attn_v")), GgmlType::Q4_0);
  EXPECT_EQ(m.at(blk(0, "ffn_down")), GgmlType::Q4_0);
  for (GgmlType plain : {GgmlType::F16, GgmlType::BF16, GgmlType::F32}) {
    m = mix(t, plain);
    EXPECT_EQ(m.at("output.weight"), plain);
    EXPECT_EQ(m.at(blk(3, "attn_v")), plain);
    EXPECT_EQ(m.at(blk(3, "ffn_norm")), GgmlType::F32);
  }
}

TEST(GgufQuantMix, CountersRunByLayerNotByFileOrder) {
  // Layers listed 0, 10, 1, 2, ...: llama.cpp sorts by layer, so attn_v's counter is the layer.
  auto t = llama(12, 256, 128, 512, false);
  std::vector<TensorSpec> shuffled(t.begin(), t.begin() + 3);
  for (int first : {10, 11, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9})
    for (const auto& s : t)
      if (s.name.rfind("blk." + std::to_string(first) + ".", 0) == 0) shuffled.push_back(s);
  const auto a = mix(t, GgmlType::Q5_K), b = mix(shuffled, GgmlType::Q5_K);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.at(blk(10, "attn_v")), GgmlType::Q6_K);  // 10 >= 7 * 12 / 8
  EXPECT_EQ(a.at(blk(2, "attn_v")), GgmlType::Q5_K);
}

TEST(GgufQuantMix, ExpertsSeventyBAndFusedQkv) {
  auto t = llama(8, 256, 128, 512, false);
  ModelFacts f{"llama", 8, 8, 2, 8};
  auto m = mix(t, GgmlType::Q4_K, f);
  EXPECT_EQ(m.at(blk(3, "attn_v")), GgmlType::Q8_0);
  EXPECT_EQ(m.at(blk(3, "attn_k")), GgmlType::Q8_0);
  EXPECT_EQ(m.at(blk(3, "attn_output")), GgmlType::Q5_K);
  t.push_back({"blk.9.ffn_up.weight", {512, 256}});  // a layer the model lacks: refused with experts
  EXPECT_THROW(mix(t, GgmlType::Q4_K, f), std::invalid_argument);

  m = mix(llama(80, 256, 128, 256, false), GgmlType::Q4_K, ModelFacts{"llama", 80, 8, 2, 0});
  EXPECT_EQ(m.at(blk(20, "attn_v")), GgmlType::Q5_K);  // 70B: q4_K bumped
  EXPECT_EQ(m.at(blk(21, "attn_v")), GgmlType::Q6_K);  // use_more_bits(21, 80): (21 - 10) % 3 == 2
  m = mix(llama(80, 256, 256, 256, false), GgmlType::Q4_K, ModelFacts{"llama", 80, 8, 8, 0});
  EXPECT_EQ(m.at(blk(20, "attn_v")), GgmlType::Q4_K);  // no GQA: not 70B

  std::vector<TensorSpec> phi{{"token_embd.weight", {1000, 256}}, {"output.weight", {1000, 256}}};
  for (int i = 0; i < 8; ++i) phi.push_back({blk(i, "attn_qkv"), {768, 256}});
  m = mix(phi, GgmlType::Q4_K, ModelFacts{"phi3", 8, 8, 8, 0});
  EXPECT_EQ(m.at(blk(0, "attn_qkv")), GgmlType::Q6_K);  // counted as attn_v
  EXPECT_EQ(m.at(blk(1, "attn_qkv")), GgmlType::Q4_K);
}

TEST(GgufQuantMix, TensorsLlamaCppNeverQuantizes) {
  std::vector<TensorSpec> t{{"token_embd.weight", {1000, 256}},
                            {"blk.0.ffn_gate_inp.weight", {8, 256}},
                            {"blk.0.attn_q_norm.weight", {64}},
                            {"blk.0.ssm_conv1d.weight", {256, 4}}};
  const auto m = mix(t, GgmlType::Q4_K, ModelFacts{"llama", 1, 8, 8, 0});
  // A MoE router: the converter writes it in f32 and llama-quantize keeps it (in every file type).
  EXPECT_EQ(m.at("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
  EXPECT_EQ(mix(t, GgmlType::F16, ModelFacts{"qwen3moe", 1, 8, 8, 8}).at("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
  EXPECT_EQ(m.at("blk.0.attn_q_norm.weight"), GgmlType::F32);
  // The converter writes it in f32 and llama-quantize keeps it; ggml_ssm_conv reads f32 only.
  EXPECT_EQ(m.at("blk.0.ssm_conv1d.weight"), GgmlType::F32);
  EXPECT_EQ(m.at("token_embd.weight"), GgmlType::Q6_K);  // tied: the head
  EXPECT_EQ(mix(t, GgmlType::F16, ModelFacts{"qwen35", 1, 8, 8, 0}).at("blk.0.ssm_conv1d.weight"), GgmlType::F32);
}

// A MoE model's 3-D expert tensors [E, rows, cols] (written after the layers' other tensors, as the
// converter stacks them): rows of cols like 2-D ones, their layer read from the name (the file's
// order would give ffn_down_exps of layer 0 another layer's place), the router in f32.
TEST(GgufQuantMix, ExpertTensors) {
  std::vector<TensorSpec> t{{"token_embd.weight", {1000, 256}}, {"output.weight", {1000, 256}}};
  for (int i = 0; i < 8; ++i) t.push_back({blk(i, "ffn_gate_inp"), {8, 256}});
  for (int i = 7; i >= 0; --i) {
    t.push_back({blk(i, "ffn_gate_exps"), {8, 512, 256}});
    t.push_back({blk(i, "ffn_up_exps"), {8, 512, 256}});
    t.push_back({blk(i, "ffn_down_exps"), {8, 256, 512}});
  }
  const auto m = mix(t, GgmlType::Q4_K, ModelFacts{"qwen3moe", 8, 8, 2, 8});
  EXPECT_EQ(m.at(blk(0, "ffn_down_exps")), GgmlType::Q6_K);  // use_more_bits(0, 8): the first eighth
  EXPECT_EQ(m.at(blk(1, "ffn_down_exps")), GgmlType::Q4_K);
  EXPECT_EQ(m.at(blk(3, "ffn_down_exps")), GgmlType::Q6_K);  // (3 - 1) % 3 == 2
  EXPECT_EQ(m.at(blk(7, "ffn_down_exps")), GgmlType::Q6_K);  // the last eighth
  EXPECT_EQ(m.at(blk(1, "ffn_gate_exps")), GgmlType::Q4_K);
  EXPECT_EQ(m.at(blk(1, "ffn_up_exps")), GgmlType::Q4_K);
  EXPECT_EQ(m.at(blk(5, "ffn_gate_inp")), GgmlType::F32);
  EXPECT_EQ(mix(t, GgmlType::F16, ModelFacts{"qwen3moe", 8, 8, 2, 8}).at(blk(2, "ffn_down_exps")), GgmlType::F16);
}

}  // namespace
}  // namespace qlora::gguf
