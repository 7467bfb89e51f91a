// What a GGUF export (checkpoint.gguf, `qlora gguf`) reads of the user's tokenizer, from untrusted
// bytes: a sentencepiece tokenizer.model (our protobuf reader) or an HF tokenizer.json (vocabulary,
// merges, added tokens, pre-tokenizer and normalizer), turned into the tokenizer.* metadata of
// the GGUF. The first byte picks the file; the rest is its content.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "qlora/gguf/sentencepiece_model.h"
#include "qlora/gguf/tokenizer_meta.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const fs::path dir = fs::temp_directory_path() / ("qlora_fuzz_gguf_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const bool sentencepiece = data[0] & 1;
  const fs::path file = dir / (sentencepiece ? "tokenizer.model" : "tokenizer.json");
  std::ofstream(file, std::ios::binary).write(reinterpret_cast<const char*>(data + 1), static_cast<std::streamsize>(size - 1));
  try {
    if (sentencepiece) (void)qlora::gguf::read_sentencepiece_model(file.string());
    std::vector<std::pair<std::string, qlora::gguf::Value>> metadata;
    qlora::gguf::add_tokenizer_metadata(dir.string(), 1024, metadata);
  } catch (const std::exception&) {
  }
  return 0;
}
