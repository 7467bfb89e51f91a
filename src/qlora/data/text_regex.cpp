#include "qlora/data/text_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <new>
#include <stdexcept>

namespace qlora::data {

// Length of the UTF-8 character at s[i] when it is well-formed (ok = true); otherwise the length
// of its maximal ill-formed subpart (at least 1, ok = false), the unit Python replaces with one
// U+FFFD. Ranges per the Unicode standard's table of well-formed byte sequences.
size_t utf8_step(std::string_view s, size_t i, bool& ok) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  ok = true;
  if (c < 0x80) return 1;
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;  // no overlong forms
    if (c == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    ok = false;
    return 1;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size() || byte(i + k) < lo || byte(i + k) > hi) {
      ok = false;
      return k;
    }
    lo = 0x80;
    hi = 0xBF;
  }
  return need + 1;
}

bool utf8_valid(std::string_view s) {
  bool ok = true;
  for (size_t i = 0; i < s.size() && ok; i += utf8_step(s, i, ok)) {}
  return ok;
}

std::string utf8_replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  bool ok = true;
  for (size_t i = 0; i < bytes.size();) {
    const size_t n = utf8_step(bytes, i, ok);
    if (ok) out.append(bytes.substr(i, n));
    else out.append("\xEF\xBF\xBD");  // U+FFFD
    i += n;
  }
  return out;
}

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
      bool ok = true;
      pos = ov[0] + utf8_step(text, ov[0], ok);
      continue;
    }
    on_match(ov[0], ov[1]);
    pos = ov[1];
  }
}

}  // namespace qlora::data
