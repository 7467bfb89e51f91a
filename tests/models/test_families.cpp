// Tests for the model families' config parsing (models/decoder_config), their architecture tables
// (models/architecture) and the numerics they add to modules/: (1 + w) RMSNorm, windowed
// and soft-capped attention, fused Phi-3 projections. The configs are the published config.json
// files' keys (values as in the model repos named beside them); what transformers computes from
// them is checked in conformance.families_transformers.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/models/architecture.h"
#include "qlora/models/decoder_config.h"
#include "qlora/modules/attention.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/rms_norm.h"
#include "qlora/modules/rope.h"
#include "fixtures.h"

using namespace qlora::models;
namespace modules = qlora::modules;

namespace {

using test_fixtures::error_of;

// Qwen/Qwen2.5-7B-Instruct config.json (transformers 4.43 format).
const char* kQwen25 = R"({"architectures":["Qwen2ForCausalLM"],"attention_dropout":0.0,"bos_token_id":151643,
  "eos_token_id":151645,"hidden_act":"silu","hidden_size":3584,"initializer_range":0.02,"intermediate_size":18944,
  "max_position_embeddings":32768,"max_window_layers":28,"model_type":"qwen2","num_attention_heads":28,
  "num_hidden_layers":28,"num_key_value_heads":4,"rms_norm_eps":1e-06,"rope_theta":1000000.0,"sliding_window":131072,
  "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,"use_sliding_window":false,"vocab_size":152064})";

// google/gemma-2-9b config.json: no layer_types, no tie_word_embeddings (Gemma ties by default).
const char* kGemma2 = R"({"architectures":["Gemma2ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
  "attn_logit_softcapping":50.0,"bos_token_id":2,"cache_implementation":"hybrid","eos_token_id":1,
  "final_logit_softcapping":30.0,"head_dim":256,"hidden_act":"gelu_pytorch_tanh","hidden_activation":"gelu_pytorch_tanh",
  "hidden_size":3584,"initializer_range":0.02,"intermediate_size":14336,"max_position_embeddings":8192,
  "model_type":"gemma2","num_attention_heads":16,"num_hidden_layers":42,"num_key_value_heads":8,"pad_token_id":0,
  "query_pre_attn_scalar":256,"rms_norm_eps":1e-06,"rope_theta":10000.0,"sliding_window":4096,
  "sliding_window_size":4096,"torch_dtype":"float32","use_cache":true,"vocab_size":256000})";

// google/gemma-3-1b-it config.json (transformers 4.50 format: pattern + local base frequency).
const char* kGemma3 = R"({"architectures":["Gemma3ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
  "attn_logit_softcapping":null,"bos_token_id":2,"eos_token_id":[1,106],"final_logit_softcapping":null,
  "head_dim":256,"hidden_activation":"gelu_pytorch_tanh","hidden_size":1152,"intermediate_size":6912,
  "max_position_embeddings":32768,"model_type":"gemma3_text","num_attention_heads":4,"num_hidden_layers":26,
  "num_key_value_heads":1,"pad_token_id":0,"query_pre_attn_scalar":256,"rms_norm_eps":1e-06,
  "rope_local_base_freq":10000,"rope_scaling":null,"rope_theta":1000000,"sliding_window":512,
  "sliding_window_pattern":6,"torch_dtype":"bfloat16","vocab_size":262144})";

// microsoft/Phi-3-mini-4k-instruct config.json.
const char* kPhi3 = R"({"architectures":["Phi3ForCausalLM"],"attention_dropout":0.0,"bos_token_id":1,
  "embd_pdrop":0.0,"eos_token_id":32000,"hidden_act":"silu","hidden_size":3072,"initializer_range":0.02,
  "intermediate_size":8192,"max_position_embeddings":4096,"model_type":"phi3","num_attention_heads":32,
  "num_hidden_layers":32,"num_key_value_heads":32,"original_max_position_embeddings":4096,"pad_token_id":32000,
  "resid_pdrop":0.0,"rms_norm_eps":1e-05,"rope_scaling":null,"rope_theta":10000.0,"sliding_window":2047,
  "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,"vocab_size":32064})";

}  // namespace

TEST(FamilyConfig, Qwen25HasBiasesAndNoWindowWhenUseSlidingWindowIsFalse) {
  const DecoderConfig c = parse_decoder_config(kQwen25, "cfg.json");
  EXPECT_STREQ(c.family->name, "qwen2");
  EXPECT_FALSE(c.sliding_window.has_value());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) EXPECT_FALSE(c.is_sliding(i));
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  const Architecture& a = architecture_of(c);
  EXPECT_STREQ(a.family, "qwen2");
  std::vector<std::string> with_bias;
  for (const ProjectionRow& r : a.projections)
    if (has_bias(r, c)) with_bias.push_back(hf_bias_key(r, 3));
  EXPECT_EQ(with_bias, (std::vector<std::string>{"model.layers.3.self_attn.q_proj.bias",
                                                 "model.layers.3.self_attn.k_proj.bias",
                                                 "model.layers.3.self_attn.v_proj.bias"}));
}

TEST(FamilyConfig, Gemma2DefaultsTieAlternatesWindowsAndSoftCaps) {
  const DecoderConfig c = parse_decoder_config(kGemma2, "cfg.json");
  EXPECT_STREQ(c.family->name, "gemma2");
  EXPECT_TRUE(c.tie_word_embeddings);  // absent from the file: Gemma's default
  EXPECT_EQ(c.norm, modules::RmsScale::kOnePlusWeight);
  EXPECT_EQ(c.activation, MlpActivation::kGeluTanh);
  EXPECT_DOUBLE_EQ(c.embed_scale, std::sqrt(3584.0));
  EXPECT_EQ(c.attn_logit_softcapping, 50.0);
  EXPECT_EQ(c.final_logit_softcapping, 30.0);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_TRUE(c.is_sliding(0));
  EXPECT_FALSE(c.is_sliding(1));
  EXPECT_TRUE(c.is_sliding(40));
  std::vector<std::string> norms;
  for (const NormRow& n : architecture_of(c).layer_norms) norms.push_back(hf_key(n, 0));
  EXPECT_EQ(norms, (std::vector<std::string>{
                       "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                       "model.layers.0.pre_feedforward_layernorm.weight",
                       "model.layers.0.post_feedforward_layernorm.weight"}));
  // null disables a soft-cap; a missing key takes Gemma 2's default.
  std::string no_caps = kGemma2;
  no_caps.replace(no_caps.find("\"attn_logit_softcapping\":50.0"), 29, "\"attn_logit_softcapping\":null");
  EXPECT_FALSE(parse_decoder_config(no_caps, "cfg.json").attn_logit_softcapping.has_value());
}

TEST(FamilyConfig, Gemma3PatternAndLocalRope) {
  const DecoderConfig c = parse_decoder_config(kGemma3, "cfg.json");
  EXPECT_STREQ(c.family->name, "gemma3");
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(c.is_sliding(i), (i + 1) % 6 != 0) << i;
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  ASSERT_TRUE(c.local_rope.has_value());
  EXPECT_DOUBLE_EQ(c.local_rope->theta, 10000.0);
  EXPECT_FALSE(c.attn_logit_softcapping.has_value());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 106}));
  // transformers 5 form: layer_types and one rope dict per layer type, linear scaling on global.
  const std::string v5 = R"({"model_type":"gemma3_text","hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":3,"num_attention_heads":2,"head_dim":32,"vocab_size":10,
    "layer_types":["sliding_attention","full_attention","sliding_attention"],"sliding_window":8,
    "rope_parameters":{"full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000.0},
                       "sliding_attention":{"rope_type":"default","rope_theta":10000.0}}})";
  const DecoderConfig d = parse_decoder_config(v5, "cfg.json");
  EXPECT_EQ(d.sliding_layers, (std::vector<bool>{true, false, true}));
  EXPECT_DOUBLE_EQ(d.rope_linear_factor, 8.0);
  EXPECT_DOUBLE_EQ(d.local_rope->linear_factor, 1.0);
  // The Hub's Gemma 3 text_config omits head_dim and hidden_activation: Gemma's defaults.
  const DecoderConfig e = parse_decoder_config(R"({"model_type":"gemma3_text","hidden_size":3840,
    "intermediate_size":15360,"num_hidden_layers":48,"num_attention_heads":16,"num_key_value_heads":8,
    "vocab_size":262208})", "cfg.json");
  EXPECT_EQ(e.head_dim, 256);
  EXPECT_EQ(e.activation, MlpActivation::kGeluTanh);
}

// The Hub's gemma-3-12b-pt config.json in its form (sizes as bench/model_shapes.h names them): the
// text_config lists only what differs from Gemma3TextConfig's defaults.
const char* kGemma3Multimodal12b = R"({"architectures":["Gemma3ForConditionalGeneration"],"boi_token_index":255999,
  "eoi_token_index":256000,"eos_token_id":[1,106],"image_token_index":262144,"initializer_range":0.02,
  "mm_tokens_per_image":256,"model_type":"gemma3","text_config":{"hidden_size":3840,"intermediate_size":15360,
  "model_type":"gemma3_text","num_attention_heads":16,"num_hidden_layers":48,"num_key_value_heads":8,
  "rope_scaling":{"factor":8.0,"rope_type":"linear"},"sliding_window":1024},"torch_dtype":"bfloat16",
  "vision_config":{"hidden_size":1152,"image_size":896,"intermediate_size":4304,"model_type":"siglip_vision_model",
  "num_attention_heads":16,"num_hidden_layers":27,"patch_size":14,"vision_use_head":false}})";

TEST(FamilyConfig, Gemma3MultimodalIsItsTextConfigWithGemma3TextDefaults) {
  const DecoderConfig c = parse_decoder_config(kGemma3Multimodal12b, "config.json");
  EXPECT_EQ(c.model_type, "gemma3");
  EXPECT_TRUE(c.multimodal);
  EXPECT_STREQ(c.family->name, "gemma3");
  EXPECT_EQ(c.hidden_size, 3840);
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.vocab_size, 262208);  // Gemma3TextConfig's defaults, absent from the file
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.sliding_window, 1024);
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(c.is_sliding(i), (i + 1) % 6 != 0) << i;
  EXPECT_DOUBLE_EQ(c.rope_linear_factor, 8.0);
  EXPECT_DOUBLE_EQ(c.local_rope->theta, 10000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 106}));  // the top level's, with <end_of_turn>
  EXPECT_EQ(c.bos_token_id, 2);
  // Sizes given in text_config override the defaults; the top level's tie_word_embeddings decides.
  EXPECT_FALSE(parse_decoder_config(R"({"model_type":"gemma3","tie_word_embeddings":false,"text_config":{}})", "c")
                   .tie_word_embeddings);
  EXPECT_FALSE(parse_decoder_config(kGemma3, "cfg.json").multimodal);
}

TEST(FamilyConfig, Gemma3MultimodalWithoutTextConfigIsRefusedNamingFileAndKey) {
  const std::string e = error_of(R"({"model_type":"gemma3","vision_config":{"model_type":"siglip_vision_model"}})");
  EXPECT_NE(e.find("config key 'text_config': missing"), std::string::npos) << e;
  const std::string e2 = error_of(R"({"model_type":"gemma3","text_config":[1]})");
  EXPECT_NE(e2.find("'text_config': expected an object"), std::string::npos) << e2;
  // An error inside text_config says so.
  const std::string e3 = error_of(R"({"model_type":"gemma3","text_config":{"hidden_size":"big"}})");
  EXPECT_NE(e3.find("(text_config): config key 'hidden_size'"), std::string::npos) << e3;
  const std::string e4 = error_of(R"({"model_type":"gemma3","text_config":{"model_type":"llama"}})");
  EXPECT_NE(e4.find("(text_config): config key 'model_type': expected \"gemma3_text\""), std::string::npos) << e4;
}

// In the form of the Hub's Qwen3.5 configs (Qwen3_5ForConditionalGeneration): the language model's
// settings in text_config, its RoPE dict carrying the partial rotary factor and the multimodal
// RoPE sections; the vision tower's settings beside it.
const char* kQwen35Config9b = R"({"architectures":["Qwen3_5ForConditionalGeneration"],"model_type":"qwen3_5",
  "tie_word_embeddings":false,"image_token_id":248056,
  "text_config":{"model_type":"qwen3_5_text","hidden_size":4096,"intermediate_size":12288,"num_hidden_layers":8,
  "num_attention_heads":16,"num_key_value_heads":4,"head_dim":256,"linear_num_key_heads":16,
  "linear_num_value_heads":32,"linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,
  "full_attention_interval":4,"vocab_size":248320,"eos_token_id":248044,"rms_norm_eps":1e-6,"hidden_act":"silu",
  "max_position_embeddings":262144,"attn_output_gate":true,
  "rope_parameters":{"rope_type":"default","rope_theta":10000000,"partial_rotary_factor":0.25,
  "mrope_interleaved":true,"mrope_section":[11,11,10]}},
  "vision_config":{"model_type":"qwen3_5_vision","depth":27,"hidden_size":1152}})";

TEST(FamilyConfig, Qwen35MultimodalIsItsHybridTextConfig) {
  const DecoderConfig c = parse_decoder_config(kQwen35Config9b, "config.json");
  EXPECT_EQ(c.model_type, "qwen3_5");
  EXPECT_TRUE(c.multimodal);
  EXPECT_STREQ(c.family->name, "qwen3_5");
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rope_dim(), 64);  // a quarter of head_dim rotates
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.norm, modules::RmsScale::kOnePlusWeight);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_FALSE(c.tie_word_embeddings);
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(c.is_linear(i), (i + 1) % 4 != 0) << i;
  EXPECT_EQ(c.gated_delta.conv_dim(), 2 * 16 * 128 + 32 * 128);
  EXPECT_EQ(c.mrope_section, (std::vector<int64_t>{11, 11, 10}));  // GGUF's rope.dimension_sections
  const Architecture& arch = architecture_of(c);
  EXPECT_EQ(projection_shape(*find_projection(arch, "q_proj"), c, 3), (std::vector<int64_t>{2 * 16 * 256, 4096}));
  EXPECT_EQ(projection_shape(*find_projection(arch, "in_proj_b"), c, 0), (std::vector<int64_t>{32, 4096}));
  EXPECT_EQ(peft_target(arch, "linear_out"), "out_proj");
  for (const NormRow& n : arch.layer_norms)
    if (std::string(n.name) == "linear_attn.conv1d") EXPECT_EQ(norm_shape(n, c, 0), (std::vector<int64_t>{8192, 1, 4}));
    else if (std::string(n.name) == "linear_attn.A_log") EXPECT_EQ(hf_key(n, 2), "model.layers.2.linear_attn.A_log");
  // A layer holds its own mixer's rows only.
  EXPECT_TRUE(in_layer(find_projection(arch, "in_proj_qkv")->mixer, c, 0));
  EXPECT_FALSE(in_layer(find_projection(arch, "in_proj_qkv")->mixer, c, 3));
  EXPECT_TRUE(in_layer(find_projection(arch, "q_proj")->mixer, c, 3));
  EXPECT_TRUE(in_layer(find_projection(arch, "gate_proj")->mixer, c, 0));
}

TEST(FamilyConfig, Qwen35LayerTypesAndRefusals) {
  const auto parse = [](const std::string& extra) {
    return parse_decoder_config(R"({"model_type":"qwen3_5_text","hidden_size":64,"intermediate_size":96,
      "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":128,
      "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":8,"linear_value_head_dim":8)" +
                                  extra + "}",
                              "q/config.json");
  };
  const DecoderConfig c = parse(R"(,"layer_types":["full_attention","linear_attention","full_attention"])");
  EXPECT_FALSE(c.is_linear(0));
  EXPECT_TRUE(c.is_linear(1));
  EXPECT_EQ(c.rope_dim(), 4);  // the class's default factor, 0.25 of 16
  EXPECT_EQ(parse(R"(,"partial_rotary_factor":1.0)").rope_dim(), 16);
  const auto refused = [&](const std::string& extra, const std::string& want) {
    try {
      parse(extra);
      ADD_FAILURE() << "accepted " << extra;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refused(R"(,"layer_types":["full_attention","sliding_attention","full_attention"])", "'layer_types'");
  refused(R"(,"linear_num_value_heads":3)", "must be a multiple of linear_num_key_heads");
  refused(R"(,"partial_rotary_factor":0.1)", "positive even number");
  EXPECT_EQ(c.mrope_section, (std::vector<int64_t>{11, 11, 10}));  // transformers' default where the config has none
  refused(R"(,"rope_parameters":{"rope_type":"default","mrope_section":[11,-1]})", "rope_parameters.mrope_section");
  // Other families still take only full rotary.
  EXPECT_THROW(parse_decoder_config(R"({"model_type":"qwen3","hidden_size":64,"intermediate_size":96,
      "num_hidden_layers":1,"num_attention_heads":4,"vocab_size":128,"partial_rotary_factor":0.5})", "c"),
               std::invalid_argument);
}

TEST(FamilyConfig, Phi3SlidesEveryLayerAndFusesTargets) {
  const DecoderConfig c = parse_decoder_config(kPhi3, "cfg.json");
  EXPECT_STREQ(c.family->name, "phi3");
  EXPECT_EQ(c.sliding_window, 2047);
  EXPECT_TRUE(c.is_sliding(0) && c.is_sliding(31));
  const Architecture& a = architecture_of(c);
  EXPECT_EQ(projection_shape(*find_projection(a, "qkv"), c, 0), (std::vector<int64_t>{3 * 3072, 3072}));
  EXPECT_EQ(projection_shape(*find_projection(a, "gate_up"), c, 0), (std::vector<int64_t>{2 * 8192, 3072}));
  EXPECT_EQ(peft_targets(a, {"q", "k", "v", "o", "gate", "up", "down"}),
            (std::vector<std::string>{"down_proj", "gate_up_proj", "o_proj", "qkv_proj"}));
  EXPECT_EQ(peft_targets(a, {"qkv_proj", "output"}), (std::vector<std::string>{"lm_head", "qkv_proj"}));
  try {
    peft_targets(a, {"q", "v"});
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fuses q, k, v into qkv_proj"), std::string::npos) << e.what();
  }
  EXPECT_THROW(peft_targets(llama_architecture(), {"qkv"}), std::invalid_argument);
}

// The keys of HuggingFaceTB/SmolLM3-3B's config.json (transformers 4.53 format), its 36-entry
// no_rope_layers replaced by `nope` (or dropped, leaving the class's interval rule).
std::string smollm3_config(const std::string& nope) {
  return R"({"architectures":["SmolLM3ForCausalLM"],"attention_bias":false,"eos_token_id":128012,
    "hidden_act":"silu","hidden_size":2048,"intermediate_size":11008,"max_position_embeddings":65536,
    "max_window_layers":28,"mlp_bias":false,"model_type":"smollm3","no_rope_layer_interval":4,)" + nope +
         R"("num_attention_heads":16,"num_hidden_layers":36,"num_key_value_heads":4,"pad_token_id":128004,
    "rms_norm_eps":1e-06,"rope_scaling":null,"rope_theta":5000000.0,"sliding_window":null,
    "use_sliding_window":false,"vocab_size":128256})";
}

TEST(FamilyConfig, SmolLM3LeavesRopeOutOfItsNopeLayers) {
  std::string list;
  for (int i = 0; i < 36; ++i) list += std::string(list.empty() ? "" : ",") + ((i + 1) % 4 == 0 ? "0" : "1");
  for (const std::string& nope : {"\"no_rope_layers\":[" + list + "],", std::string()}) {
    const DecoderConfig c = parse_decoder_config(smollm3_config(nope), "cfg.json");
    EXPECT_STREQ(c.family->name, "smollm3");
    EXPECT_TRUE(c.tie_word_embeddings);  // the class's default
    EXPECT_FALSE(c.sliding_window);
    EXPECT_TRUE(c.uses_rope(0) && c.uses_rope(2) && c.uses_rope(34));
    EXPECT_FALSE(c.uses_rope(3) || c.uses_rope(7) || c.uses_rope(35));
    EXPECT_STREQ(architecture_of(c).family, "smollm3");
  }
  const std::string e = error_of(smollm3_config("\"no_rope_layers\":[1,0],"));
  EXPECT_NE(e.find("'no_rope_layers': expected a list of 36 entries"), std::string::npos) << e;
  const std::string e2 = error_of(smollm3_config("\"no_rope_layers\":[" + list.substr(0, list.size() - 1) + "2],"));
  EXPECT_NE(e2.find("entry 35 is 2 (0 or 1)"), std::string::npos) << e2;
  // Every other family rotates every layer.
  EXPECT_TRUE(parse_decoder_config(kPhi3, "cfg.json").nope_layers.empty());
}

// An OLMo 3 config in transformers 4.x's keys (rope_scaling for the full layers, no layer_types):
// the class's defaults decide the sliding layers, the sliding layers keep the plain RoPE.
TEST(FamilyConfig, Olmo3SlidesThreeOfFourLayersAndScalesItsFullLayersWithYarn) {
  const DecoderConfig c = parse_decoder_config(R"({"model_type":"olmo3","hidden_size":4096,"intermediate_size":11008,
    "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":32,"max_position_embeddings":65536,
    "rope_theta":500000,"rope_scaling":{"rope_type":"yarn","factor":8.0,"original_max_position_embeddings":8192,
    "attention_factor":1.2079441541679836,"beta_fast":32,"beta_slow":1},"vocab_size":100278})", "cfg.json");
  EXPECT_STREQ(c.family->name, "olmo3");
  EXPECT_EQ(c.sliding_window, 4096);  // the class's default window
  EXPECT_TRUE(c.is_sliding(0) && c.is_sliding(2) && !c.is_sliding(3) && c.is_sliding(30) && !c.is_sliding(31));
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  ASSERT_TRUE(c.rope_yarn);
  EXPECT_DOUBLE_EQ(c.rope_yarn->attention_factor, 1.2079441541679836);
  ASSERT_TRUE(c.local_rope);
  EXPECT_FALSE(c.local_rope->yarn);
  EXPECT_DOUBLE_EQ(c.local_rope->theta, 500000);
  const Architecture& a = architecture_of(c);
  EXPECT_STREQ(a.family, "olmo2");
  ASSERT_EQ(a.layer_norms.size(), 4u);  // post-attention, post-feedforward, q and k over all heads
  EXPECT_EQ(dim_size(a.layer_norms[2].size, c, 0), 4096);
  // Without an attention_factor, transformers' 0.1 ln(factor) + 1.
  const DecoderConfig d = parse_decoder_config(R"({"model_type":"olmo2","hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":32,"max_position_embeddings":4096,
    "rope_parameters":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":1024,"rope_theta":1e4}})",
                                           "cfg.json");
  ASSERT_TRUE(d.rope_yarn);
  EXPECT_DOUBLE_EQ(d.rope_yarn->attention_factor, 0.1 * std::log(4.0) + 1.0);
  EXPECT_FALSE(d.sliding_window);  // OLMo 2 has none
}

TEST(FamilyConfig, UnsupportedModelsAreRefusedByName) {
  const std::string e1 = error_of(R"({"model_type":"llava","text_config":{},"vision_config":{"model_type":"siglip"}})");
  EXPECT_NE(e1.find("multimodal"), std::string::npos) << e1;
  EXPECT_NE(e1.find("vision_config"), std::string::npos) << e1;
  const std::string e2 = error_of(R"({"model_type":"mllama"})");
  EXPECT_NE(e2.find("'mllama' is not supported"), std::string::npos) << e2;
  EXPECT_NE(e2.find("qwen3"), std::string::npos) << e2;  // lists what is
  std::string partial = kPhi3;
  partial.insert(1, "\"partial_rotary_factor\":0.75,");
  EXPECT_NE(error_of(partial).find("partial_rotary_factor"), std::string::npos);
  std::string longrope = kPhi3;
  longrope.replace(longrope.find("\"rope_scaling\":null"), 19,
                   R"("rope_scaling":{"type":"longrope","long_factor":[1],"short_factor":[1]})");
  EXPECT_NE(error_of(longrope).find("'longrope' is not supported"), std::string::npos) << error_of(longrope);
  std::string chunked = R"({"model_type":"qwen3","hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
    "num_attention_heads":2,"vocab_size":10,"layer_types":["chunked_attention"]})";
  EXPECT_NE(error_of(chunked).find("layer_types"), std::string::npos);
}

TEST(FamilyModules, RmsNormPlusOneScalesByOnePlusWeightInFp32) {
  const at::Tensor x = at::randn({2, 3, 8}).to(at::kBFloat16);
  const at::Tensor w = at::randn({8}).to(at::kBFloat16);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor want = (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-6) * (1.0 + w.to(at::kFloat))).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(modules::rms_norm_plus_one(x, w, 1e-6), want));
}

// Reference: scores in fp64 written out, window and cap applied by index.
TEST(FamilyModules, WindowedSoftCappedAttentionMatchesAReferenceAlsoWithACache) {
  at::manual_seed(0);
  const int64_t b = 2, h = 4, kvh = 2, s = 7, d = 8, window = 3;
  const at::Tensor q = at::randn({b, h, s, d}), k = at::randn({b, kvh, s, d}), v = at::randn({b, kvh, s, d});
  modules::AttentionOptions opt;
  opt.scale = 0.3;
  opt.softcap = 2.0;
  opt.window = window;
  const at::Tensor got = modules::causal_attention(q, k, v, opt);
  const at::Tensor kk = k.repeat_interleave(h / kvh, 1).to(at::kDouble), vv = v.repeat_interleave(h / kvh, 1).to(at::kDouble);
  at::Tensor scores = at::matmul(q.to(at::kDouble), kk.transpose(2, 3)) * 0.3;
  scores = at::tanh(scores / 2.0) * 2.0;
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < s; ++j)
      if (j > i || j <= i - window) scores.select(2, i).select(2, j).fill_(-INFINITY);
  const at::Tensor want = at::matmul(at::softmax(scores, -1), vv).to(at::kFloat);
  EXPECT_LT((got - want).abs().max().item<float>(), 1e-5);
  // The last two queries against the whole cache (positions 5, 6) see the same window.
  const at::Tensor tail = modules::causal_attention(q.narrow(2, 5, 2), k, v, opt);
  EXPECT_LT((tail - want.narrow(2, 5, 2)).abs().max().item<float>(), 1e-5);
  // Without a cap, the SDPA path under the same window.
  opt.softcap = 0.0;
  at::Tensor plain = at::matmul(q.to(at::kDouble), kk.transpose(2, 3)) * 0.3;
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < s; ++j)
      if (j > i || j <= i - window) plain.select(2, i).select(2, j).fill_(-INFINITY);
  const at::Tensor want_plain = at::matmul(at::softmax(plain, -1), vv).to(at::kFloat);
  EXPECT_LT((modules::causal_attention(q, k, v, opt) - want_plain).abs().max().item<float>(), 1e-5);
  // A packed mask with the window: the window applies within each block.
  const at::Tensor all = at::ones({b, s, s}, at::kBool).tril();
  EXPECT_LT((modules::masked_attention(q, k, v, all, opt) - want_plain).abs().max().item<float>(), 1e-5);
}

TEST(FamilyModules, FusedProjectionsEqualTheirParts) {
  at::manual_seed(1);
  const int64_t hidden = 16, heads = 2, kvh = 1, d = 8, inter = 24;
  modules::DecoderLayer split, fused;
  auto w = [](int64_t o, int64_t i) { return at::randn({o, i}) * 0.2; };
  const at::Tensor wq = w(heads * d, hidden), wk = w(kvh * d, hidden), wv = w(kvh * d, hidden);
  const at::Tensor wo = w(hidden, heads * d), wg = w(inter, hidden), wu = w(inter, hidden), wd = w(hidden, inter);
  const at::Tensor n1 = at::randn({hidden}), n2 = at::randn({hidden});
  for (modules::DecoderLayer* L : {&split, &fused}) {
    L->input_layernorm = n1;
    L->post_attention_layernorm = n2;
    L->o_proj = modules::lora_linear_dense(wo);
    L->down_proj = modules::lora_linear_dense(wd);
  }
  split.q_proj = modules::lora_linear_dense(wq);
  split.k_proj = modules::lora_linear_dense(wk);
  split.v_proj = modules::lora_linear_dense(wv);
  split.gate_proj = modules::lora_linear_dense(wg);
  split.up_proj = modules::lora_linear_dense(wu);
  fused.qkv_proj = modules::lora_linear_dense(at::cat({wq, wk, wv}, 0));
  fused.gate_up_proj = modules::lora_linear_dense(at::cat({wg, wu}, 0));
  modules::LayerDims dims{heads, kvh, d, 1e-5};
  dims.attention.window = 2;
  const at::Tensor x = at::randn({2, 5, hidden});
  const modules::RopeTables rope =
      modules::rope_tables(modules::rope_inv_freq(d, 10000.0, std::nullopt), at::arange(5, at::kLong), at::kFloat);
  const at::Tensor a = modules::decoder_layer_forward(split, dims, x, rope, false);
  const at::Tensor f = modules::decoder_layer_forward(fused, dims, x, rope, false);
  EXPECT_LT((a - f).abs().max().item<float>(), 1e-5);
}

TEST(FamilyConfig, GenerationConfigEosIds) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "qlora_test_generation_config";
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_TRUE(load_generation_eos_ids(dir.string()).empty());  // no file: none
  std::ofstream(dir / "generation_config.json") << R"({"bos_token_id": 2, "eos_token_id": [1, 107]})";
  EXPECT_EQ(load_generation_eos_ids(dir.string()), (std::vector<int64_t>{1, 107}));
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": "x"})";
  EXPECT_THROW(load_generation_eos_ids(dir.string()), std::invalid_argument);
  fs::remove_all(dir);
}

namespace {

// google/gemma-4-E4B config.json's text keys as the Hub writes them (no per_layer_config: the class
// derives the full layers' sizes from global_head_dim); 42 layers, 5:1 sliding, 18 KV-shared.
std::string gemma4_e4b_config() {
  std::string types;
  for (int i = 0; i < 42; ++i) types += std::string(i ? "," : "") + ((i + 1) % 6 ? "\"sliding_attention\"" : "\"full_attention\"");
  return R"({"architectures":["Gemma4ForConditionalGeneration"],"model_type":"gemma4","eos_token_id":[1,106],
    "text_config":{"model_type":"gemma4_text","hidden_size":2560,"intermediate_size":10240,"num_hidden_layers":42,
    "num_attention_heads":8,"num_key_value_heads":2,"head_dim":256,"global_head_dim":512,"vocab_size":262144,
    "vocab_size_per_layer_input":262144,"hidden_size_per_layer_input":256,"num_kv_shared_layers":18,
    "sliding_window":512,"final_logit_softcapping":30.0,"attention_k_eq_v":false,"enable_moe_block":false,
    "use_double_wide_mlp":false,"hidden_activation":"gelu_pytorch_tanh","rms_norm_eps":1e-6,
    "use_bidirectional_attention":"vision","layer_types":[)" + types + R"(],
    "rope_parameters":{"full_attention":{"partial_rotary_factor":0.25,"rope_theta":1000000.0,"rope_type":"proportional"},
    "sliding_attention":{"rope_theta":10000.0,"rope_type":"default"}}},
    "vision_config":{"model_type":"gemma4_vision"},"audio_config":{"model_type":"gemma4_audio"}})";
}

}  // namespace

TEST(FamilyConfig, Gemma4HubFormIsItsTextConfig) {
  const DecoderConfig c = parse_decoder_config(gemma4_e4b_config(), "config.json");
  EXPECT_EQ(c.model_type, "gemma4");
  EXPECT_TRUE(c.multimodal);
  EXPECT_STREQ(c.family->name, "gemma4");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.norm, modules::RmsScale::kWeightFp32);
  EXPECT_DOUBLE_EQ(*c.query_pre_attn_scalar, 1.0);  // attention scale 1
  EXPECT_DOUBLE_EQ(*c.final_logit_softcapping, 30.0);
  EXPECT_EQ(*c.sliding_window, 512);
  EXPECT_TRUE(c.is_sliding(0));
  EXPECT_FALSE(c.is_sliding(5));
  EXPECT_EQ(c.layer_head_dim(0), 256);
  EXPECT_EQ(c.layer_head_dim(5), 512);
  EXPECT_EQ(c.layer_kv_heads(5), 2);  // num_global_key_value_heads counts only under attention_k_eq_v
  ASSERT_TRUE(c.rope_proportional);
  EXPECT_DOUBLE_EQ(c.rope_proportional->partial_rotary_factor, 0.25);
  ASSERT_TRUE(c.local_rope);
  EXPECT_FALSE(c.local_rope->proportional);
  // Layers 24..41 reuse the K/V of the last sliding (22) and full (23) layers before them.
  EXPECT_FALSE(c.is_kv_shared(23));
  EXPECT_EQ(c.kv_source[24], 22);
  EXPECT_EQ(c.kv_source[29], 23);
  EXPECT_TRUE(c.is_kv_source(22));
  EXPECT_EQ(c.per_layer_input_dim, 256);
  const Architecture& arch = architecture_of(c);
  EXPECT_FALSE(in_layer(find_projection(arch, "k_proj")->mixer, c, 24));
  EXPECT_TRUE(in_layer(find_projection(arch, "v_proj")->mixer, c, 23));
  EXPECT_EQ(projection_shape(*find_projection(arch, "q_proj"), c, 5), (std::vector<int64_t>{8 * 512, 2560}));
  EXPECT_EQ(projection_shape(*find_projection(arch, "ple_gate"), c, 0), (std::vector<int64_t>{256, 2560}));
  EXPECT_EQ(peft_target(arch, "ple_proj"), "per_layer_projection");
  EXPECT_EQ(embed_shape(arch.embed_rows[0], c), (std::vector<int64_t>{262144, 42 * 256}));
}

TEST(FamilyConfig, Gemma4MixtureOfExperts) {
  const std::string base = R"({"model_type":"gemma4_text","hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":128,
    "hidden_size_per_layer_input":0,"rms_norm_eps":1e-5)";
  const DecoderConfig c = parse_decoder_config(
      base + R"(,"enable_moe_block":true,"num_experts":8,"top_k_experts":2,"moe_intermediate_size":32})", "g/config.json");
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.inter, 32);
  EXPECT_TRUE(c.moe.norm_topk_prob);  // Gemma4TextRouter always renormalises
  EXPECT_TRUE(c.moe.fp32_weights);    // and keeps the weights fp32 (times per_expert_scale)
  EXPECT_TRUE(c.moe.scaled_router);
  EXPECT_DOUBLE_EQ(c.moe.norm_eps, 1e-5);
  EXPECT_EQ(c.moe.activation, qlora::modules::ExpertActivation::kGeluTanh);  // hidden_activation's
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{true, true, true}));
  const Architecture& arch = architecture_of(c);
  ASSERT_TRUE(arch.experts.has_value());
  EXPECT_EQ(hf_module(arch.experts->fused_router, 1), "model.layers.1.router.proj");
  EXPECT_TRUE(in_layer(find_projection(arch, "gate_proj")->mixer, c, 0));  // the MLP stays beside the MoE
  // A dense Gemma 4 (enable_moe_block false or absent) has no MoE layers, and null sizes are its defaults.
  const DecoderConfig dense = parse_decoder_config(
      base + R"(,"enable_moe_block":false,"num_experts":null,"top_k_experts":null})", "g/config.json");
  EXPECT_TRUE(dense.moe_layers.empty());
}

TEST(FamilyConfig, Gemma4SavedFormAndRefusals) {
  // What transformers' save_pretrained writes: per_layer_config overrides instead of global_head_dim.
  const auto json_of = [](const std::string& extra) {
    return R"({"model_type":"gemma4_text","hidden_size":64,"intermediate_size":128,
      "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":128,
      "layer_types":["sliding_attention","full_attention","sliding_attention","sliding_attention"])" + extra + "}";
  };
  const auto parse = [&](const std::string& extra) { return parse_decoder_config(json_of(extra), "g/config.json"); };
  const DecoderConfig c = parse(R"(,"attention_k_eq_v":true,"num_kv_shared_layers":1,"use_double_wide_mlp":true,
    "per_layer_config":{"01":{"head_dim":32,"num_key_value_heads":1},"03":{"head_dim":32,"num_key_value_heads":1}})");
  EXPECT_FALSE(c.is_sliding(3));  // the class makes the last layer full
  EXPECT_EQ(c.layer_head_dim(3), 32);
  EXPECT_EQ(c.layer_kv_heads(1), 1);
  EXPECT_EQ(c.kv_source[3], 1);
  EXPECT_EQ(c.layer_intermediate(3), 256);
  const Architecture& arch = architecture_of(c);
  EXPECT_FALSE(in_layer(find_projection(arch, "v_proj")->mixer, c, 1));  // v = k on full layers
  EXPECT_TRUE(in_layer(find_projection(arch, "v_proj")->mixer, c, 0));
  EXPECT_EQ(parse(R"(,"hidden_size_per_layer_input":null)").per_layer_input_dim, 0);
  const auto refused = [&](const std::string& extra, const std::string& key) {
    EXPECT_NE(error_of(json_of(extra)).find("'" + key + "'"), std::string::npos) << error_of(json_of(extra));
  };
  // The MoE form needs its sizes (no class defaults) and at most num_experts a token.
  refused(R"(,"enable_moe_block":true,"top_k_experts":2,"moe_intermediate_size":8)", "num_experts");
  refused(R"(,"enable_moe_block":true,"num_experts":4,"moe_intermediate_size":8)", "top_k_experts");
  refused(R"(,"enable_moe_block":true,"num_experts":4,"top_k_experts":5,"moe_intermediate_size":8)", "top_k_experts");
  refused(R"(,"enable_moe_block":true,"num_experts":null,"top_k_experts":2,"moe_intermediate_size":8)", "num_experts");
  refused(R"(,"use_bidirectional_attention":"all")", "use_bidirectional_attention");
  refused(R"(,"per_layer_config":{"1":{"intermediate_size":64}})", "per_layer_config.1.intermediate_size");
  refused(R"(,"per_layer_config":{"1":{"head_dim":32}})", "per_layer_config");  // full layer 3 differs
  refused(R"(,"num_kv_shared_layers":3)", "num_kv_shared_layers");  // no full layer before layer 1
}
