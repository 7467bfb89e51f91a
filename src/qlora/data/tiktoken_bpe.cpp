#include "qlora/data/tiktoken_bpe.h"
#include "qlora/io/read_file.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <limits>
#include <queue>
#include <sstream>
#include <stdexcept>

namespace qlora::data {

const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> t = {
      "<|begin_of_text|>", "<|end_of_text|>",   "<|reserved_special_token_0|>",
      "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
      "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"};
  // The rest are reserved, numbered on from 2 (0 and 1 are taken above).
  for (int k = 2; t.size() < 256; ++k) t.push_back("<|reserved_special_token_" + std::to_string(k) + "|>");
  return t;
}

namespace {

constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();
// Pieces up to this many bytes merge by a quadratic scan on the stack, longer ones with a heap.
constexpr size_t kShortPiece = 64;

bool is_base64_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' ||
         c == '/' || c == '=';
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Standard alphabet with '=' padding, as tiktoken's files are written; false on anything else.
bool base64_decode(std::string_view in, std::string& out) {
  static const std::array<int8_t, 256> table = [] {
    std::array<int8_t, 256> t{};
    t.fill(-1);
    const std::string_view alphabet =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < alphabet.size(); ++i) t[static_cast<unsigned char>(alphabet[i])] = static_cast<int8_t>(i);
    return t;
  }();
  if (in.empty() || in.size() % 4 != 0) return false;
  size_t pad = 0;
  while (pad < 2 && in[in.size() - 1 - pad] == '=') ++pad;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < in.size() - pad; ++i) {
    const int8_t v = table[static_cast<unsigned char>(in[i])];
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return true;
}

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

// tiktoken's patterns are written for Rust's regex engine, where \s is Unicode White_Space.
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
      else if (e == 'S') throw std::invalid_argument("tiktoken pattern: \\S inside [...] is not supported");
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

}  // namespace

bool looks_like_tiktoken(std::string_view head) {
  std::string_view line = head.substr(0, head.find('\n'));
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const size_t space = line.find(' ');
  if (space == 0 || space == std::string_view::npos || space + 1 == line.size()) return false;
  const auto token = line.substr(0, space), rank = line.substr(space + 1);
  return std::all_of(token.begin(), token.end(), is_base64_char) &&
         std::all_of(rank.begin(), rank.end(), is_digit);
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

// ---------------------------------------------------------------------------------------------

struct TiktokenBpe::Regex {
  pcre2_code* code = nullptr;
  ~Regex() { pcre2_code_free(code); }
};

namespace {
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

TiktokenBpe::~TiktokenBpe() = default;

std::shared_ptr<const TiktokenBpe> TiktokenBpe::load(const std::string& path, const std::string& pattern,
                                                     const std::vector<std::string>& special_tokens) {
  const auto text = io::read_file(path);
  if (!text) throw std::runtime_error("tokenizer: cannot open '" + path + "'");
  std::shared_ptr<TiktokenBpe> t(new TiktokenBpe());
  t->path_ = path;
  t->parse_ranks(*text);

  for (const auto& s : special_tokens) {
    // encode() finds specials by "<|" and the next "|>", which is exact only for this shape.
    if (s.size() < 5 || s.compare(0, 2, "<|") != 0 || s.find("|>", 2) != s.size() - 2) {
      throw std::invalid_argument("tiktoken special token '" + s + "' is not of the form <|name|>");
    }
    if (!t->special_ids_.emplace(s, t->vocab_size()).second) {
      throw std::invalid_argument("tiktoken special token '" + s + "' is listed twice");
    }
    t->specials_.push_back(s);
  }

  int err = 0;
  PCRE2_SIZE err_offset = 0;
  const std::string re = pcre2_syntax(pattern);
  t->regex_ = std::make_unique<Regex>();
  t->regex_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(), PCRE2_UTF | PCRE2_UCP,
                                  &err, &err_offset, nullptr);
  if (t->regex_->code == nullptr) {
    throw std::invalid_argument("tiktoken pattern: " + pcre2_message(err) + " at offset " +
                                std::to_string(err_offset) + " of " + re);
  }
  // JIT makes matching several times faster; without it (unsupported CPU) the interpreter runs.
  pcre2_jit_compile(t->regex_->code, PCRE2_JIT_COMPLETE);
  return t;
}

void TiktokenBpe::parse_ranks(const std::string& text) {
  const auto fail = [&](size_t line, const std::string& what) {
    throw std::runtime_error(path_ + ": line " + std::to_string(line) + ": " + what);
  };
  std::vector<uint32_t> line_of_rank;  // for naming both lines of a duplicate
  offsets_.assign(1, 0);
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;  // tiktoken's loader skips blank lines too
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
      fail(line_no, "expected '<base64 token> <rank>'");
    }
    const size_t before = arena_.size();
    if (!base64_decode(line.substr(0, space), arena_)) {
      fail(line_no, "bad base64 '" + std::string(line.substr(0, space)) + "'");
    }
    if (arena_.size() == before) fail(line_no, "empty token");
    const auto digits = line.substr(space + 1);
    const uint64_t want = offsets_.size() - 1;
    uint64_t rank = 0;
    const bool numeric = !digits.empty() && digits.size() <= 10 && std::all_of(digits.begin(), digits.end(), is_digit);
    for (const char c : digits) rank = rank * 10 + static_cast<uint64_t>(c - '0');
    if (!numeric) fail(line_no, "bad rank '" + std::string(digits) + "' (expected a decimal number)");
    if (rank != want) {
      fail(line_no, "rank " + std::string(digits) + " where " + std::to_string(want) +
                        " was expected (ranks must be 0, 1, 2, ... in order)");
    }
    if (arena_.size() > std::numeric_limits<int32_t>::max()) fail(line_no, "file too large");
    offsets_.push_back(static_cast<uint32_t>(arena_.size()));
    line_of_rank.push_back(static_cast<uint32_t>(line_no));
  }
  if (offsets_.size() == 1) throw std::runtime_error(path_ + ": no tokens (expected '<base64 token> <rank>' lines)");

  // arena_ is final now, so views into it stay valid.
  ranks_.reserve(offsets_.size());
  for (uint32_t r = 0; r + 1 < offsets_.size(); ++r) {
    const auto [it, fresh] = ranks_.emplace(token_bytes(r), r);
    if (!fresh) {
      fail(line_of_rank[r], "token already given on line " + std::to_string(line_of_rank[it->second]));
    }
  }
  for (int b = 0; b < 256; ++b) {
    if (rank_of(std::string(1, static_cast<char>(b))) < 0) {
      throw std::runtime_error(path_ + ": no token for the single byte " + std::to_string(b) +
                               " (byte-level BPE needs all 256)");
    }
  }
}

int64_t TiktokenBpe::rank_of(std::string_view bytes) const {
  const auto it = ranks_.find(bytes);
  return it == ranks_.end() ? -1 : static_cast<int64_t>(it->second);
}

int64_t TiktokenBpe::special_id(std::string_view token) const {
  const auto it = special_ids_.find(std::string(token));
  return it == special_ids_.end() ? -1 : it->second;
}

std::string_view TiktokenBpe::token_bytes(int64_t id) const {
  if (id >= 0 && id < base_vocab_size()) {
    return std::string_view(arena_).substr(offsets_[id], offsets_[id + 1] - offsets_[id]);
  }
  if (id >= base_vocab_size() && id < vocab_size()) return specials_[id - base_vocab_size()];
  throw std::out_of_range("tokenizer '" + path_ + "': id " + std::to_string(id) + " is outside the vocab [0, " +
                          std::to_string(vocab_size()) + ")");
}

std::vector<int64_t> TiktokenBpe::encode(std::string_view text) const {
  std::string repaired;
  if (!utf8_valid(text)) {
    repaired = utf8_replace_invalid(text);
    text = repaired;
  }
  std::vector<int64_t> out;
  out.reserve(text.size() / 3 + 1);
  // Every special is "<|...|>" with no "|>" inside, so the first "|>" after a "<|" ends the only
  // special that can start there.
  size_t start = 0;
  for (size_t search = 0;;) {
    const size_t open = text.find("<|", search);
    if (open == std::string_view::npos) break;
    const size_t close = text.find("|>", open + 2);
    if (close == std::string_view::npos) break;
    const int64_t id = special_id(text.substr(open, close + 2 - open));
    if (id < 0) {
      search = open + 1;
      continue;
    }
    encode_ordinary(text.substr(start, open - start), out);
    out.push_back(id);
    start = search = close + 2;
  }
  encode_ordinary(text.substr(start), out);
  return out;
}

void TiktokenBpe::encode_ordinary(std::string_view text, std::vector<int64_t>& out) const {
  if (text.empty()) return;
  MatchData m(regex_->code);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  for (size_t pos = 0; pos < text.size();) {
    // The text between two specials is the whole subject, as in tiktoken: a lookahead such as
    // (?!\S) must not see past it. Validity was checked once in encode().
    const int rc = pcre2_match(regex_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, m.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;  // like tiktoken, unmatched text is dropped
    if (rc < 0) throw std::runtime_error("tokenizer '" + path_ + "': pre-tokenizer regex: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    if (ov[1] == ov[0]) {  // an empty match (none in Llama-3's pattern): step over a character
      bool ok = true;
      pos = ov[0] + utf8_step(text, ov[0], ok);
      continue;
    }
    encode_piece(text.substr(ov[0], ov[1] - ov[0]), out);
    pos = ov[1];
  }
}

void TiktokenBpe::encode_piece(std::string_view piece, std::vector<int64_t>& out) const {
  if (const int64_t whole = rank_of(piece); whole >= 0) {
    out.push_back(whole);
    return;
  }
  const size_t n = piece.size();
  const auto rank_or_none = [&](size_t begin, size_t end) -> uint32_t {
    const int64_t r = rank_of(piece.substr(begin, end - begin));
    return r < 0 ? kNoRank : static_cast<uint32_t>(r);
  };
  if (n <= kShortPiece) {
    // Nearly every piece: tiktoken's own loop (merge the lowest-ranked pair, leftmost first) on
    // arrays on the stack. Part i is [start[i], start[i + 1]); rank[i] ranks parts i and i + 1
    // joined.
    uint32_t start[kShortPiece + 1], rank[kShortPiece + 1];
    size_t parts = n;
    for (size_t i = 0; i <= n; ++i) start[i] = static_cast<uint32_t>(i);
    const auto pair_rank = [&](size_t i) { return i + 1 < parts ? rank_or_none(start[i], start[i + 2]) : kNoRank; };
    for (size_t i = 0; i < parts; ++i) rank[i] = pair_rank(i);
    for (;;) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < parts; ++i) best = rank[i] < rank[best] ? i : best;
      if (parts < 2 || rank[best] == kNoRank) break;
      std::copy(start + best + 2, start + parts + 1, start + best + 1);
      std::copy(rank + best + 2, rank + parts, rank + best + 1);
      --parts;
      rank[best] = pair_rank(best);
      if (best > 0) rank[best - 1] = pair_rank(best - 1);
    }
    for (size_t i = 0; i < parts; ++i) out.push_back(rank_of(piece.substr(start[i], start[i + 1] - start[i])));
    return;
  }
  // Long pieces (a base64 blob, a run of one letter): a doubly linked list plus a heap keyed
  // (rank, start) picks the same pairs in O(n log n) where tiktoken's loop is quadratic. Part i is
  // [i, next[i]); pair_rank[i] ranks part i joined with the next one.
  std::vector<uint32_t> next(n), prev(n), pair_rank(n, kNoRank);
  for (size_t i = 0; i < n; ++i) {
    next[i] = static_cast<uint32_t>(i + 1);
    prev[i] = static_cast<uint32_t>(i - 1);  // wraps for i = 0; never read there
  }
  const auto rank_after = [&](uint32_t i) { return next[i] < n ? rank_or_none(i, next[next[i]]) : kNoRank; };
  using Entry = std::pair<uint32_t, uint32_t>;  // (rank, start)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    pair_rank[i] = rank_after(i);
    if (pair_rank[i] != kNoRank) heap.emplace(pair_rank[i], i);
  }
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    const auto [r, i] = heap.top();
    heap.pop();
    if (!alive[i] || pair_rank[i] != r) continue;  // stale: a neighbour merged since
    const uint32_t j = next[i];
    alive[j] = false;
    next[i] = next[j];
    if (next[i] < n) prev[next[i]] = i;
    pair_rank[i] = rank_after(i);
    if (pair_rank[i] != kNoRank) heap.emplace(pair_rank[i], i);
    if (i > 0) {
      const uint32_t p = prev[i];
      pair_rank[p] = rank_after(p);
      if (pair_rank[p] != kNoRank) heap.emplace(pair_rank[p], p);
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(rank_of(piece.substr(i, next[i] - i)));
}

std::string TiktokenBpe::decode_bytes(const std::vector<int64_t>& ids) const {
  std::string out;
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] < 0 || ids[k] >= vocab_size()) {
      throw std::out_of_range("tokenizer '" + path_ + "': decode: id " + std::to_string(ids[k]) + " at position " +
                              std::to_string(k) + " is outside the vocab [0, " + std::to_string(vocab_size()) + ")");
    }
    out.append(token_bytes(ids[k]));
  }
  return out;
}

}  // namespace qlora::data
