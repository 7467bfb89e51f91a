#include "qlora/jinja/lexer.h"

#include <cctype>
#include <cstdlib>

#include "qlora/jinja/template.h"
#include "qlora/jinja/value.h"

namespace qlora::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
 public:
  Lexer(std::string source, const std::string& origin) : src_(std::move(source)), origin_(origin) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      size_t open = find_tag(pos_);
      if (open == std::string::npos) {
        push_text(src_.substr(pos_), pos_);
        break;
      }
      std::string text = src_.substr(pos_, open - pos_);
      char kind = src_[open + 1];
      char sign = open + 2 < src_.size() && (src_[open + 2] == '-' || src_[open + 2] == '+') ? src_[open + 2] : 0;
      strip_before(text, kind, sign);
      push_text(text, pos_);
      pos_ = open + 2 + (sign ? 1 : 0);
      line_starting_ = false;
      if (kind == '#') {
        comment(open);
      } else if (kind == '%' && raw_begin()) {
        raw(open);
      } else {
        tag(kind, open);
      }
    }
    out_.push_back(make(Tok::kEnd, "", src_.size()));
    return out_;
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return std::string::npos;
  }

  // `{%-` strips all whitespace before the tag; with lstrip_blocks a block or comment tag (not a
  // {{ }}) that only indentation separates from the start of its line takes that indentation.
  void strip_before(std::string& text, char kind, char sign) const {
    if (sign == '-') {
      size_t end = text.size();
      while (end > 0 && is_space(text[end - 1])) --end;
      text.resize(end);
    } else if (sign != '+' && kind != '{') {
      size_t line_start = text.rfind('\n');
      line_start = line_start == std::string::npos ? 0 : line_start + 1;
      if (line_start == 0 && !line_starting_) return;
      if (line_start == text.size()) return;
      for (size_t k = line_start; k < text.size(); ++k) {
        if (!is_space(text[k])) return;
      }
      text.resize(line_start);
    }
  }

  // After a tag: `-` strips all following whitespace; trim_blocks drops one newline after a block
  // or comment unless `+` keeps it. jinja2 then lstrips the next tag only if this consumed "\n".
  void after_end(char sign, bool trim_newline) {
    if (sign == '-') {
      while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
    } else if (sign != '+' && trim_newline && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    }
    line_starting_ = pos_ > 0 && src_[pos_ - 1] == '\n';
  }

  void comment(size_t open) {
    size_t close = src_.find("#}", pos_);
    if (close == std::string::npos) fail(open, "Missing end of comment tag");
    char sign = close > pos_ && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : 0;
    pos_ = close + 2;
    after_end(sign, true);
  }

  // `{% raw %}` (any whitespace, optional -/+): the text up to `{% endraw %}` is output verbatim.
  bool raw_begin() {
    size_t q = pos_;
    while (q < src_.size() && is_space(src_[q])) ++q;
    if (src_.compare(q, 3, "raw") != 0) return false;
    q += 3;
    while (q < src_.size() && is_space(src_[q])) ++q;
    return src_.compare(q, 2, "%}") == 0 || src_.compare(q, 3, "-%}") == 0;
  }

  void raw(size_t open) {
    while (src_[pos_] != '%' && src_[pos_] != '-') ++pos_;
    bool strip = src_[pos_] == '-';
    pos_ += strip ? 3 : 2;
    if (strip) after_end('-', false);  // jinja2 applies no trim_blocks after {% raw %}
    for (size_t p = find_tag(pos_); p != std::string::npos; p = find_tag(p + 1)) {
      if (src_[p + 1] != '%') continue;
      size_t q = p + 2;
      char sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      if (sign) ++q;
      while (q < src_.size() && is_space(src_[q])) ++q;
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q += 6;
      while (q < src_.size() && is_space(src_[q])) ++q;
      char end_sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      if (src_.compare(q + (end_sign ? 1 : 0), 2, "%}") != 0) continue;
      std::string text = src_.substr(pos_, p - pos_);
      strip_before(text, '%', sign);
      push_text(text, pos_);
      pos_ = q + (end_sign ? 1 : 0) + 2;
      after_end(end_sign, true);
      return;
    }
    fail(open, "Missing end of raw directive");
  }

  void tag(char kind, size_t open) {
    out_.push_back(make(kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", open));
    int depth = 0;
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
      if (pos_ >= src_.size()) fail(open, kind == '{' ? "unexpected end of template, expected '}}'"
                                                      : "unexpected end of template, expected '%}'");
      if (depth == 0 && end_of_tag(kind)) return;
      char c = src_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        name();
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        number();
      } else if (c == '\'' || c == '"') {
        string_literal();
      } else {
        op(depth);
      }
    }
  }

  bool end_of_tag(char kind) {
    char close = kind == '{' ? '}' : '%';
    char sign = 0;
    size_t p = pos_;
    if ((src_[p] == '-' || (src_[p] == '+' && kind == '%')) && p + 1 < src_.size() && src_[p + 1] == close) {
      sign = src_[p];
      ++p;
    }
    if (src_.compare(p, 2, std::string(1, close) + "}") != 0) return false;
    out_.push_back(make(kind == '{' ? Tok::kVarEnd : Tok::kBlockEnd, "", pos_));
    pos_ = p + 2;
    after_end(sign, kind == '%');
    return true;
  }

  void name() {
    size_t start = pos_;
    while (pos_ < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_')) ++pos_;
    out_.push_back(make(Tok::kName, src_.substr(start, pos_ - start), start));
  }

  void number() {
    size_t start = pos_;
    auto digits = [&] {
      while (pos_ < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_')) ++pos_;
    };
    digits();
    // After an attribute dot (`foo.0`) a number is an integer, as jinja2's float rule says.
    bool after_dot = !out_.empty() && out_.back().type == Tok::kOp && out_.back().text == ".";
    bool is_float = false;
    if (!after_dot && pos_ + 1 < src_.size() && src_[pos_] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[pos_ + 1]))) {
      ++pos_;
      digits();
      is_float = true;
    }
    if (!after_dot && pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t p = pos_ + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]))) {
        pos_ = p;
        digits();
        is_float = true;
      }
    }
    std::string text;
    for (size_t k = start; k < pos_; ++k) {
      if (src_[k] != '_') text += src_[k];
    }
    Token t = make(is_float ? Tok::kFloat : Tok::kInt, text, start);
    if (is_float) {
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
    }
    out_.push_back(t);
  }

  // Python's escapes (jinja2 decodes literals with unicode-escape); unknown ones stay as written.
  void string_literal() {
    size_t start = pos_;
    char quote = src_[pos_++];
    std::string value;
    while (true) {
      if (pos_ >= src_.size()) fail(start, "unexpected end of string literal");
      char c = src_[pos_++];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        continue;
      }
      if (pos_ >= src_.size()) fail(start, "unexpected end of string literal");
      char e = src_[pos_++];
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case 'a': value += '\a'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case '\n': break;
        case 'x': value_hex(value, 2, start); break;
        case 'u': value_hex(value, 4, start); break;
        case 'U': value_hex(value, 8, start); break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = e - '0';
            for (int k = 0; k < 2 && pos_ < src_.size() && src_[pos_] >= '0' && src_[pos_] <= '7'; ++k) {
              cp = cp * 8 + (src_[pos_++] - '0');
            }
            utf8_append(value, cp);
          } else {
            value += '\\';
            value += e;
          }
      }
    }
    out_.push_back(make(Tok::kString, value, start));
  }

  void value_hex(std::string& value, int digits, size_t start) {
    if (pos_ + digits > src_.size()) fail(start, "truncated \\x, \\u or \\U escape in string literal");
    std::string hex = src_.substr(pos_, digits);
    for (char h : hex) {
      if (!std::isxdigit(static_cast<unsigned char>(h))) fail(start, "malformed \\x, \\u or \\U escape");
    }
    pos_ += digits;
    const auto cp = static_cast<uint32_t>(std::strtoul(hex.c_str(), nullptr, 16));
    // Python reads these (a lone surrogate, or an error past U+10FFFF); UTF-8 has no form for them.
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail(start, "\\u or \\U escape of a surrogate or past U+10FFFF");
    utf8_append(value, cp);
  }

  void op(int& depth) {
    static const char* kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
    for (const char* two : kTwo) {
      if (src_.compare(pos_, 2, two) == 0) {
        out_.push_back(make(Tok::kOp, two, pos_));
        pos_ += 2;
        return;
      }
    }
    char c = src_[pos_];
    if (std::string("+-*/%~<>=()[]{},.:|").find(c) == std::string::npos) {
      fail(pos_, std::string("unexpected char '") + c + "'");
    }
    if (c == '(' || c == '[' || c == '{') ++depth;
    if (c == ')' || c == ']' || c == '}') {
      if (depth == 0) fail(pos_, std::string("unexpected '") + c + "'");
      --depth;
    }
    out_.push_back(make(Tok::kOp, std::string(1, c), pos_));
    ++pos_;
  }

  void push_text(const std::string& text, size_t at) {
    if (!text.empty()) out_.push_back(make(Tok::kText, text, at));
  }

  Token make(Tok type, std::string text, size_t at) const {
    Token t{type, std::move(text)};
    location(at, t.line, t.col);
    return t;
  }

  void location(size_t at, int& line, int& col) const {
    line = 1;
    size_t line_start = 0;
    for (size_t k = 0; k < at && k < src_.size(); ++k) {
      if (src_[k] == '\n') {
        ++line;
        line_start = k + 1;
      }
    }
    col = static_cast<int>(utf8_length(std::string_view(src_).substr(line_start, at - line_start))) + 1;
  }

  [[noreturn]] void fail(size_t at, const std::string& what) const {
    int line, col;
    location(at, line, col);
    throw TemplateError(origin_ + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + what);
  }

  std::string src_;
  const std::string& origin_;
  size_t pos_ = 0;
  bool line_starting_ = true;
  std::vector<Token> out_;
};

// jinja2 splits the source into lines and joins them with "\n", dropping a final empty line.
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      out += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      out += source[k];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

std::vector<Token> tokenize(std::string_view source, const std::string& origin) {
  return Lexer(normalize_newlines(source), origin).run();
}

}  // namespace qlora::jinja
