#include "qlora/jinja/utf8.h"

namespace qlora {

void utf8_append(std::string& out, uint32_t code_point) {
  uint8_t buf[U8_MAX_LENGTH];
  size_t n = 0;
  bool error = false;
  U8_APPEND(buf, n, U8_MAX_LENGTH, code_point, error);
  if (error) {
    n = 0;
    U8_APPEND_UNSAFE(buf, n, 0xFFFD);
  }
  out.append(reinterpret_cast<const char*>(buf), n);
}

bool utf8_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (utf8_next(s, i) == kUtf8Invalid) return false;
  }
  return true;
}

std::string utf8_replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const size_t start = i;
    if (utf8_next(bytes, i) == kUtf8Invalid) out.append("\xEF\xBF\xBD");  // U+FFFD
    else out.append(bytes.substr(start, i - start));
  }
  return out;
}

std::vector<std::string> utf8_chars(std::string_view s) {
  std::vector<std::string> chars;
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    utf8_next(s, i);
    chars.emplace_back(s.substr(start, i - start));
  }
  return chars;
}

int64_t utf8_length(std::string_view s) {
  int64_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) utf8_next(s, i);
  return n;
}

}  // namespace qlora
