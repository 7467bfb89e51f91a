// Fixtures shared by the model tests: the tiny Llama checkpoint ctest points QLORA_TEST_DATA at,
// and the message parse_decoder_config gives a config text.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/models/decoder.h"
#include "qlora/models/decoder_config.h"

namespace qlora::models::test_fixtures {

inline std::string tiny_llama() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/tiny_llama";
}

inline double max_abs(const at::Tensor& a) { return a.abs().max().item<double>(); }

inline at::Generator seeded(uint64_t s) { return at::make_generator<at::CPUGeneratorImpl>(s); }

// max |a - ref| / max |ref|, in fp64.
inline double rel_err(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>() /
         std::max(ref.to(at::kDouble).abs().max().item<double>(), 1e-30);
}

// Standard normal fp32 values of `shape` from seed, times scale.
inline at::Tensor randn(at::IntArrayRef shape, uint64_t seed, double scale = 1.0) {
  return at::randn(shape, seeded(seed), at::TensorOptions().dtype(at::kFloat)) * scale;
}

// Unit hook calls as strings: "bf3" before_forward(3), "af3r" after_forward(3) of a replay, "bb3",
// "ab3" for the backward ones.
struct HookRecorder : UnitHooks {
  std::vector<std::string> events;
  void before_forward(int64_t u, bool r) override { events.push_back("bf" + std::to_string(u) + (r ? "r" : "")); }
  void after_forward(int64_t u, bool r) override { events.push_back("af" + std::to_string(u) + (r ? "r" : "")); }
  void before_backward(int64_t u) override { events.push_back("bb" + std::to_string(u)); }
  void after_backward(int64_t u) override { events.push_back("ab" + std::to_string(u)); }
};

// The error parse_decoder_config throws for `json` (read as "cfg.json"); "" when it parses.
inline std::string error_of(const std::string& json) {
  try {
    parse_decoder_config(json, "cfg.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace qlora::models::test_fixtures
