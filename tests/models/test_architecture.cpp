// Tests for models/architecture: the Llama table's names, HF keys and layer members, the two
// target spellings, and the refusal of unknown targets; models/key_layout: a multimodal
// checkpoint's language-model keys and the PEFT target pattern that matches only them.
#include <gtest/gtest.h>

#include <iterator>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/models/architecture.h"
#include "qlora/models/key_layout.h"

using namespace qlora::models;
using qlora::modules::DecoderLayer;
using qlora::modules::LoraLinear;

namespace {

struct Expected {
  const char* short_name;
  const char* peft_name;
  const char* key_of_layer_7;  // HF weight key
};

// Written out by hand from the HF Llama checkpoint layout, not derived from the table.
const Expected kLlama[] = {
    {"q", "q_proj", "model.layers.7.self_attn.q_proj.weight"},
    {"k", "k_proj", "model.layers.7.self_attn.k_proj.weight"},
    {"v", "v_proj", "model.layers.7.self_attn.v_proj.weight"},
    {"o", "o_proj", "model.layers.7.self_attn.o_proj.weight"},
    {"gate", "gate_proj", "model.layers.7.mlp.gate_proj.weight"},
    {"up", "up_proj", "model.layers.7.mlp.up_proj.weight"},
    {"down", "down_proj", "model.layers.7.mlp.down_proj.weight"},
    {"output", "lm_head", "lm_head.weight"},
};

}  // namespace

TEST(Architecture, LlamaRowsNamesAndHfKeys) {
  const Architecture& arch = llama_architecture();
  EXPECT_STREQ(arch.family, "llama");
  ASSERT_EQ(arch.projections.size(), std::size(kLlama));
  for (size_t j = 0; j < arch.projections.size(); ++j) {
    const ProjectionRow& row = arch.projections[j];
    EXPECT_STREQ(row.short_name, kLlama[j].short_name) << j;
    EXPECT_STREQ(row.peft_name, kLlama[j].peft_name) << j;
    EXPECT_EQ(hf_key(row, 7), kLlama[j].key_of_layer_7) << j;
    EXPECT_TRUE(row.fused_parts.empty()) << row.peft_name;  // Llama fuses nothing
  }
  EXPECT_EQ(hf_key(arch.projections[0], 0), "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(hf_module(arch.projections[6].hf_module, 31), "model.layers.31.mlp.down_proj");
  EXPECT_STREQ(output_projection(arch).peft_name, "lm_head");
  EXPECT_EQ(output_projection(arch).member, nullptr);

  ASSERT_EQ(arch.layer_norms.size(), 2u);
  EXPECT_EQ(hf_key(arch.layer_norms[0], 2), "model.layers.2.input_layernorm.weight");
  EXPECT_EQ(hf_key(arch.layer_norms[1], 2), "model.layers.2.post_attention_layernorm.weight");
  EXPECT_STREQ(arch.layer_norms[0].name, "input_layernorm");
  EXPECT_STREQ(arch.embed_key, "model.embed_tokens.weight");
  EXPECT_STREQ(arch.final_norm_key, "model.norm.weight");
}

TEST(Architecture, LayerProjectionsInTableOrder) {
  const Architecture& arch = llama_architecture();
  DecoderLayer L;
  const std::vector<LoraLinear*> want = {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj,
                                         &L.gate_proj, &L.up_proj, &L.down_proj};
  EXPECT_EQ(layer_projections(arch, L), want);
  const DecoderLayer& cl = L;
  const std::vector<const LoraLinear*> got = layer_projections(arch, cl);
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_EQ(got[j], want[j]) << j;
  EXPECT_EQ(layer_peft_names(arch),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
}

TEST(Architecture, ProjectionShapesFollowTheConfig) {
  const Architecture& arch = llama_architecture();
  DecoderConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 300;
  const std::vector<std::vector<int64_t>> want = {{64, 64},  {32, 64},  {32, 64}, {64, 64},
                                                  {176, 64}, {176, 64}, {64, 176}, {300, 64}};
  for (size_t j = 0; j < arch.projections.size(); ++j)
    EXPECT_EQ(projection_shape(arch.projections[j], c, 0), want[j]) << arch.projections[j].peft_name;
}

TEST(Architecture, TargetsInBothSpellings) {
  const Architecture& arch = llama_architecture();
  for (const Expected& e : kLlama) {
    EXPECT_EQ(peft_target(arch, e.short_name), e.peft_name);
    EXPECT_EQ(peft_target(arch, e.peft_name), e.peft_name);
    EXPECT_EQ(find_projection(arch, e.short_name), find_projection(arch, e.peft_name));
  }
  EXPECT_EQ(find_projection(arch, "qkv"), nullptr);
  EXPECT_EQ(projection_names(arch, false), "q, k, v, o, gate, up, down, output");
  EXPECT_EQ(projection_names(arch, true), "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head");
}

TEST(Architecture, UnknownTargetIsRefusedNamingTheAllowedOnes) {
  const Architecture& arch = llama_architecture();
  for (const std::string bad : {"qkv", "qkv_proj", "Q", "q_proj.weight", ""}) {
    try {
      peft_target(arch, bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + bad + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("q, k, v, o, gate, up, down, output"), std::string::npos) << msg;
      EXPECT_NE(msg.find("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"), std::string::npos)
          << msg;
    }
  }
}

TEST(KeyLayout, TextKeysInEachLayout) {
  const std::string q = "model.layers.3.self_attn.q_proj.weight";
  EXPECT_EQ(layout_key(KeyLayout::kText, q), q);
  EXPECT_EQ(layout_key(KeyLayout::kLanguageModel, q), "language_model.model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(layout_key(KeyLayout::kModelLanguage, q), "model.language_model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(layout_key(KeyLayout::kLanguageModel, "lm_head.weight"), "language_model.lm_head.weight");
  EXPECT_EQ(layout_key(KeyLayout::kModelLanguage, "lm_head.weight"), "lm_head.weight");
  EXPECT_TRUE(is_language_model_key(KeyLayout::kLanguageModel, "language_model.model.norm.weight"));
  EXPECT_TRUE(is_language_model_key(KeyLayout::kLanguageModel, "language_model.lm_head.weight"));
  EXPECT_FALSE(is_language_model_key(KeyLayout::kLanguageModel, "vision_tower.encoder.layers.0.self_attn.q_proj.weight"));
  EXPECT_FALSE(is_language_model_key(KeyLayout::kModelLanguage, "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"));
  EXPECT_FALSE(is_language_model_key(KeyLayout::kModelLanguage, "model.multi_modal_projector.mm_soft_emb_norm.weight"));
  EXPECT_TRUE(is_language_model_key(KeyLayout::kModelLanguage, "lm_head.weight"));
}

TEST(KeyLayout, PeftTargetPatternNamesOnlyTheLanguageModelsModules) {
  const Architecture& arch = llama_architecture();
  EXPECT_EQ(peft_target_pattern(arch, KeyLayout::kModelLanguage, {"v_proj", "q_proj", "lm_head"}),
            "model\\.(?:language_model\\.)?layers\\.\\d+\\.self_attn\\.q_proj|"
            "model\\.(?:language_model\\.)?layers\\.\\d+\\.self_attn\\.v_proj|lm_head");
  EXPECT_EQ(peft_target_pattern(arch, KeyLayout::kText, {"down_proj"}), "model\\.layers\\.\\d+\\.mlp\\.down_proj");
  // PEFT fullmatches the pattern: the language model's modules under the multimodal class and the
  // text-only one AutoModelForCausalLM builds, never a tower's.
  const std::regex re(peft_target_pattern(arch, KeyLayout::kModelLanguage, {"q_proj", "lm_head"}));
  for (const char* name : {"model.language_model.layers.3.self_attn.q_proj", "model.layers.12.self_attn.q_proj", "lm_head"})
    EXPECT_TRUE(std::regex_match(name, re)) << name;
  for (const char* name : {"model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
                           "model.visual.blocks.0.attn.q_proj", "model.language_model.layers.3.self_attn.k_proj",
                           "model.audio_tower.layers.0.self_attn.q_proj"})
    EXPECT_FALSE(std::regex_match(name, re)) << name;
}

// A trained vision tower's adapted modules join the pattern, one alternative per module kind with its
// layer index as \d+: every block's, no other module.
TEST(KeyLayout, PeftTargetPatternAddsTheTowersAdaptedModules) {
  const Architecture& arch = llama_architecture();
  const std::string p = peft_target_pattern(arch, KeyLayout::kModelLanguage, {"q_proj"},
                                            {"model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.mlp.linear_fc1",
                                             "model.visual.blocks.1.attn.qkv", "model.visual.blocks.1.mlp.linear_fc1"});
  EXPECT_EQ(p, "model\\.(?:language_model\\.)?layers\\.\\d+\\.self_attn\\.q_proj|"
               "model\\.visual\\.blocks\\.\\d+\\.attn\\.qkv|model\\.visual\\.blocks\\.\\d+\\.mlp\\.linear_fc1");
  const std::regex re(p);
  for (const char* name : {"model.visual.blocks.26.attn.qkv", "model.visual.blocks.3.mlp.linear_fc1",
                           "model.language_model.layers.3.self_attn.q_proj"})
    EXPECT_TRUE(std::regex_match(name, re)) << name;
  for (const char* name : {"model.visual.blocks.0.attn.proj", "model.visual.merger.linear_fc1",
                           "model.visual.blocks.0.mlp.linear_fc2"})
    EXPECT_FALSE(std::regex_match(name, re)) << name;
  // Gemma 4's clippable linears: the index is the layer's, not the ".linear" wrapper's.
  EXPECT_EQ(peft_target_pattern(arch, KeyLayout::kModelLanguage, {}, {"model.vision_tower.encoder.layers.5.self_attn.q_proj.linear"}),
            "model\\.vision_tower\\.encoder\\.layers\\.\\d+\\.self_attn\\.q_proj\\.linear");
}
