// Fixtures shared by the data tests: the directory ctest points QLORA_TEST_DATA at, and the
// bundled sentencepiece tokenizer.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
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

// The message of the std::invalid_argument that `fn` throws ("" if none).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
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

// A Llama-2-style file: Prepend/Replace normalizers, byte_fallback, the usual decoder. "▁ a" is
// merged before "a b" because it comes first in merges, though "ab" has the lower id.
inline nlohmann::json spm_style() {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {"ab", 3}, {"▁", 4}, {"a", 5}, {"b", 6}, {"▁a", 7}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 8 + b;
  }
  return {{"version", "1.0"},
          {"added_tokens",
           {{{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
            {{"id", 2}, {"content", "</s>"}, {"special", true}, {"normalized", false}}}},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers",
             {{{"type", "Prepend"}, {"prepend", "▁"}},
              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
              {{"type", "ByteFallback"}},
              {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model",
           {{"type", "BPE"}, {"unk_token", "<unk>"}, {"byte_fallback", true}, {"fuse_unk", true},
            {"vocab", vocab}, {"merges", {"▁ a", "a b"}}}}};
}

}  // namespace qlora::data::test_fixtures
