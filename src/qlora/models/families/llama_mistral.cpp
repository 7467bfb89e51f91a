// Llama-2, Llama-3/3.1 (GQA, llama3 RoPE scaling) and Mistral (a sliding window on every layer):
// the same weights, Mistral differing only in config values. llama.cpp's "llama": Q/K rows permuted
// to its interleaved order; Llama-3's RoPE scaling as a rope_freqs.weight tensor (one divisor a
// frequency), linear scaling as rope.scaling.* keys. llama.cpp's llama has no sliding window: a
// Mistral window shorter than max_position_embeddings becomes the file's context_length (within it,
// every key is inside the window, so the computation is exact).
#include "qlora/models/families/blocks.h"
#include "qlora/models/family.h"

namespace qlora::models {

const Architecture& llama_architecture() {
  static const Architecture a = families::make_architecture("llama", families::llama_rows(),
                                                            {families::kInputNorm, families::kPostAttnNorm});
  return a;
}

const Family& llama_family() {
  static const Family f = [] {
    Family f;
    f.name = "llama";
    f.model_types = {"llama", "mistral"};
    f.architecture = llama_architecture;
    f.gguf.arch = "llama";
    f.gguf.tensors = families::llama_tensor_names();
    f.gguf.permute_qk = true;
    f.gguf.window_as_context = true;
    f.gguf.linear_rope = true;
    f.gguf.llama3_rope = true;
    return f;
  }();
  return f;
}

}  // namespace qlora::models
