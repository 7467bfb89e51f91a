// Qwen2 and Qwen2.5: Llama's block with q/k/v biases (always; the config has no attention_bias key).
// Its class slides only under use_sliding_window, on the layers from max_window_layers on.
// llama.cpp's "qwen2": the biases as they are, no Q/K permutation, no sliding window.
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {

namespace {

const Architecture& qwen2_architecture() {
  static const Architecture a = families::make_architecture(
      "qwen2", families::llama_rows(Bias::kAlways, Bias::kNone), {families::kInputNorm, families::kPostAttnNorm});
  return a;
}

}  // namespace

const Family& qwen2_family() {
  static const Family f = [] {
    Family f;
    f.name = "qwen2";
    f.model_types = {"qwen2"};
    f.architecture = qwen2_architecture;
    f.attention_bias = AttentionBiasKey::kIgnored;
    f.sliding_needs_flag = true;
    f.slides = families::qwen_slides;
    f.gguf.arch = "qwen2";
    f.gguf.tensors = families::llama_tensor_names();
    f.gguf.qkv_bias = true;
    f.gguf.window_refused = true;
    f.gguf.linear_rope = true;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
