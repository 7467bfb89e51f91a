// Qwen3: Llama's block with per-head RMSNorm on q and k (q_norm, k_norm), attention biases under
// attention_bias. Its class slides only under use_sliding_window, as Qwen2's does.
// llama.cpp's "qwen3": the q/k norms as attn_q_norm / attn_k_norm, head_dim as key_length.
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

const Architecture& qwen3_architecture() {
  static const Architecture a =
      families::make_architecture("qwen3", families::llama_rows(),
                                  {families::kInputNorm, families::kPostAttnNorm, families::kQNorm, families::kKNorm});
  return a;
}

}  // namespace

const Family& qwen3_family() {
  static const Family f = [] {
    Family f;
    f.name = "qwen3";
    f.model_types = {"qwen3"};
    f.architecture = qwen3_architecture;
    f.sliding_needs_flag = true;
    f.slides = families::qwen_slides;
    f.gguf.arch = "qwen3";
    f.gguf.tensors = families::llama_tensor_names();
    f.gguf.tensors.insert(f.gguf.tensors.end(),
                          {{"self_attn.q_norm", "attn_q_norm"}, {"self_attn.k_norm", "attn_k_norm"}});
    f.gguf.window_refused = true;
    f.gguf.linear_rope = true;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
