#include "qlora/data/text_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <new>
#include <stdexcept>

namespace qlora::data {

namespace {

// tiktoken's patterns are written for Rust's regex engine and HF's for Oniguruma, where \s is Unicode
// White_Space.
// PCRE2's \s (with UCP) also matches U+180E, which left White_Space in Unicode 6.3; spelling the
// class out makes both engines split text at the same places.
std::string pcre2_syntax(std::string_view pattern) {
  const std::string ws =
      R"(\t-\r \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') out += in_class ? ws : "[" + ws + "]";
      else if (e == 'S' && !in_class) out += "[^" + ws + "]";
      else if (e == 'S') throw std::invalid_argument("\\S inside [...] is not supported");
      else out += {c, e};
      continue;
    }
    if (c == '[') in_class = true;
    else if (c == ']') in_class = false;
    out += c;
  }
  return out;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(const pcre2_code* code) : md(pcre2_match_data_create_from_pattern(code, nullptr)) {
    if (md == nullptr) throw std::bad_alloc();
  }
  ~MatchData() { pcre2_match_data_free(md); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
};

}  // namespace

struct TextRegex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

TextRegex::TextRegex(std::string_view pattern, const std::string& what) : code_(std::make_unique<Code>()), what_(what) {
  std::string re;
  try {
    re = pcre2_syntax(pattern);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(what + ": pattern " + std::string(pattern) + ": " + e.what());
  }
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(), PCRE2_UTF | PCRE2_UCP, &err,
                              &err_offset, nullptr);
  if (code_->code == nullptr) {
    throw std::invalid_argument(what + ": pattern: " + pcre2_message(err) + " at offset " +
                                std::to_string(err_offset) + " of " + re);
  }
  // JIT makes matching several times faster; without it (unsupported CPU) the interpreter runs.
  pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE);
}

TextRegex::~TextRegex() = default;

void TextRegex::for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const {
  if (text.empty()) return;
  MatchData m(code_->code);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  for (size_t pos = 0; pos < text.size();) {
    const int rc = pcre2_match(code_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, m.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw std::runtime_error(what_ + ": pre-tokenizer regex: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    if (ov[1] == ov[0]) {  // an empty match (none in the shipped patterns): step over a character
      pos = ov[0];
      utf8_next(text, pos);
      continue;
    }
    on_match(ov[0], ov[1]);
    pos = ov[1];
  }
}

bool TextRegex::search(std::string_view text) const {
  MatchData m(code_->code);
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, PCRE2_NO_UTF_CHECK,
                             m.md, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) throw std::runtime_error(what_ + ": " + pcre2_message(rc) + " on a text of " + std::to_string(text.size()) + " bytes");
  return true;
}

}  // namespace qlora::data
