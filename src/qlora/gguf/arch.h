// The llama.cpp architecture a model is written as: general.architecture, the {arch}.* metadata keys
// llama.cpp's loader reads, the HF -> GGUF tensor names and the value transforms llama.cpp's
// converter (convert_hf_to_gguf.py) applies, as that converter writes them. What differs between
// families is each family's (models/families/<family>.cpp, Family::gguf): its architecture name,
// tensor names, extra keys and tensors, and what llama.cpp fixes that a config may say otherwise.
// Here: the keys every family writes, the RoPE scalings llama.cpp reads (linear as rope.scaling.*
// keys, Llama-3's as a rope_freqs tensor, YaRN as rope.scaling.yarn_*), the window, and the layer
// tensors of the family's table (Q/K rows permuted where llama.cpp's architecture rotates
// interleaved pairs; (1 + w) norms stored as w + 1).
//
// What cannot be described exactly (another activation, biases where llama.cpp loads none, a
// RoPE scaling the architecture does not read, a window llama.cpp would not apply) is refused with
// std::invalid_argument naming the config key, before any file is opened.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qlora/gguf/writer.h"
#include "qlora/models/decoder_config.h"

namespace qlora::gguf {

using Metadata = std::vector<std::pair<std::string, Value>>;

using models::ExtraTensor;
using models::HeadRegroup;
using models::TensorPlan;

struct ArchPlan {
  std::string arch;                // general.architecture
  Metadata metadata;               // the {arch}.* keys
  std::vector<ExtraTensor> extra;  // written before the checkpoint's tensors
  std::vector<std::string> notes;  // what the file does differently from the config, for the log
};

// The plan for config `c`; throws std::invalid_argument prefixed with `where` when `c` has
// something the architecture cannot compute exactly.
ArchPlan plan_architecture(const models::DecoderConfig& c, const std::string& where);

// The GGUF tensor of a text-only HF key ("model.layers.3.self_attn.q_proj.weight",
// "lm_head.weight", ".bias" keys, Qwen3.5's "model.layers.0.linear_attn.A_log"); nullopt when the
// architecture has no such tensor.
std::optional<TensorPlan> gguf_tensor(const std::string& hf, const models::DecoderConfig& c);

}  // namespace qlora::gguf
