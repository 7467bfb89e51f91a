// What Qwen3.5 (qwen3_5.cpp) shares with Qwen3.5-MoE (qwen3_5_moe.cpp): the Gated DeltaNet hybrid's
// rows and norms, its config keys, and how llama.cpp's qwen35 / qwen35moe write it.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>
#include <vector>

#include "qlora/models/architecture.h"
#include "qlora/models/family.h"

namespace qlora::models::families {

// The attention and Gated DeltaNet rows, then `ffn` (the feed-forward's rows), then the output row.
std::vector<ProjectionRow> qwen35_rows(const std::vector<ProjectionRow>& ffn);
// The layer norms, the DeltaNet's conv weight, A_log, dt_bias and gated norm.
std::vector<NormRow> qwen35_norms();
// What the hybrid's config says beyond a Llama block: (1 + w) norms, the output gate, the DeltaNet's sizes.
void parse_qwen35(const nlohmann::json& j, const std::string& where, DecoderConfig& c);
// The Family fields both share (head_dim, rotary share, DeltaNet layers, GGUF tensors and keys); the
// caller sets its name, model types, architecture, parse and GGUF architecture.
void qwen35_family_base(Family& f);
// The DeltaNet's GGUF keys (gguf.add of qwen35).
void add_qwen35_keys(const DecoderConfig& c, const std::string& where, GgufAdditions& out);
// The DeltaNet's GGUF tensors (gguf.tensor of qwen35).
std::optional<TensorPlan> qwen35_tensor(const std::string& hf, const DecoderConfig& c);
// What llama.cpp's qwen35 fixes (gguf.check of qwen35).
void check_qwen35(const DecoderConfig& c, const std::string& where);

}  // namespace qlora::models::families
