#include "qlora/data/hf_pipeline.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <array>
#include <memory>
#include <set>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "qlora/data/text_regex.h"
#include "qlora/jinja/utf8.h"

namespace qlora::data::hf {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer pattern, which ByteLevel uses when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw std::runtime_error(where + ": " + what);
}

// The component's "type", after checking that every key is one qlora reads: an option it does
// not know could change the ids, so it is an error rather than ignored.
std::string type_of(const json& j, const std::string& where, const std::set<std::string>& keys) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) fail(where, "expected an object with a \"type\"");
  for (const auto& [k, v] : j.items()) {
    if (k != "type" && !keys.count(k)) fail(where, "unsupported option \"" + k + "\" of " + j["type"].get<std::string>());
  }
  return j["type"].get<std::string>();
}

template <class T>
T get(const json& j, const char* key, const std::string& where, T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  // nlohmann casts a float (1e300) or a negative number into an unsigned count unchecked (undefined
  // behaviour, or a wrapped size): a count must be written as one.
  if constexpr (std::is_unsigned_v<T> && !std::is_same_v<T, bool>) {
    if (!j[key].is_number_unsigned())
      fail(where, std::string("\"") + key + "\" must be a non-negative integer, got " + j[key].dump());
  }
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    fail(where, std::string("\"") + key + "\" has the wrong type (" + j[key].dump() + ")");
  }
}

// A Split/Replace "pattern": {"String": literal} or {"Regex": pattern}, as PCRE2 source.
std::string pattern_of(const json& j, const std::string& where) {
  const json& p = j.contains("pattern") ? j["pattern"] : json();
  if (p.is_object() && p.size() == 1 && p.contains("Regex") && p["Regex"].is_string()) return p["Regex"];
  if (p.is_object() && p.size() == 1 && p.contains("String") && p["String"].is_string()) {
    std::string out;
    for (const char c : p["String"].get<std::string>()) {
      const bool plain = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c & 0x80);
      if (!plain) out += '\\';
      out += c;
    }
    return out;
  }
  fail(where, "expected \"pattern\": {\"String\": ...} or {\"Regex\": ...}");
}

std::string replace_all(const TextRegex& re, const std::string& s, const std::string& content) {
  std::string out;
  size_t last = 0;
  re.for_each_match(s, [&](size_t b, size_t e) {
    out.append(s, last, b - last).append(content);
    last = e;
  });
  return out.append(s, last, std::string::npos);
}

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior behavior_of(const json& j, const std::string& where) {
  static const std::unordered_map<std::string, Behavior> names = {
      {"Removed", Behavior::kRemoved},
      {"Isolated", Behavior::kIsolated},
      {"MergedWithPrevious", Behavior::kMergedWithPrevious},
      {"MergedWithNext", Behavior::kMergedWithNext},
      {"Contiguous", Behavior::kContiguous}};
  const auto it = names.find(get<std::string>(j, "behavior", where, ""));
  if (it == names.end()) fail(where, "\"behavior\" must be one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
  return it->second;
}

struct Segment {
  size_t begin, end;
  bool match;
};

// The library's split of one pre-token: the text is cut into matches and the gaps between them,
// then `b` says what happens to the matches (the delimiters).
std::vector<Segment> split_segments(const std::string& s, const TextRegex& re, Behavior b, bool invert) {
  std::vector<Segment> segs;
  size_t last = 0;
  re.for_each_match(s, [&](size_t mb, size_t me) {
    if (mb > last) segs.push_back({last, mb, invert});
    segs.push_back({mb, me, !invert});
    last = me;
  });
  if (last < s.size()) segs.push_back({last, s.size(), invert});
  std::vector<Segment> out;
  bool prev_match = false;
  switch (b) {
    case Behavior::kIsolated: return segs;
    case Behavior::kRemoved:
      for (const auto& g : segs) if (!g.match) out.push_back(g);
      return out;
    case Behavior::kContiguous:
      for (const auto& g : segs) {
        if (!out.empty() && g.match && prev_match) out.back().end = g.end;
        else out.push_back(g);
        prev_match = g.match;
      }
      return out;
    case Behavior::kMergedWithPrevious:  // a delimiter joins the gap before it
      for (const auto& g : segs) {
        if (!out.empty() && g.match && !prev_match) out.back().end = g.end;
        else out.push_back(g);
        prev_match = g.match;
      }
      return out;
    case Behavior::kMergedWithNext:  // a delimiter joins the gap after it
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (!out.empty() && it->match && !prev_match) out.back().begin = it->begin;
        else out.push_back(*it);
        prev_match = it->match;
      }
      return {out.rbegin(), out.rend()};
  }
  return segs;
}

void split_pieces(std::vector<Piece>& pieces, const TextRegex& re, Behavior b, bool invert) {
  std::vector<Piece> out;
  for (auto& p : pieces) {
    for (const auto& g : split_segments(p.text, re, b, invert)) {
      out.push_back({p.text.substr(g.begin, g.end - g.begin), p.at_start && g.begin == 0});
    }
  }
  pieces = std::move(out);
}

Normalize unicode_form(const std::string& type, const std::string& where) {
  UErrorCode st = U_ZERO_ERROR;
  const icu::Normalizer2* n = type == "NFC"    ? icu::Normalizer2::getNFCInstance(st)
                              : type == "NFD"  ? icu::Normalizer2::getNFDInstance(st)
                              : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(st)
                                               : icu::Normalizer2::getNFKDInstance(st);
  if (U_FAILURE(st)) fail(where, type + ": ICU has no normalizer: " + u_errorName(st));
  return [n](std::string s) {
    UErrorCode e = U_ZERO_ERROR;
    const icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
    if (n->isNormalized(u, e) && U_SUCCESS(e)) return s;
    std::string out;
    n->normalize(u, e).toUTF8String(out);
    return out;
  };
}

// Metaspace's prepend_scheme; files written before it existed say add_prefix_space instead.
std::string prepend_scheme(const json& j, const std::string& where) {
  std::string scheme = get<std::string>(j, "prepend_scheme", where, "");
  if (scheme.empty()) scheme = get<bool>(j, "add_prefix_space", where, true) ? "always" : "never";
  if (scheme != "always" && scheme != "first" && scheme != "never") {
    fail(where, "\"prepend_scheme\" must be always, first or never, not '" + scheme + "'");
  }
  return scheme;
}

std::string one_char(const json& j, const char* key, const std::string& where, const std::string& fallback) {
  const auto s = get<std::string>(j, key, where, fallback);
  size_t len = 0;
  if (s.empty() || utf8_next(s, len) == kUtf8Invalid || len != s.size()) fail(where, std::string("\"") + key + "\" must be one character");
  return s;
}

std::string replaced(const std::string& s, const std::string& from, const std::string& to) {
  std::string out;
  for (size_t i = 0;;) {
    const size_t k = s.find(from, i);
    if (k == std::string::npos) return out.append(s, i, std::string::npos);
    out.append(s, i, k - i).append(to);
    i = k + from.size();
  }
}

PreTokenize metaspace(const json& j, const std::string& where) {
  const std::string rep = one_char(j, "replacement", where, "\xE2\x96\x81");
  const std::string scheme = prepend_scheme(j, where);
  std::shared_ptr<TextRegex> re;
  if (get<bool>(j, "split", where, true)) re = std::make_shared<TextRegex>(rep, where);
  return [rep, scheme, re](std::vector<Piece>& pieces) {
    for (auto& p : pieces) {
      p.text = replaced(p.text, " ", rep);
      const bool prepend = scheme == "always" || (scheme == "first" && p.at_start);
      if (prepend && p.text.compare(0, rep.size(), rep) != 0) p.text = rep + p.text;
    }
    if (re) split_pieces(pieces, *re, Behavior::kMergedWithNext, false);
  };
}

PreTokenize byte_level(const json& j, const std::string& where) {
  const bool prefix = get<bool>(j, "add_prefix_space", where, true);
  std::shared_ptr<TextRegex> re;
  if (get<bool>(j, "use_regex", where, true)) re = std::make_shared<TextRegex>(kGpt2Pattern, where);
  return [prefix, re](std::vector<Piece>& pieces) {
    for (auto& p : pieces) {
      if (prefix && p.text.compare(0, 1, " ") != 0) p.text.insert(0, " ");
    }
    if (re) split_pieces(pieces, *re, Behavior::kIsolated, false);
    for (auto& p : pieces) {
      std::string mapped;
      for (const char c : p.text) mapped += byte_char(static_cast<uint8_t>(c));
      p.text = std::move(mapped);
    }
  };
}

template <class Stage, class Make>
std::vector<Stage> make_list(const json& j, const char* key, const std::string& where, const Make& make) {
  if (!j.contains(key) || !j[key].is_array()) fail(where, std::string("Sequence needs a \"") + key + "\" list");
  std::vector<Stage> stages;
  for (size_t i = 0; i < j[key].size(); ++i) {
    stages.push_back(make(j[key][i], where + "." + key + "[" + std::to_string(i) + "]"));
  }
  return stages;
}

}  // namespace

Normalize make_normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return [](std::string s) { return s; };
  const std::string type = type_of(j, where, {"normalizers", "prepend", "pattern", "content"});
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") return unicode_form(type, where);
  if (type == "Sequence") {
    auto stages = make_list<Normalize>(j, "normalizers", where, make_normalizer);
    return [stages](std::string s) {
      for (const auto& n : stages) s = n(std::move(s));
      return s;
    };
  }
  if (type == "Prepend") {
    const auto prefix = get<std::string>(j, "prepend", where, "");
    return [prefix](std::string s) { return s.empty() ? s : prefix + s; };
  }
  if (type == "Replace") {
    const auto re = std::make_shared<TextRegex>(pattern_of(j, where), where);
    const auto content = get<std::string>(j, "content", where, "");
    return [re, content](std::string s) { return replace_all(*re, s, content); };
  }
  fail(where, "unsupported normalizer type '" + type + "' (qlora reads NFC, NFD, NFKC, NFKD, Sequence, Prepend, Replace)");
}

PreTokenize make_pre_tokenizer(const json& j, const std::string& where) {
  if (j.is_null()) return [](std::vector<Piece>&) {};
  const std::string type = type_of(j, where, {"pretokenizers", "pattern", "behavior", "invert", "add_prefix_space",
                                              "trim_offsets", "use_regex", "replacement", "prepend_scheme", "split",
                                              "str_rep", "individual_digits"});
  if (type == "Sequence") {
    auto stages = make_list<PreTokenize>(j, "pretokenizers", where, make_pre_tokenizer);
    return [stages](std::vector<Piece>& pieces) {
      for (const auto& s : stages) s(pieces);
    };
  }
  if (type == "Split") {
    const auto re = std::make_shared<TextRegex>(pattern_of(j, where), where);
    const Behavior b = behavior_of(j, where);
    const bool invert = get<bool>(j, "invert", where, false);
    return [re, b, invert](std::vector<Piece>& pieces) { split_pieces(pieces, *re, b, invert); };
  }
  if (type == "Digits") {
    const auto re = std::make_shared<TextRegex>(get<bool>(j, "individual_digits", where, false) ? R"(\p{N})" : R"(\p{N}+)", where);
    return [re](std::vector<Piece>& pieces) { split_pieces(pieces, *re, Behavior::kIsolated, false); };
  }
  if (type == "ByteLevel") return byte_level(j, where);  // trim_offsets: offsets only, which qlora has none of
  if (type == "Metaspace") return metaspace(j, where);
  fail(where, "unsupported pre_tokenizer type '" + type + "' (qlora reads Sequence, Split, ByteLevel, Metaspace, Digits)");
}

namespace {

// ByteFallback's "<0xAB>" token as its byte, or -1.
int fallback_byte(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  int v = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = t[i];
    const int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

// Runs of byte tokens become their text, or one U+FFFD per byte when the run is not UTF-8.
void byte_fallback(std::vector<std::string>& tokens) {
  std::vector<std::string> out;
  std::string run;
  size_t run_len = 0;
  const auto flush = [&] {
    if (run_len == 0) return;
    if (utf8_valid(run)) out.push_back(run);
    else for (size_t k = 0; k < run_len; ++k) out.push_back("\xEF\xBF\xBD");
    run.clear();
    run_len = 0;
  };
  for (auto& t : tokens) {
    const int b = fallback_byte(t);
    if (b >= 0) {
      run += static_cast<char>(b);
      ++run_len;
      continue;
    }
    flush();
    out.push_back(std::move(t));
  }
  flush();
  tokens = std::move(out);
}

// A token whose characters are all in the byte alphabet becomes those bytes; any other is kept
// as its own text. The whole is then read as UTF-8, ill-formed parts as U+FFFD.
void byte_level_decode(std::vector<std::string>& tokens) {
  std::string bytes;
  for (const auto& t : tokens) {
    std::string mapped;
    bool all = true;
    for (size_t i = 0; i < t.size() && all;) {
      const int32_t cp = utf8_next(t, i);  // ill-formed: no byte's character
      const int b = cp == kUtf8Invalid ? -1 : byte_of_char(static_cast<uint32_t>(cp));
      all = b >= 0;
      mapped += static_cast<char>(b);
    }
    bytes += all ? mapped : t;
  }
  tokens = {utf8_replace_invalid(bytes)};
}

std::string strip_char(const std::string& t, const std::string& c, size_t start, size_t stop) {
  size_t b = 0, e = t.size();
  for (size_t k = 0; k < start && e - b >= c.size() && t.compare(b, c.size(), c) == 0; ++k) b += c.size();
  for (size_t k = 0; k < stop && e - b >= c.size() && t.compare(e - c.size(), c.size(), c) == 0; ++k) e -= c.size();
  return t.substr(b, e - b);
}

}  // namespace

Decode make_decoder(const json& j, const std::string& where) {
  if (j.is_null()) {  // the library joins the tokens with spaces
    return [](std::vector<std::string>& tokens) {
      std::string s;
      for (size_t i = 0; i < tokens.size(); ++i) s += (i ? " " : "") + tokens[i];
      tokens = {s};
    };
  }
  const std::string type = type_of(j, where, {"decoders", "pattern", "content", "start", "stop", "add_prefix_space",
                                              "trim_offsets", "use_regex", "replacement", "prepend_scheme", "split",
                                              "str_rep"});
  if (type == "Sequence") {
    auto stages = make_list<Decode>(j, "decoders", where, make_decoder);
    return [stages](std::vector<std::string>& tokens) {
      for (const auto& s : stages) s(tokens);
    };
  }
  if (type == "ByteLevel") return byte_level_decode;
  if (type == "ByteFallback") return byte_fallback;
  if (type == "Fuse") {
    return [](std::vector<std::string>& tokens) {
      std::string s;
      for (const auto& t : tokens) s += t;
      tokens = {s};
    };
  }
  if (type == "Replace") {
    const auto re = std::make_shared<TextRegex>(pattern_of(j, where), where);
    const auto content = get<std::string>(j, "content", where, "");
    return [re, content](std::vector<std::string>& tokens) {
      for (auto& t : tokens) t = replace_all(*re, t, content);
    };
  }
  if (type == "Strip") {
    const std::string c = one_char(j, "content", where, " ");
    const auto start = get<size_t>(j, "start", where, 0), stop = get<size_t>(j, "stop", where, 0);
    return [c, start, stop](std::vector<std::string>& tokens) {
      for (auto& t : tokens) t = strip_char(t, c, start, stop);
    };
  }
  if (type == "Metaspace") {
    // As the library: the replacement turns into a space, except in the first token, where
    // (unless prepend_scheme is never) every one is dropped.
    const std::string rep = one_char(j, "replacement", where, "\xE2\x96\x81");
    const bool drop_first = prepend_scheme(j, where) != "never";
    get<bool>(j, "split", where, true);  // type-checked; splitting means nothing when decoding
    return [rep, drop_first](std::vector<std::string>& tokens) {
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = replaced(tokens[i], rep, i == 0 && drop_first ? "" : " ");
    };
  }
  fail(where, "unsupported decoder type '" + type + "' (qlora reads Sequence, ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace)");
}

namespace {
// Printable bytes stand for themselves; the other 68 take the characters from U+0100 on, in
// byte order. This is GPT-2's table, which every byte-level BPE vocabulary is written in.
struct ByteAlphabet {
  std::array<std::string, 256> chars;
  std::unordered_map<uint32_t, int> bytes;
  ByteAlphabet() {
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
      utf8_append(chars[b], cp);
      bytes[cp] = b;
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}
}  // namespace

const std::string& byte_char(uint8_t b) { return alphabet().chars[b]; }

int byte_of_char(uint32_t codepoint) {
  const auto& m = alphabet().bytes;
  const auto it = m.find(codepoint);
  return it == m.end() ? -1 : it->second;
}

}  // namespace qlora::data::hf
