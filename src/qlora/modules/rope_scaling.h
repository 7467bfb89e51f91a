// RoPE frequency scaling as HF configs name it (models/ parses it; modules/ applies it).
#pragma once
#include <cstdint>

namespace qlora::modules {

// rope_type "llama3" (Llama-3.1): low frequencies are divided by `factor`, high ones kept, the
// band between interpolated. Parameters as named in the HF config.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

}  // namespace qlora::modules
