// Gemma 2 and Gemma 3: (1 + w) RMSNorms in fp32, the embedding scaled by sqrt(hidden), four norms a
// block (pre/post attention and feed-forward), GeGLU (gelu tanh), attention scaled by
// query_pre_attn_scalar^-0.5, tied embeddings and head_dim 256 by default.
//   gemma2       soft-capped attention and output logits, the window (4096) on even layers.
//   gemma3_text  q/k norms, no soft-caps, local:global layers (sliding_window_pattern, 6) whose
//                local layers take their own RoPE (rope_local_base_freq), global base 1e6.
//   gemma3       the Hub's Gemma 3 4B/12B/27B (Gemma3ForConditionalGeneration): the gemma3_text
//                language model of its text_config; the vision tower's weights are copied into
//                merged exports, never computed (their prefixes: key_layout.h).
// llama.cpp's "gemma2" / "gemma3": every norm weight stored as 1 + w; llama.cpp fixes which layers
// slide (gemma2: even ones; gemma3: five of every six, local RoPE base 10000 unscaled) and the
// attention scale (head_dim, or hidden / heads on the 27B), so a config that differs is refused.
// gemma2 writes both soft-caps and multiplies by the embedding (no head of its own); gemma3 reads the
// global layers' RoPE base and linear scaling, and an output.weight where the file has one.
#include <cmath>

#include "qlora/models/config_json.h"
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"
#include "qlora/models/vision/tower.h"

namespace qlora::models {
namespace {

using namespace families;

const Architecture& gemma2_architecture() {
  static const Architecture a =
      make_architecture("gemma2", llama_rows(), {kInputNorm, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm});
  return a;
}
const Architecture& gemma3_architecture() {
  static const Architecture a = make_architecture(
      "gemma3", llama_rows(), {kInputNorm, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm, kQNorm, kKNorm});
  return a;
}

bool gemma2_slides(const nlohmann::json&, const std::string&, int64_t layer) { return layer % 2 == 0; }
bool gemma3_slides(const nlohmann::json& j, const std::string& where, int64_t layer) {
  const int64_t pattern = cfg::get_int(j, "sliding_window_pattern", where, 6);
  return pattern <= 0 || (layer + 1) % pattern != 0;
}

void parse_gemma(const nlohmann::json& j, const std::string& where, DecoderConfig& c, std::optional<double> attn_cap,
                 std::optional<double> final_cap) {
  c.norm = modules::RmsScale::kOnePlusWeight;
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  c.query_pre_attn_scalar = cfg::get_num(j, "query_pre_attn_scalar", where, 256.0);
  if (!(*c.query_pre_attn_scalar > 0)) cfg::fail(where, "query_pre_attn_scalar", "must be positive");
  c.attn_logit_softcapping = cfg::softcap(j, "attn_logit_softcapping", where, attn_cap);
  c.final_logit_softcapping = cfg::softcap(j, "final_logit_softcapping", where, final_cap);
}
void parse_gemma2(const nlohmann::json& j, const std::string& where, DecoderConfig& c) {
  parse_gemma(j, where, c, 50.0, 30.0);
}
void parse_gemma3(const nlohmann::json& j, const std::string& where, DecoderConfig& c) {
  parse_gemma(j, where, c, std::nullopt, std::nullopt);
}

// llama.cpp scales queries by head_dim^-0.5, or by (hidden / heads)^-0.5 when it takes the model
// for the 27B (by its layer count), whatever query_pre_attn_scalar says; it fixes the sliding layers.
void check_gemma(const DecoderConfig& c, const std::string& where, int64_t layers_27b, int64_t period) {
  const double scalar = c.num_hidden_layers == layers_27b ? static_cast<double>(c.hidden_size / c.num_attention_heads)
                                                          : static_cast<double>(c.head_dim);
  if (c.query_pre_attn_scalar && *c.query_pre_attn_scalar != scalar)
    refuse_gguf(where, c, "query_pre_attn_scalar",
                std::to_string(*c.query_pre_attn_scalar) + " where llama.cpp scales queries by " +
                    std::to_string(scalar) + "^-0.5");
  const std::string pattern = sliding_mismatch(c, period);
  if (!pattern.empty()) refuse_gguf(where, c, "layer_types", pattern);
  if (!c.sliding_window) refuse_gguf(where, c, "sliding_window", "null: llama.cpp's Gemma always has sliding layers");
}

void check_gemma2(const DecoderConfig& c, const std::string& where) {
  // llama.cpp's gemma2 always multiplies by the embedding.
  if (!c.tie_word_embeddings)
    refuse_gguf(where, c, "tie_word_embeddings",
                "false: llama.cpp's gemma2 loads no output head of its own (it multiplies by the embedding)");
  check_gemma(c, where, 46, 2);
  if (!c.attn_logit_softcapping)
    refuse_gguf(where, c, "attn_logit_softcapping", "null: llama.cpp's gemma2 always soft-caps attention logits");
  if (!c.final_logit_softcapping)
    refuse_gguf(where, c, "final_logit_softcapping", "null: llama.cpp's gemma2 always soft-caps output logits");
}

void check_gemma3(const DecoderConfig& c, const std::string& where) {
  check_gemma(c, where, 62, 6);
  if (c.attn_logit_softcapping) refuse_gguf(where, c, "attn_logit_softcapping", "gemma3 has no attention soft-cap");
  if (c.final_logit_softcapping) refuse_gguf(where, c, "final_logit_softcapping", "not written for gemma3");
  const modules::RopeParams local = c.local_rope.value_or(modules::RopeParams{});
  if (local.theta != 10000.0 || local.linear_factor != 1.0 || local.llama3)
    refuse_gguf(where, c, "rope_local_base_freq", "llama.cpp's gemma3 gives sliding layers RoPE base 10000, unscaled");
}

void add_gemma2_keys(const DecoderConfig& c, const std::string&, GgufAdditions& out) {
  out.keys.emplace_back("attn_logit_softcapping", static_cast<float>(*c.attn_logit_softcapping));
  out.keys.emplace_back("final_logit_softcapping", static_cast<float>(*c.final_logit_softcapping));
}

Family gemma(const char* name, const char* model_type) {
  Family f;
  f.name = name;
  f.model_types = {model_type};
  f.head_dim = 256;
  f.tie_word_embeddings = true;
  f.activation = modules::MlpActivation::kGeluTanh;
  f.sliding_window = 4096;
  f.gguf.arch = name;
  f.gguf.window_key = true;
  return f;
}

}  // namespace

const Family& gemma2_family() {
  static const Family f = [] {
    Family f = gemma("gemma2", "gemma2");
    f.architecture = gemma2_architecture;
    f.slides = gemma2_slides;
    f.parse = parse_gemma2;
    f.gguf.tensors = gemma_tensor_names(false);
    f.gguf.check = check_gemma2;
    f.gguf.add = add_gemma2_keys;
    return f;
  }();
  return f;
}

const Family& gemma3_family() {
  static const Family f = [] {
    Family f = gemma("gemma3", "gemma3_text");
    f.architecture = gemma3_architecture;
    f.multimodal = Family::Multimodal{"gemma3",
                                      R"({"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                                          "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                                          "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": 1})",
                                      true, /*images_bidirectional=*/true, /*image_token_id=*/262144};
    f.rope_theta = 1e6;
    f.local_rope = LocalRope::kOwnBase;
    f.slides = gemma3_slides;
    f.parse = parse_gemma3;
    f.gguf.tensors = gemma_tensor_names(true);
    f.gguf.linear_rope = true;
    f.gguf.check = check_gemma3;
    f.vision_tower = vision::load_gemma3_tower;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
