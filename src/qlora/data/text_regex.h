// Text helpers the tokenizers share: UTF-8 checks and repair, and pre-tokenizer regexes (PCRE2)
// written for tiktoken's Rust regex engine or HF tokenizers' Oniguruma.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace qlora::data {

// Length of the UTF-8 character at s[i] when it is well-formed (ok = true); otherwise the length
// of its maximal ill-formed subpart (at least 1, ok = false), the unit Python replaces with one
// U+FFFD.
size_t utf8_step(std::string_view s, size_t i, bool& ok);
bool utf8_valid(std::string_view s);

// `bytes` with each maximal ill-formed UTF-8 subsequence replaced by U+FFFD, which is what
// Python's bytes.decode("utf-8", errors="replace") (and so tiktoken's decode) produces, and Rust's
// String::from_utf8_lossy (HF tokenizers' decoders) too.
std::string utf8_replace_invalid(std::string_view bytes);

// A compiled pre-tokenizer pattern. \s and \S are rewritten to Unicode White_Space, which is
// what both Rust's regex and Oniguruma mean by them (PCRE2's \s also takes U+180E).
class TextRegex {
 public:
  // Throws std::invalid_argument naming `what` (the file or component) and the PCRE2 error.
  TextRegex(std::string_view pattern, const std::string& what);
  ~TextRegex();
  TextRegex(const TextRegex&) = delete;
  TextRegex& operator=(const TextRegex&) = delete;

  // Calls on_match(begin, end) for each non-empty match in `text`, left to right; `text` is the
  // whole subject, so a lookahead such as (?!\S) does not see past it. `text` must be valid
  // UTF-8. Empty matches are stepped over by one character.
  void for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const;

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string what_;
};

}  // namespace qlora::data
