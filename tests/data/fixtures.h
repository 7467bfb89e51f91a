// Fixtures shared by the data tests: the directory ctest points QLORA_TEST_DATA at, and the
// bundled sentencepiece tokenizer.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
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

// Writes `text` to the file `name` in the test's temporary directory; returns its path.
inline std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "qlora_tok_" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The message of the error Tokenizer::open throws for a file holding `text`, checked to name the
// file; a test failure (and "") when it opens.
inline std::string open_error(const std::string& name, const std::string& text) {
  const std::string path = write_temp(name, text);
  try {
    Tokenizer::open(path);
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    return what;
  }
  ADD_FAILURE() << name << ": expected an error";
  return "";
}

}  // namespace qlora::data::test_fixtures
