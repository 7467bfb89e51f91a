// A tokenizer file from untrusted bytes, as Tokenizer::open reads one: tokenizer.json (a file
// starting with '{'), a sentencepiece model, or a tiktoken file. What loads then encodes and
// decodes a fixed text (added and special tokens, bytes outside ASCII, digits, spaces). An error of
// open() that does not name the file (a bare library message) is a finding.
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "qlora/data/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = qlora::fuzz::input_file(data, size, "tokenizer.input");
  std::optional<qlora::data::Tokenizer> opened;
  try {
    opened.emplace(qlora::data::Tokenizer::open(path));
  } catch (const std::exception& e) {
    if (std::string(e.what()).find(path) == std::string::npos) __builtin_trap();
    return 0;
  }
  try {
    const auto& tok = *opened;
    const auto ids = tok.encode("Hello, world! 1234  <|eot_id|> <s> caf\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd\n\ttabs");
    (void)tok.decode(ids);
  } catch (const std::exception&) {
  }
  return 0;
}
