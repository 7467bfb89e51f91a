// Writes the randomly initialised tiny base for tests that need the embedded default's base of
// an earlier release (tests/data/legacy_resume was trained on it):
//
//   tiny_base_tool DIR TOKENIZER VOCAB     DIR/{config.json, model.safetensors, tokenizer.model}
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "qlora/train/tiny_default.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: tiny_base_tool DIR TOKENIZER VOCAB\n");
    return 2;
  }
  try {
    std::filesystem::create_directories(argv[1]);
    qlora::train::write_random_tiny_base(argv[1], argv[2], std::stoll(argv[3]));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny_base_tool: %s\n", e.what());
    return 1;
  }
  return 0;
}
