// The embedded default of `qlora run lora_finetune`: a tiny Llama-shaped model written once as an
// HF checkpoint directory (so the real loading path runs), the bundled tokenizer and data set.
#pragma once

#include <string>

namespace qlora::train {

// Where the bundled data lives: $QLORA_DATA_DIR, else the source tree's tests/data.
std::string bundled_data_dir();

// Writes <dir> (config.json, model.safetensors, tokenizer.model) unless it already holds a
// complete one; deterministic (fixed seed), committed atomically. Returns dir.
std::string ensure_tiny_base(const std::string& dir);

}  // namespace qlora::train
