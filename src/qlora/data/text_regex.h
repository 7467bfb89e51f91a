// Pre-tokenizer regexes (PCRE2) written for tiktoken's Rust regex engine or HF tokenizers'
// Oniguruma, and the GRPO format rewards' patterns (train/rewards.h). UTF-8 checks and repair (utf8_valid, utf8_replace_invalid) come with it from
// qlora/jinja/utf8.h, the one home of UTF-8.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "qlora/jinja/utf8.h"

namespace qlora::data {

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

  // Whether the pattern matches anywhere in `text` (valid UTF-8). PCRE2 backtracks, but its match
  // and depth limits (10^7 steps by default) bound the work on any text: a pattern that reaches
  // them throws std::runtime_error naming `what` instead of running on.
  bool search(std::string_view text) const;

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string what_;
};

}  // namespace qlora::data
