// Reading a whole (small) file: configs, manifests, data sets, tokenizer files. Every concern
// throws its own error naming the file, so this only reports whether it could.
#pragma once

#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace qlora::io {

// The file's bytes, or nullopt when it cannot be opened or read (errno tells why).
inline std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return ss.str();
}

}  // namespace qlora::io
