// Fixtures shared by the model tests: the tiny Llama checkpoint ctest points QLORA_TEST_DATA at,
// and the message parse_llama_config gives a config text.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "qlora/models/llama_config.h"

namespace qlora::models::test_fixtures {

inline std::string tiny_llama() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/tiny_llama";
}

inline double max_abs(const at::Tensor& a) { return a.abs().max().item<double>(); }

// The error parse_llama_config throws for `json` (read as "cfg.json"); "" when it parses.
inline std::string error_of(const std::string& json) {
  try {
    parse_llama_config(json, "cfg.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace qlora::models::test_fixtures
