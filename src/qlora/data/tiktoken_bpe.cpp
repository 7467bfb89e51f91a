#include "qlora/data/tiktoken_bpe.h"
#include "qlora/data/bpe_merge.h"
#include "qlora/io/read_file.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
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

// ---------------------------------------------------------------------------------------------

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

  t->regex_ = std::make_unique<TextRegex>(pattern, "tiktoken tokenizer '" + path + "'");
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
  // Like tiktoken, text the pattern does not match is dropped. Validity was checked in encode().
  regex_->for_each_match(text, [&](size_t begin, size_t end) { encode_piece(text.substr(begin, end - begin), out); });
}

void TiktokenBpe::encode_piece(std::string_view piece, std::vector<int64_t>& out) const {
  if (const int64_t whole = rank_of(piece); whole >= 0) {
    out.push_back(whole);
    return;
  }
  // A pair's rank is the rank of the joined bytes: tiktoken's merge order.
  const auto rank = [&](size_t begin, size_t, size_t end) -> uint32_t {
    const int64_t r = rank_of(piece.substr(begin, end - begin));
    return r < 0 ? kNoRank : static_cast<uint32_t>(r);
  };
  bpe_merge(piece.size(), rank, [](size_t, size_t) {},
            [&](size_t begin, size_t end) { out.push_back(rank_of(piece.substr(begin, end - begin))); });
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
