// A recipe config (TOML) from untrusted bytes, as `qlora run --config` reads it: every section and
// key checked (types, ranges, enums, lora.targets against the architectures), then written back
// with to_toml and parsed again, which must give the same config (the resume check relies on it).
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>

#include "qlora/config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qlora::config::RecipeConfig cfg;
  try {
    cfg = qlora::config::parse_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz.toml");
  } catch (const std::exception&) {
    return 0;  // refused, naming the key: its job
  }
  const std::string text = qlora::config::to_toml(cfg);
  const auto again = qlora::config::parse_config(text, "fuzz.toml (written back)");  // must not throw
  if (qlora::config::to_toml(again) != text) std::abort();  // the round trip must be exact
  return 0;
}
