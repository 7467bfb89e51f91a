// Fixtures shared by the data tests: the directory ctest points QLORA_TEST_DATA at, and the
// bundled sentencepiece tokenizer.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "qlora/data/tokenizer.h"

namespace qlora::data::test_fixtures {

inline std::string data_dir() {
  const char* dir = std::getenv("QLORA_TEST_DATA");
  if (dir == nullptr) throw std::runtime_error("QLORA_TEST_DATA is not set (ctest sets it)");
  return dir;
}

inline Tokenizer fixture_tokenizer() { return Tokenizer::open(data_dir() + "/tokenizer/tokenizer.model"); }

}  // namespace qlora::data::test_fixtures
