// UTF-8, one way: ICU's U8_NEXT / U8_APPEND (unicode/utf8.h) behind the names the code base uses,
// here because jinja/ is the lowest folder that reads text (data/ builds on it).
//
// Ill-formed input is never guessed at: each maximal ill-formed subpart (a stray trail byte, a
// truncated sequence, an overlong form, a surrogate, anything past U+10FFFF) is one unit, the unit
// Python's bytes.decode("utf-8", errors="replace") and Rust's from_utf8_lossy turn into one U+FFFD.
// What a caller does with such a unit is its own choice, written where it calls: replace it
// (utf8_replace_invalid), refuse it (utf8_valid), or carry its bytes through unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <unicode/utf8.h>

namespace qlora {

inline constexpr int32_t kUtf8Invalid = -1;

// The code point that starts at s[i], moving i past it; an ill-formed subpart gives kUtf8Invalid
// and moves i past that subpart (at least one byte). Requires i < s.size().
inline int32_t utf8_next(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  int32_t c;
  U8_NEXT(p, i, s.size(), c);
  return c < 0 ? kUtf8Invalid : c;
}

// The code point that ends just before s[i], moving i back to its first byte, never before
// `start`; when no well-formed character ends there: kUtf8Invalid, i moved back one byte.
// Requires start < i. (ICU's U8_PREV takes 32-bit offsets; this reads forward from the lead byte.)
inline int32_t utf8_prev(std::string_view s, size_t start, size_t& i) {
  size_t lead = i - 1;
  while (lead > start && i - lead < U8_MAX_LENGTH && U8_IS_TRAIL(static_cast<uint8_t>(s[lead]))) --lead;
  size_t end = lead;
  const int32_t c = utf8_next(s.substr(0, i), end);
  if (c == kUtf8Invalid || end != i) {
    i -= 1;
    return kUtf8Invalid;
  }
  i = lead;
  return c;
}

// Appends a Unicode scalar value; a surrogate or a value past U+10FFFF, which UTF-8 cannot carry,
// appends U+FFFD instead (callers that must refuse them check first).
void utf8_append(std::string& out, uint32_t code_point);

bool utf8_valid(std::string_view s);
// `bytes` with each maximal ill-formed subpart replaced by U+FFFD (Python's errors="replace").
std::string utf8_replace_invalid(std::string_view bytes);
// The characters of s, each as its bytes; an ill-formed unit is one character, kept as it is.
std::vector<std::string> utf8_chars(std::string_view s);
// The number of characters utf8_chars gives (Python's len() on valid text).
int64_t utf8_length(std::string_view s);

}  // namespace qlora
