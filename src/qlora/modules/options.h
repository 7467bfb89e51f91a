// Plain option types as HF configs name them: models/ parses them, modules/ applies them.
#pragma once
#include <cstdint>
#include <optional>

namespace qlora::modules {

// rope_type "llama3" (Llama-3.1): low frequencies are divided by `factor`, high ones kept, the
// band between interpolated. Parameters as named in the HF config.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// One set of rotary frequencies: base theta, then at most one scaling ("llama3", or "linear":
// every frequency divided by linear_factor, as Gemma 3's global layers use).
struct RopeParams {
  double theta = 10000.0;
  std::optional<Llama3RopeScaling> llama3;
  double linear_factor = 1.0;
};

// The gated MLP's activation: HF "silu" (Llama, Qwen, Phi-3) or "gelu_pytorch_tanh" (Gemma).
enum class MlpActivation { kSilu, kGeluTanh };

}  // namespace qlora::modules
