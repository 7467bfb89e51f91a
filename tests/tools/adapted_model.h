// The adapted model the peft and TRL conformance tools (export_tool, dpo_tool) compare: an HF
// directory's base in full precision, LoRA r=8 alpha=16 on `targets` (PEFT names; every Llama
// projection when empty), A drawn as peft draws it from `seed`, B random (x0.05, from seed + 1) so
// that the adapted model differs from the base, and with DoRA each magnitude moved off its row
// norms by a random factor 1 + 0.1·N(0, 1).
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "qlora/models/decoder.h"

namespace qlora::test_tools {

inline constexpr int64_t kRank = 8;
inline constexpr double kAlpha = 16.0;

// "q_proj,k_proj" -> {"q_proj", "k_proj"} (the tools' --targets); "" -> {} (the default).
inline std::vector<std::string> split_targets(const std::string& csv) {
  std::vector<std::string> out;
  std::stringstream s(csv);
  for (std::string t; std::getline(s, t, ',');) out.push_back(t);
  return out;
}

inline models::DecoderModel adapted_model(const std::string& checkpoint, std::vector<std::string> targets, uint64_t seed,
                                        bool dora, bool rslora) {
  models::DecoderLoadOptions opt;
  opt.lora_targets = targets.empty() ? models::layer_peft_names(models::llama_architecture()) : std::move(targets);
  opt.lora_r = kRank;
  opt.lora_alpha = kAlpha;
  opt.seed = seed;
  opt.lora_use_dora = dora;
  opt.lora_use_rslora = rslora;
  models::DecoderModel m = models::load_decoder(checkpoint, opt);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
  const c10::NoGradGuard g;
  for (auto& [name, t] : m.lora_parameters()) {
    if (name.find("lora_B") != std::string::npos) t.copy_(at::randn(t.sizes(), gen, t.options()).mul_(0.05));
    if (name.find("lora_magnitude") != std::string::npos) t.mul_(at::randn(t.sizes(), gen, t.options()).mul_(0.1).add_(1.0));
  }
  return m;
}

}  // namespace qlora::test_tools
