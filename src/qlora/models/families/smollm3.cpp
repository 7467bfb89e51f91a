// SmolLM3: Llama's block, tied embeddings by default, and no RoPE on the layers no_rope_layers marks
// (NoPE; without the key every no_rope_layer_interval-th layer). Its class slides only under
// use_sliding_window, as Qwen's does. llama.cpp's "smollm3" (its converter's LlamaModel: Q/K rows
// permuted) leaves RoPE out of every fourth layer whatever the config says (the file has no key for
// it), so a config that differs is refused.
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {
namespace {

const Architecture& smollm3_architecture() {
  static const Architecture a = families::make_architecture("smollm3", families::llama_rows(),
                                                            {families::kInputNorm, families::kPostAttnNorm});
  return a;
}

void check_nope(const DecoderConfig& c, const std::string& where) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const bool nope = (i + 1) % 4 == 0;
    if (c.uses_rope(i) == nope)
      refuse_gguf(where, c, "no_rope_layers", "layer " + std::to_string(i) + (nope ? " rotates" : " has no RoPE") +
                                                  " where llama.cpp leaves RoPE out of every fourth layer only");
  }
}

}  // namespace

const Family& smollm3_family() {
  static const Family f = [] {
    Family f;
    f.name = "smollm3";
    f.model_types = {"smollm3"};
    f.architecture = smollm3_architecture;
    f.tie_word_embeddings = true;
    f.sliding_needs_flag = true;
    f.slides = families::qwen_slides;
    f.nope_layers = true;
    f.gguf.arch = "smollm3";
    f.gguf.tensors = families::llama_tensor_names();
    f.gguf.permute_qk = true;
    f.gguf.window_refused = true;
    f.gguf.check = check_nope;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
