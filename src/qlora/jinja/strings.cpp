#include "qlora/jinja/strings.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include "qlora/jinja/value.h"

namespace qlora::jinja {
namespace {

uint32_t code_point(const std::string& ch) {
  unsigned char c = ch[0];
  if (c < 0x80) return c;
  int extra = c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;
  uint32_t cp = extra == 1 ? (c & 0x1F) : extra == 2 ? (c & 0x0F) : (c & 0x07);
  for (size_t k = 1; k < ch.size(); ++k) cp = (cp << 6) | (ch[k] & 0x3F);
  return cp;
}

bool is_ascii_alpha(const std::string& ch) { return ch.size() == 1 && std::isalpha(static_cast<unsigned char>(ch[0])); }
// Python's "cased" letters; non-ASCII characters count as letters that keep their case.
bool is_letter(const std::string& ch) { return is_ascii_alpha(ch) || static_cast<unsigned char>(ch[0]) >= 0x80; }

std::string map_case(std::string_view s, int (*f)(int)) {
  std::string out(s);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(static_cast<unsigned char>(c)));
  }
  return out;
}

}  // namespace

bool py_isspace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

std::string py_strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  std::vector<std::string> cs = utf8_chars(s);
  std::vector<std::string> set = chars ? utf8_chars(*chars) : std::vector<std::string>{};
  auto strippable = [&](const std::string& ch) {
    return chars ? std::find(set.begin(), set.end(), ch) != set.end() : py_isspace(code_point(ch));
  };
  size_t begin = 0, end = cs.size();
  if (left) {
    while (begin < end && strippable(cs[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strippable(cs[end - 1])) --end;
  }
  std::string out;
  for (size_t k = begin; k < end; ++k) out += cs[k];
  return out;
}

std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit,
                                  bool from_right) {
  std::vector<std::string> parts;
  if (sep) {
    if (sep->empty()) throw std::runtime_error("empty separator");
    if (!from_right) {
      size_t start = 0;
      for (size_t hit; (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) &&
                       (hit = s.find(*sep, start)) != std::string_view::npos;) {
        parts.emplace_back(s.substr(start, hit - start));
        start = hit + sep->size();
      }
      parts.emplace_back(s.substr(start));
      return parts;
    }
    size_t end = s.size();
    for (size_t hit; (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) && end >= sep->size() &&
                     (hit = s.rfind(*sep, end - sep->size())) != std::string_view::npos;) {
      parts.emplace_back(s.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    parts.emplace_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
    return parts;
  }
  // Runs of whitespace; the remainder after maxsplit keeps its inner whitespace but not the
  // whitespace that separates it from the last split.
  std::vector<std::string> cs = utf8_chars(s);
  if (from_right) std::reverse(cs.begin(), cs.end());
  size_t k = 0;
  while (true) {
    while (k < cs.size() && py_isspace(code_point(cs[k]))) ++k;
    if (k == cs.size()) break;
    std::string word;
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
      size_t end = cs.size();
      while (end > k && py_isspace(code_point(cs[end - 1]))) --end;
      for (size_t j = k; j < end; ++j) word += cs[j];
      parts.push_back(word);
      break;
    }
    while (k < cs.size() && !py_isspace(code_point(cs[k]))) word += cs[k++];
    parts.push_back(word);
  }
  if (from_right) {
    for (auto& p : parts) {
      std::vector<std::string> chars = utf8_chars(p);
      std::reverse(chars.begin(), chars.end());
      p.clear();
      for (auto& c : chars) p += c;
    }
    std::reverse(parts.begin(), parts.end());
  }
  return parts;
}

std::string py_replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts the replacement between characters and at both ends
    std::vector<std::string> cs = utf8_chars(s);
    int64_t done = 0;
    for (size_t k = 0; k <= cs.size(); ++k) {
      if (count < 0 || done < count) {
        out += replacement;
        ++done;
      }
      if (k < cs.size()) out += cs[k];
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  for (size_t hit; (count < 0 || done < count) && (hit = s.find(old, start)) != std::string_view::npos; ++done) {
    out.append(s.substr(start, hit - start));
    out.append(replacement);
    start = hit + old.size();
  }
  out.append(s.substr(start));
  return out;
}

std::string py_upper(std::string_view s) { return map_case(s, [](int c) { return std::toupper(c); }); }
std::string py_lower(std::string_view s) { return map_case(s, [](int c) { return std::tolower(c); }); }

std::string py_capitalize(std::string_view s) {
  std::string out = py_lower(s);
  if (!out.empty() && static_cast<unsigned char>(out[0]) < 0x80) out[0] = static_cast<char>(std::toupper(out[0]));
  return out;
}

std::string py_title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (const std::string& ch : utf8_chars(s)) {
    if (is_ascii_alpha(ch)) {
      out += static_cast<char>(previous_cased ? std::tolower(ch[0]) : std::toupper(ch[0]));
    } else {
      out += ch;
    }
    previous_cased = is_letter(ch);
  }
  return out;
}

std::string jinja_title(std::string_view s) {
  std::string out;
  bool word_start = true;
  for (const std::string& ch : utf8_chars(s)) {
    bool separator = ch == "-" || ch == "(" || ch == "{" || ch == "[" || ch == "<" || py_isspace(code_point(ch));
    if (separator) {
      out += ch;
    } else if (ch.size() == 1) {
      out += static_cast<char>(word_start ? std::toupper(ch[0]) : std::tolower(ch[0]));
    } else {
      out += ch;
    }
    word_start = separator;
  }
  return out;
}

int64_t py_count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return utf8_length(s) + 1;
  int64_t n = 0;
  for (size_t hit = s.find(sub); hit != std::string_view::npos; hit = s.find(sub, hit + sub.size())) ++n;
  return n;
}

int64_t py_find(std::string_view s, std::string_view sub, bool from_right) {
  size_t hit = from_right ? s.rfind(sub) : s.find(sub);
  return hit == std::string_view::npos ? -1 : utf8_length(s.substr(0, hit));
}

std::vector<std::string> py_splitlines(std::string_view s) {
  std::vector<std::string> lines;
  std::string line;
  for (size_t k = 0; k < s.size(); ++k) {
    char c = s[k];
    if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1C && c <= 0x1E)) {
      if (c == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
      lines.push_back(line);
      line.clear();
    } else {
      line += c;
    }
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

}  // namespace qlora::jinja
