#include "qlora/jinja/strings.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include <unicode/uchar.h>
#include <unicode/ucasemap.h>

#include "qlora/jinja/budget.h"
#include "qlora/jinja/value.h"

namespace qlora::jinja {
namespace {

// A code point (kUtf8Invalid for an ill-formed unit) and the bytes it came from.
struct Char {
  int32_t cp;
  std::string_view bytes;
};

std::vector<Char> decode(std::string_view s) {
  std::vector<Char> out;
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const int32_t cp = utf8_next(s, i);
    out.push_back(Char{cp, s.substr(start, i - start)});
  }
  return out;
}

int32_t code_point(const std::string& ch) {
  size_t i = 0;
  return ch.empty() ? kUtf8Invalid : utf8_next(ch, i);
}

enum class Case { kUpper, kLower, kTitle };

// ICU's full case mappings in the root locale, which are Python's (SpecialCasing's unconditional
// mappings: 'ß' upper is "SS", 'ǆ' title is 'ǅ', 'İ' lower is "i̇"); never the process's default
// locale, whose Turkish or Lithuanian rules Python does not apply. The title map works on the
// whole (one-character) string, so ICU needs no word breaker; thread_local because ICU fills a
// UCaseMap's title iterator lazily.
UCaseMap* case_map() {
  struct Owner {
    UCaseMap* map = nullptr;
    ~Owner() { ucasemap_close(map); }
  };
  thread_local Owner owner;
  if (!owner.map) {
    UErrorCode err = U_ZERO_ERROR;
    owner.map = ucasemap_open("", U_TITLECASE_WHOLE_STRING | U_TITLECASE_NO_BREAK_ADJUSTMENT | U_TITLECASE_NO_LOWERCASE, &err);
    if (U_FAILURE(err)) throw std::runtime_error(std::string("ICU case mapping: ") + u_errorName(err));
  }
  return owner.map;
}

void append_mapped(std::string& out, const Char& c, Case which) {
  if (c.cp == kUtf8Invalid) {  // no Python str holds one: its bytes pass through
    out += c.bytes;
    return;
  }
  if (c.cp < 0x80) {
    const char ch = static_cast<char>(c.cp);
    const bool up = which != Case::kLower;
    out += up ? (ch >= 'a' && ch <= 'z' ? static_cast<char>(ch - 32) : ch) : (ch >= 'A' && ch <= 'Z' ? static_cast<char>(ch + 32) : ch);
    return;
  }
  char buf[64];  // a full mapping is at most 3 code points
  UErrorCode err = U_ZERO_ERROR;
  const auto n = static_cast<int32_t>(c.bytes.size());
  const int32_t len = which == Case::kUpper   ? ucasemap_utf8ToUpper(case_map(), buf, sizeof buf, c.bytes.data(), n, &err)
                      : which == Case::kLower ? ucasemap_utf8ToLower(case_map(), buf, sizeof buf, c.bytes.data(), n, &err)
                                              : ucasemap_utf8ToTitle(case_map(), buf, sizeof buf, c.bytes.data(), n, &err);
  if (U_FAILURE(err)) throw std::runtime_error(std::string("ICU case mapping: ") + u_errorName(err));
  out.append(buf, static_cast<size_t>(len));
}

bool has(int32_t cp, UProperty property) { return cp != kUtf8Invalid && u_hasBinaryProperty(cp, property); }

// Python's lower() maps U+03A3 by context (Unicode's Final_Sigma): final after a cased letter, when
// no cased letter follows, case-ignorable characters (apostrophes, combining marks) skipped both
// ways; the context is chars[begin, end).
bool final_sigma(const std::vector<Char>& chars, size_t k, size_t begin, size_t end) {
  size_t j = k;
  while (j > begin && has(chars[j - 1].cp, UCHAR_CASE_IGNORABLE)) --j;
  if (j == begin || !has(chars[j - 1].cp, UCHAR_CASED)) return false;
  j = k + 1;
  while (j < end && has(chars[j].cp, UCHAR_CASE_IGNORABLE)) ++j;
  return j == end || !has(chars[j].cp, UCHAR_CASED);
}

// Python's lower() of chars[k], the sigma's context being chars[begin, end).
void append_lower_at(std::string& out, const std::vector<Char>& chars, size_t k, size_t begin, size_t end) {
  if (chars[k].cp == 0x3A3) out += final_sigma(chars, k, begin, end) ? "\u03c2" : "\u03c3";
  else append_mapped(out, chars[k], Case::kLower);
}

// Python's lower() of chars[from, end), the sigma's context being chars[begin, end).
void append_lower(std::string& out, const std::vector<Char>& chars, size_t from, size_t begin, size_t end) {
  for (size_t k = from; k < end; ++k) append_lower_at(out, chars, k, begin, end);
}

// str.isupper() / islower(): at least one cased character and none of the other case or titlecase.
bool all_of_case(std::string_view s, UProperty want, UProperty other) {
  bool cased = false;
  for (const Char& c : decode(s)) {
    if (has(c.cp, other) || (c.cp != kUtf8Invalid && u_istitle(c.cp))) return false;
    cased = cased || has(c.cp, want);
  }
  return cased;
}

// str.isalpha() etc.: non-empty, and every character has the property.
template <typename Pred>
bool all_chars(std::string_view s, Pred pred) {
  const std::vector<Char> chars = decode(s);
  return !chars.empty() && std::all_of(chars.begin(), chars.end(), [&](const Char& c) { return c.cp != kUtf8Invalid && pred(c.cp); });
}

int32_t numeric_type(int32_t cp) { return u_getIntPropertyValue(cp, UCHAR_NUMERIC_TYPE); }

}  // namespace

// Python's str.isspace(): bidirectional class WS, B or S, or general category Zs.
bool py_isspace(int32_t cp) {
  if (cp == kUtf8Invalid) return false;
  const auto dir = u_charDirection(cp);
  return dir == U_WHITE_SPACE_NEUTRAL || dir == U_BLOCK_SEPARATOR || dir == U_SEGMENT_SEPARATOR ||
         u_charType(cp) == U_SPACE_SEPARATOR;
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
        budget_append(out.size(), replacement.size());
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
    budget_append(out.size(), hit - start + replacement.size());
    out.append(s.substr(start, hit - start));
    out.append(replacement);
    start = hit + old.size();
  }
  out.append(s.substr(start));
  return out;
}

std::string py_upper(std::string_view s) {
  std::string out;
  for (const Char& c : decode(s)) append_mapped(out, c, Case::kUpper);
  return out;
}

std::string py_lower(std::string_view s) {
  const std::vector<Char> chars = decode(s);
  std::string out;
  append_lower(out, chars, 0, 0, chars.size());
  return out;
}

// Python 3.8+: the first character titlecased ('ǆ' -> 'ǅ'), the rest lowercased.
std::string py_capitalize(std::string_view s) {
  const std::vector<Char> chars = decode(s);
  std::string out;
  if (chars.empty()) return out;
  append_mapped(out, chars[0], Case::kTitle);
  append_lower(out, chars, 1, 0, chars.size());
  return out;
}

// str.title(): a character after a cased one is lowercased, any other titlecased.
std::string py_title(std::string_view s) {
  const std::vector<Char> chars = decode(s);
  std::string out;
  bool previous_cased = false;
  for (size_t k = 0; k < chars.size(); ++k) {
    if (previous_cased) append_lower_at(out, chars, k, 0, chars.size());
    else append_mapped(out, chars[k], Case::kTitle);
    previous_cased = has(chars[k].cp, UCHAR_CASED);
  }
  return out;
}

// jinja2's |title: the text split at runs of -, (, {, [, < and whitespace; each piece becomes
// piece[0].upper() + piece[1:].lower() (upper, not title: 'ǆ' -> 'Ǆ'; the sigma's context is the
// piece's tail alone).
std::string jinja_title(std::string_view s) {
  const std::vector<Char> chars = decode(s);
  const auto separator = [](int32_t cp) {
    return cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || py_isspace(cp);
  };
  std::string out;
  for (size_t begin = 0, end; begin < chars.size(); begin = end) {
    end = begin + 1;
    while (end < chars.size() && separator(chars[end].cp) == separator(chars[begin].cp)) ++end;
    append_mapped(out, chars[begin], Case::kUpper);
    append_lower(out, chars, begin + 1, begin + 1, end);
  }
  return out;
}

bool py_isupper(std::string_view s) { return all_of_case(s, UCHAR_UPPERCASE, UCHAR_LOWERCASE); }
bool py_islower(std::string_view s) { return all_of_case(s, UCHAR_LOWERCASE, UCHAR_UPPERCASE); }
bool py_isalpha(std::string_view s) { return all_chars(s, [](int32_t cp) { return u_isalpha(cp) != 0; }); }
// isdigit: Numeric_Type Decimal or Digit ('²' is a digit, not a decimal); isalnum: a letter or
// any numeric character ('½', '一').
bool py_isdigit(std::string_view s) {
  return all_chars(s, [](int32_t cp) { return numeric_type(cp) == U_NT_DECIMAL || numeric_type(cp) == U_NT_DIGIT; });
}
bool py_isalnum(std::string_view s) {
  return all_chars(s, [](int32_t cp) { return u_isalpha(cp) || numeric_type(cp) != U_NT_NONE; });
}
bool py_isspace(std::string_view s) { return all_chars(s, [](int32_t cp) { return py_isspace(cp); }); }

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
