// Phi-3: q/k/v stacked in one qkv_proj and gate/up in one gate_up_proj (PEFT targets the fused
// modules; a config may name all their parts), no attention biases, rms_norm_eps 1e-5, a window on
// every layer. llama.cpp's "phi3": attn_qkv and ffn_up (gate and up stacked, gate first) as they are;
// it reads the window but applies none, so a window shorter than the context becomes the
// context_length, as for Mistral.
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

using modules::DecoderLayer;

const Architecture& phi3_architecture() {
  static const Architecture a = families::make_architecture(
      "phi3",
      {
          {"qkv", "qkv_proj", "model.layers.{i}.self_attn.qkv_proj", &DecoderLayer::qkv_proj, Dim::kQkv, Dim::kHidden,
           {"q", "k", "v"}},
          {"o", "o_proj", "model.layers.{i}.self_attn.o_proj", &DecoderLayer::o_proj, Dim::kHidden, Dim::kQHeads, {}},
          {"gate_up", "gate_up_proj", "model.layers.{i}.mlp.gate_up_proj", &DecoderLayer::gate_up_proj, Dim::kGateUp,
           Dim::kHidden, {"gate", "up"}},
          {"down", "down_proj", "model.layers.{i}.mlp.down_proj", &DecoderLayer::down_proj, Dim::kHidden,
           Dim::kIntermediate, {}},
          {"output", "lm_head", "lm_head", nullptr, Dim::kVocab, Dim::kHidden, {}},
      },
      {families::kInputNorm, families::kPostAttnNorm});
  return a;
}

}  // namespace

const Family& phi3_family() {
  static const Family f = [] {
    Family f;
    f.name = "phi3";
    f.model_types = {"phi3"};
    f.architecture = phi3_architecture;
    f.rms_norm_eps = 1e-5;
    f.attention_bias = AttentionBiasKey::kRefused;
    f.gguf.arch = "phi3";
    f.gguf.tensors = {{"self_attn.qkv_proj", "attn_qkv"},
                      {"self_attn.o_proj", "attn_output"},
                      {"mlp.gate_up_proj", "ffn_up"},  // gate and up stacked, as llama.cpp's phi3 splits it
                      {"mlp.down_proj", "ffn_down"},
                      {"input_layernorm", "attn_norm"},
                      {"post_attention_layernorm", "ffn_norm"}};
    f.gguf.window_key = true;
    f.gguf.window_as_context = true;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
