// A model's config.json from untrusted bytes, as load_decoder reads it (every family's keys, rope
// scaling, windows, soft-capping, a multimodal model's text_config).
#include <cstdint>
#include <exception>
#include <string>

#include "qlora/models/decoder_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    (void)qlora::models::parse_decoder_config(std::string(reinterpret_cast<const char*>(data), size), "config.json");
  } catch (const std::exception&) {
  }
  return 0;
}
