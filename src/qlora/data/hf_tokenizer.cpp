#include "qlora/data/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "qlora/data/bpe_merge.h"
#include "qlora/data/hf_pipeline.h"
#include "qlora/data/text_regex.h"
#include "qlora/io/read_file.h"

namespace qlora::data {
namespace {

using nlohmann::json;

struct AddedToken {
  std::string content;
  std::string pattern;  // what is searched for: the content, normalized when `normalized`
  int64_t id;
  bool normalized, lstrip, rstrip;
};

// Unicode White_Space, which lstrip/rstrip take (as Rust's char::is_whitespace).
bool is_white_space(uint32_t c) {
  return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Leftmost-longest search for a set of strings, as the library's Aho-Corasick matcher does.
class Matcher {
 public:
  void add(const std::string& pattern, size_t index) {
    if (pattern.empty()) return;
    auto& list = by_first_[static_cast<unsigned char>(pattern[0])];
    list.emplace_back(pattern, index);
    std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }
  // The first match at or after `from`: (position, index); position npos when none.
  std::pair<size_t, size_t> find(const std::string& text, size_t from) const {
    for (size_t pos = from; pos < text.size(); ++pos) {
      for (const auto& [p, index] : by_first_[static_cast<unsigned char>(text[pos])]) {
        if (text.compare(pos, p.size(), p) == 0) return {pos, index};
      }
    }
    return {std::string::npos, 0};
  }

 private:
  std::array<std::vector<std::pair<std::string, size_t>>, 256> by_first_;
};

uint64_t pair_key(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

}  // namespace

struct HfTokenizer::Impl {
  std::string path;
  hf::Normalize normalize;
  hf::PreTokenize pre_tokenize;
  hf::Decode decode;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> tokens;  // by id; vocab and added tokens
  std::vector<bool> has_token;
  std::unordered_map<uint64_t, std::pair<uint32_t, int64_t>> merges;  // (left, right) -> (rank, merged id)
  int64_t unk = -1;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::array<int64_t, 256> byte_ids{};  // "<0xAB>" tokens for byte_fallback, -1 if missing
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int64_t> added_ids;
  Matcher raw_matcher, normalized_matcher;
  bool adds_prefix = false;
  bool has_post = false;
  std::vector<int64_t> prefix, suffix;  // what the post_processor adds around a single sequence

  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(path + ": " + what); }
  void load_model(const json& m);
  void load_merges(const json& merges);
  void load_added(const json& list);
  void load_post_processor(const json& p);
  int64_t post_token_id(const json& special_tokens, const std::string& name) const;
  void set_token(int64_t id, const std::string& t);
  template <class Gap>
  void split_added(const std::string& text, const Matcher& m, const Gap& gap, std::vector<int64_t>& out) const;
  void encode_word(const std::string& word, std::vector<int64_t>& out) const;
};

void HfTokenizer::Impl::set_token(int64_t id, const std::string& t) {
  if (id < 0 || id > (int64_t{1} << 31)) fail("token '" + t + "' has id " + std::to_string(id) + " (expected 0 .. 2^31)");
  if (static_cast<size_t>(id) >= tokens.size()) {
    tokens.resize(id + 1);
    has_token.resize(id + 1);
  }
  tokens[id] = t;
  has_token[id] = true;
}

void HfTokenizer::Impl::load_model(const json& m) {
  if (!m.is_object() || m.value("type", "") != "BPE") {
    fail("model: unsupported type '" + (m.is_object() ? m.value("type", std::string("(none)")) : m.dump()) +
         "' (qlora reads BPE)");
  }
  for (const auto& [k, v] : m.items()) {
    static const std::vector<std::string> known = {"type", "dropout", "unk_token", "continuing_subword_prefix",
                                                   "end_of_word_suffix", "fuse_unk", "byte_fallback",
                                                   "ignore_merges", "vocab", "merges"};
    if (std::find(known.begin(), known.end(), k) == known.end()) fail("model: unsupported option \"" + k + "\"");
    const bool unset = v.is_null() || (v.is_string() && v.get<std::string>().empty());
    if ((k == "dropout" || k == "continuing_subword_prefix" || k == "end_of_word_suffix") && !unset) {
      fail("model: \"" + k + "\" is " + v.dump() + "; qlora supports BPE only without it");
    }
  }
  if (!m.contains("vocab") || !m["vocab"].is_object()) fail("model: expected \"vocab\": {token: id, ...}");
  for (const auto& [t, id] : m["vocab"].items()) {
    if (!id.is_number_integer()) fail("model.vocab: '" + t + "' has no integer id");
    vocab[t] = id.get<int64_t>();
    set_token(id.get<int64_t>(), t);
  }
  fuse_unk = m.value("fuse_unk", false);
  byte_fallback = m.value("byte_fallback", false);
  ignore_merges = m.value("ignore_merges", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    const auto it = vocab.find(m["unk_token"].get<std::string>());
    if (it == vocab.end()) fail("model: unk_token '" + m["unk_token"].get<std::string>() + "' is not in the vocab");
    unk = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    static const char* hex = "0123456789ABCDEF";
    const auto it = vocab.find(std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">");
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
  }
  if (!m.contains("merges")) fail("model: BPE without \"merges\"");
  load_merges(m["merges"]);
}

void HfTokenizer::Impl::load_merges(const json& list) {
  if (!list.is_array()) fail("model.merges: expected a list of \"a b\" strings or [a, b] pairs");
  for (size_t i = 0; i < list.size(); ++i) {
    const json& e = list[i];
    const std::string where = "model.merges[" + std::to_string(i) + "]";
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) fail(where + ": '" + s + "' is not \"a b\"");
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      fail(where + ": expected \"a b\" or [a, b], got " + e.dump());
    }
    const auto ia = vocab.find(a), ib = vocab.find(b), ij = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || ij == vocab.end()) {
      fail(where + ": '" + (ia == vocab.end() ? a : ib == vocab.end() ? b : a + b) + "' is not in the vocab");
    }
    // The first line for a pair wins, as the library keeps the lowest rank.
    merges.emplace(pair_key(ia->second, ib->second), std::make_pair(static_cast<uint32_t>(i), ij->second));
  }
}

void HfTokenizer::Impl::load_added(const json& list) {
  if (list.is_null()) return;
  if (!list.is_array()) fail("added_tokens: expected a list");
  for (size_t i = 0; i < list.size(); ++i) {
    const json& e = list[i];
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!e.is_object() || !e.contains("id") || !e["id"].is_number_integer() || !e.contains("content") ||
        !e["content"].is_string()) {
      fail(where + ": expected {\"id\": int, \"content\": string, ...}");
    }
    if (e.value("single_word", false)) fail(where + ": single_word is not supported");
    AddedToken t{e["content"], "", e["id"], e.value("normalized", !e.value("special", false)), e.value("lstrip", false),
                 e.value("rstrip", false)};
    t.pattern = t.normalized ? normalize(t.content) : t.content;
    // The library hands a normalized token to the decoder in its normalized form (Llama-2's
    // Prepend normalizer makes "hello world" "▁hello▁world", which decodes with a space).
    set_token(t.id, t.pattern);
    added_ids[t.content] = t.id;
    (t.normalized ? normalized_matcher : raw_matcher).add(t.pattern, added.size());
    added.push_back(std::move(t));
  }
}

std::shared_ptr<const HfTokenizer> HfTokenizer::load(const std::string& path) {
  std::shared_ptr<HfTokenizer> t(new HfTokenizer());
  Impl& im = *t->impl_;
  im.path = path;
  const auto text = io::read_file(path);
  if (!text) im.fail("cannot open");
  json j;
  try {
    j = json::parse(*text);
  } catch (const json::parse_error& e) {
    im.fail(std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) im.fail("expected a JSON object (a tokenizer.json)");
  for (const auto& [k, v] : j.items()) {
    static const std::vector<std::string> known = {"version", "truncation", "padding", "added_tokens", "normalizer",
                                                   "pre_tokenizer", "post_processor", "decoder", "model"};
    if (std::find(known.begin(), known.end(), k) == known.end()) im.fail("unsupported key \"" + k + "\"");
  }
  if (j.contains("truncation") && !j["truncation"].is_null()) im.fail("truncation is set; qlora never truncates in the tokenizer");
  if (!j.contains("model")) im.fail("no \"model\"");
  im.normalize = hf::make_normalizer(j.value("normalizer", json()), path + ": normalizer");
  im.pre_tokenize = hf::make_pre_tokenizer(j.value("pre_tokenizer", json()), path + ": pre_tokenizer");
  im.decode = hf::make_decoder(j.value("decoder", json()), path + ": decoder");
  im.load_model(j["model"]);
  im.load_added(j.value("added_tokens", json()));
  im.has_post = j.contains("post_processor") && !j["post_processor"].is_null();
  if (im.has_post) im.load_post_processor(j["post_processor"]);
  std::vector<hf::Piece> probe = {{im.normalize("x"), true}};
  im.pre_tokenize(probe);
  im.adds_prefix = probe.size() != 1 || probe[0].text != "x";
  return t;
}

// The id of TemplateProcessing's special token `name`: its "ids" entry in special_tokens (one id;
// a multi-id special token is refused), else the token of that name.
int64_t HfTokenizer::Impl::post_token_id(const json& special_tokens, const std::string& name) const {
  if (special_tokens.is_object() && special_tokens.contains(name)) {
    const json& ids = special_tokens[name].value("ids", json());
    if (!ids.is_array() || ids.size() != 1 || !ids[0].is_number_integer())
      fail("post_processor: special token '" + name + "' must have exactly one id, has " + ids.dump());
    return ids[0].get<int64_t>();
  }
  if (const auto it = added_ids.find(name); it != added_ids.end()) return it->second;
  if (const auto it = vocab.find(name); it != vocab.end()) return it->second;
  fail("post_processor: special token '" + name + "' is not a token");
}

// What encode(text, add_special_tokens=True) puts around the ids, for the processors the
// tokenizer.json files of LLMs use. Another kind is refused: BOS/EOS would otherwise be guessed.
void HfTokenizer::Impl::load_post_processor(const json& p) {
  const std::string type = p.is_object() ? p.value("type", "") : "";
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (const json& q : p.value("processors", json::array())) load_post_processor(q);
    return;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    const auto id_of = [&](const char* key) {
      const json& pair = p.value(key, json());  // ["[CLS]", 101]
      if (!pair.is_array() || pair.size() != 2 || !pair[1].is_number_integer())
        fail("post_processor: " + type + "." + key + " must be [token, id]");
      return pair[1].get<int64_t>();
    };
    // A later processor of a Sequence wraps what the earlier ones made.
    prefix.insert(prefix.begin(), id_of("cls"));
    suffix.push_back(id_of("sep"));
    return;
  }
  if (type != "TemplateProcessing")
    fail("post_processor: unsupported type '" + type + "' (qlora reads TemplateProcessing, ByteLevel, Bert/RobertaProcessing and Sequence)");
  bool after = false;
  std::vector<int64_t> before_ids, after_ids;
  for (const json& item : p.value("single", json::array())) {
    if (item.contains("Sequence")) {
      if (after) fail("post_processor: TemplateProcessing.single names the sequence twice");
      after = true;
    } else if (item.contains("SpecialToken")) {
      const int64_t id = post_token_id(p.value("special_tokens", json()), item["SpecialToken"].value("id", ""));
      (after ? after_ids : before_ids).push_back(id);
    } else {
      fail("post_processor: unexpected TemplateProcessing.single item " + item.dump());
    }
  }
  if (!after) fail("post_processor: TemplateProcessing.single has no $A");
  prefix.insert(prefix.begin(), before_ids.begin(), before_ids.end());
  suffix.insert(suffix.end(), after_ids.begin(), after_ids.end());
}

// Cuts `text` at the added tokens `m` finds: each token's id goes to `out`, and the text before
// it to gap(text, offset) (also the text after the last one; gaps may be empty).
template <class Gap>
void HfTokenizer::Impl::split_added(const std::string& text, const Matcher& m, const Gap& gap,
                                    std::vector<int64_t>& out) const {
  size_t gap_start = 0;
  for (;;) {
    const auto [pos, index] = m.find(text, gap_start);
    if (pos == std::string::npos) break;
    const AddedToken& t = added[index];
    size_t begin = pos, end = pos + t.pattern.size();
    // lstrip/rstrip: the token takes the white space beside it, which then is no text.
    while (t.lstrip && begin > gap_start) {
      size_t prev = begin;
      if (!is_white_space(utf8_prev(text, gap_start, prev))) break;
      begin = prev;
    }
    while (t.rstrip && end < text.size()) {
      size_t next = end;
      if (!is_white_space(utf8_next(text, next))) break;
      end = next;
    }
    gap(text.substr(gap_start, begin - gap_start), gap_start);
    out.push_back(t.id);
    gap_start = end;
  }
  gap(text.substr(gap_start), gap_start);
}

void HfTokenizer::Impl::encode_word(const std::string& word, std::vector<int64_t>& out) const {
  if (ignore_merges) {
    if (const auto it = vocab.find(word); it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // The initial symbols: each character's token, else its bytes' "<0xAB>" tokens (byte_fallback),
  // else unk (one per character, or one per run with fuse_unk); without unk the character is
  // dropped, as the library drops it.
  std::vector<int64_t> ids;
  bool pending_unk = false;
  for (size_t i = 0, len = 0; i < word.size(); i += len) {
    size_t next = i;
    utf8_next(word, next);
    len = next - i;
    const std::string c = word.substr(i, len);
    if (const auto it = vocab.find(c); it != vocab.end()) {
      if (pending_unk) ids.push_back(unk);
      pending_unk = false;
      ids.push_back(it->second);
      continue;
    }
    const bool bytes_known = byte_fallback && std::all_of(c.begin(), c.end(), [&](char b) {
      return byte_ids[static_cast<unsigned char>(b)] >= 0;
    });
    if (bytes_known) {
      if (pending_unk) ids.push_back(unk);
      pending_unk = false;
      for (const char b : c) ids.push_back(byte_ids[static_cast<unsigned char>(b)]);
    } else if (unk >= 0) {
      if (pending_unk && !fuse_unk) ids.push_back(unk);
      pending_unk = true;
    }
  }
  if (pending_unk) ids.push_back(unk);
  // A pair's rank is its merge's line in the file: the library's merge order.
  const auto merge_of = [&](size_t a, size_t b) { return merges.find(pair_key(ids[a], ids[b])); };
  bpe_merge(
      ids.size(),
      [&](size_t a, size_t b, size_t) {
        const auto it = merge_of(a, b);
        return it == merges.end() ? kNoRank : it->second.first;
      },
      [&](size_t a, size_t b) { ids[a] = merge_of(a, b)->second.second; },
      [&](size_t a, size_t) { out.push_back(ids[a]); });
}

HfTokenizer::HfTokenizer() : impl_(std::make_unique<Impl>()) {}
HfTokenizer::~HfTokenizer() = default;

std::vector<int64_t> HfTokenizer::encode(std::string_view text) const {
  const Impl& im = *impl_;
  const std::string valid = utf8_valid(text) ? std::string(text) : utf8_replace_invalid(text);
  std::vector<int64_t> out;
  // Tokens written as they appear are found first in the raw text; the rest of it is normalized,
  // then searched for the normalized ones; what is left goes through the pre-tokenizer and BPE.
  im.split_added(valid, im.raw_matcher, [&](const std::string& gap, size_t at) {
    if (gap.empty()) return;
    im.split_added(im.normalize(gap), im.normalized_matcher, [&](const std::string& rest, size_t at2) {
      if (rest.empty()) return;
      std::vector<hf::Piece> pieces = {{rest, at == 0 && at2 == 0}};
      im.pre_tokenize(pieces);
      for (const auto& p : pieces) {
        if (!p.text.empty()) im.encode_word(p.text, out);
      }
    }, out);
  }, out);
  return out;
}

std::string HfTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] < 0 || ids[k] >= vocab_size() || !impl_->has_token[ids[k]]) {
      throw std::out_of_range("tokenizer '" + path() + "': decode: id " + std::to_string(ids[k]) + " at position " +
                              std::to_string(k) + " is no token (vocab size " + std::to_string(vocab_size()) + ")");
    }
    tokens.push_back(impl_->tokens[ids[k]]);
  }
  impl_->decode(tokens);
  std::string text;
  for (const auto& t : tokens) text += t;
  return text;
}

int64_t HfTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->tokens.size()); }

int64_t HfTokenizer::token_id(std::string_view token) const {
  const std::string t(token);
  if (const auto it = impl_->added_ids.find(t); it != impl_->added_ids.end()) return it->second;
  const auto it = impl_->vocab.find(t);
  return it == impl_->vocab.end() ? -1 : it->second;
}

std::string HfTokenizer::token(int64_t id) const {
  if (id < 0 || id >= vocab_size() || !impl_->has_token[id]) {
    throw std::out_of_range("tokenizer '" + path() + "': id " + std::to_string(id) + " is no token");
  }
  return impl_->tokens[id];
}

bool HfTokenizer::adds_prefix() const { return impl_->adds_prefix; }
const std::vector<int64_t>& HfTokenizer::special_prefix() const { return impl_->prefix; }
const std::vector<int64_t>& HfTokenizer::special_suffix() const { return impl_->suffix; }
bool HfTokenizer::has_post_processor() const { return impl_->has_post; }
const std::string& HfTokenizer::path() const { return impl_->path; }

}  // namespace qlora::data
