#include "qlora/gguf/tokenizer_meta.h"

#include <algorithm>
#include <map>
#include <stdexcept>

#include "qlora/checkpoint/serving.h"
#include "qlora/data/chat_template.h"
#include "qlora/data/tokenizer.h"
#include "qlora/gguf/sentencepiece_model.h"
#include "qlora/io/read_file.h"

namespace qlora::gguf {
namespace {

using json = nlohmann::json;
using Metadata = std::vector<std::pair<std::string, Value>>;

// llama.cpp's token types (llama_token_type).
constexpr int32_t kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6;

// The regexes of tokenizer.json's Split pre-tokenizers that llama.cpp names (its llama-vocab.cpp
// keeps them as "original regex from tokenizer.json").
constexpr const char* kLlama3Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words.
constexpr const char* kQwen35Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

bool is_byte_level(const json& p, bool use_regex) {
  return p.is_object() && p.value("type", "") == "ByteLevel" && !p.value("add_prefix_space", false) &&
         p.value("use_regex", true) == use_regex;
}

// Split(pattern regex, Isolated, not inverted): its regex, else "".
std::string split_regex(const json& p) {
  if (!p.is_object() || p.value("type", "") != "Split" || p.value("behavior", "") != "Isolated" ||
      p.value("invert", false) || !p.contains("pattern") || !p["pattern"].contains("Regex"))
    return "";
  return p["pattern"]["Regex"].get<std::string>();
}

// A token llama.cpp's converter treats as a control token even when not marked special.
bool looks_special(const std::string& t) {
  const auto wrapped = [&](const std::string& a, const std::string& b) {
    return t.size() >= a.size() + b.size() && t.compare(0, a.size(), a) == 0 &&
           t.compare(t.size() - b.size(), b.size(), b) == 0;
  };
  return t == "<pad>" || t == "<mask>" || wrapped("<|", "|>") || wrapped("<\xef\xbd\x9c", "\xef\xbd\x9c>") ||
         wrapped("<unused", ">");
}

}  // namespace

std::string pre_tokenizer_name(const json& tj, const std::string& where) {
  const json& norm = tj.contains("normalizer") ? tj["normalizer"] : json();
  const json& pre = tj.contains("pre_tokenizer") ? tj["pre_tokenizer"] : json();
  const bool nfc = norm.is_object() && norm.value("type", "") == "NFC";
  std::string name;
  if (norm.is_null() && is_byte_level(pre, true)) name = "gpt-2";
  if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
      pre["pretokenizers"].size() == 2) {
    const json& a = pre["pretokenizers"][0];
    const json& b = pre["pretokenizers"][1];
    if (norm.is_null() && a.value("type", "") == "Digits" && a.value("individual_digits", false) &&
        is_byte_level(b, true))
      name = "smollm";
    if (norm.is_null() && split_regex(a) == kLlama3Regex && is_byte_level(b, false)) name = "llama-bpe";
    // llama.cpp does not apply Qwen's NFC normalizer: text already in NFC (nearly all) tokenizes alike.
    if ((norm.is_null() || nfc) && split_regex(a) == kQwen2Regex && is_byte_level(b, false)) name = "qwen2";
    if ((norm.is_null() || nfc) && split_regex(a) == kQwen35Regex && is_byte_level(b, false)) name = "qwen35";
  }
  if (name.empty()) {
    throw std::invalid_argument(where + ": the pre-tokenizer " + pre.dump() + " (normalizer " + norm.dump() +
                                ") is not one llama.cpp splits the same way under a name qlora knows "
                                "(gpt-2, smollm, llama-bpe, qwen2, qwen35); no GGUF is written");
  }
  return name;
}

namespace {

// tokenizer.ggml.* of a byte-level BPE tokenizer.json.
void add_bpe_vocab(const json& tj, const std::string& file, int64_t vocab_size, Metadata& metadata) {
  const json& model = tj.at("model");
  if (model.value("type", "") != "BPE" || !tj.contains("decoder") || tj["decoder"].value("type", "") != "ByteLevel")
    throw std::invalid_argument(file + ": GGUF export writes tokenizer.json vocabularies of byte-level BPE (model "
                                "BPE, decoder ByteLevel) or sentencepiece's form (BPE with byte_fallback, a "
                                "ByteFallback decoder)");
  const std::string pre = pre_tokenizer_name(tj, file);

  std::map<int64_t, std::string> by_id;
  for (const auto& [token, id] : model.at("vocab").items()) by_id[id.get<int64_t>()] = token;
  std::map<int64_t, std::pair<std::string, bool>> added;  // id -> (content, special)
  for (const auto& t : tj.value("added_tokens", json::array()))
    added[t.at("id").get<int64_t>()] = {t.at("content").get<std::string>(), t.value("special", false)};
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int64_t i = 0; i < vocab_size; ++i) {
    if (const auto a = added.find(i); a != added.end()) {
      tokens.push_back(a->second.first);
      types.push_back(a->second.second || looks_special(a->second.first) ? kControl : kUserDefined);
    } else if (const auto v = by_id.find(i); v != by_id.end()) {
      tokens.push_back(v->second);
      types.push_back(kNormal);
    } else {
      tokens.push_back("[PAD" + std::to_string(i) + "]");
      types.push_back(kUnused);
    }
  }
  std::vector<std::string> merges;
  for (const auto& m : model.value("merges", json::array()))
    merges.push_back(m.is_string() ? m.get<std::string>() : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  metadata.emplace_back("tokenizer.ggml.model", Value::string("gpt2"));
  metadata.emplace_back("tokenizer.ggml.pre", Value::string(pre));
  metadata.emplace_back("tokenizer.ggml.tokens", Value::strings_array(std::move(tokens)));
  metadata.emplace_back("tokenizer.ggml.token_type", Value::i32_array(types));
  metadata.emplace_back("tokenizer.ggml.merges", Value::strings_array(std::move(merges)));
}

// Replaces "▁" by plain spaces: llama.cpp matches user-defined pieces in the raw text before it
// escapes spaces to "▁", so they are stored with plain spaces (as its converter stores them).
std::string plain_spaces(std::string piece) {
  for (size_t at = piece.find("\xe2\x96\x81"); at != std::string::npos; at = piece.find("\xe2\x96\x81", at + 1))
    piece.replace(at, 3, " ");
  return piece;
}

struct SpVocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
};

// The HF added tokens of a sentencepiece tokenizer (Phi-3's <|endoftext|>, <|end|>... past the
// model's pieces; Gemma's <start_of_turn> marked special), as llama.cpp's converter applies them:
// added_tokens.json's as user-defined, then tokenizer_config.json's added_tokens_decoder, control
// where special (or looking special), user-defined otherwise; score -1000. Ids past vocab_size are
// ignored, as there.
void apply_added_tokens(const std::string& dir, const data::Tokenizer& tok, SpVocab& v) {
  const auto set = [&](int64_t id, const std::string& content, bool control) {
    if (id < 0 || id >= static_cast<int64_t>(v.tokens.size())) return;
    v.tokens[id] = control ? content : plain_spaces(content);
    v.types[id] = control ? kControl : kUserDefined;
    v.scores[id] = -1000.0f;
  };
  if (const auto text = io::read_file(dir + "/added_tokens.json")) {
    const json added = json::parse(*text);  // named: items() of a temporary would dangle in the loop
    for (const auto& [content, id] : added.items())
      if (id.is_number_integer()) set(id.get<int64_t>(), content, false);
  }
  if (!tok.config() || !tok.config()->contains("added_tokens_decoder")) return;
  for (const auto& [id, t] : (*tok.config())["added_tokens_decoder"].items()) {
    const std::string content = t.value("content", "");
    set(std::stoll(id), content, t.value("special", false) || looks_special(content));
  }
}

// tokenizer.ggml.* of a sentencepiece model: pieces, scores and their types (sentencepiece's type
// numbers are llama.cpp's), the dummy-prefix flag, then the HF added tokens; ids past both are
// [PAD<i>].
void add_sentencepiece_vocab(const std::string& file, const std::string& dir, const data::Tokenizer& tok,
                             int64_t vocab_size, Metadata& metadata) {
  const SentencePieceModel sp = read_sentencepiece_model(file);
  SpVocab v;
  for (int64_t i = 0; i < vocab_size; ++i) {
    const bool have = i < static_cast<int64_t>(sp.pieces.size());
    std::string piece = have ? sp.pieces[i].piece : "[PAD" + std::to_string(i) + "]";
    if (have && sp.pieces[i].type == kUserDefined) piece = plain_spaces(piece);
    v.tokens.push_back(std::move(piece));
    v.scores.push_back(have ? sp.pieces[i].score : -1000.0f);
    v.types.push_back(have ? sp.pieces[i].type : kUnused);
  }
  apply_added_tokens(dir, tok, v);
  metadata.emplace_back("tokenizer.ggml.model", Value::string("llama"));
  metadata.emplace_back("tokenizer.ggml.tokens", Value::strings_array(std::move(v.tokens)));
  metadata.emplace_back("tokenizer.ggml.scores", Value::f32_array(v.scores));
  metadata.emplace_back("tokenizer.ggml.token_type", Value::i32_array(v.types));
  metadata.emplace_back("tokenizer.ggml.add_space_prefix", Value::boolean(sp.add_dummy_prefix));
}

// How a sentencepiece-style tokenizer.json (BPE with byte fallback, spaces as "▁") begins a text:
// with a "▁" (Llama 2: Metaspace prepend_scheme first/always, or a Prepend("▁") normalizer) or not
// (Gemma: a Replace(" ", "▁") normalizer only). Anything else splits or escapes otherwise than
// llama.cpp's "llama" vocabulary, and is refused by name.
bool sentencepiece_space_prefix(const json& tj, const std::string& file) {
  const std::string space = "\xe2\x96\x81";
  const json& norm = tj.contains("normalizer") ? tj["normalizer"] : json();
  const json& pre = tj.contains("pre_tokenizer") ? tj["pre_tokenizer"] : json();
  const auto is = [](const json& j, const char* type) { return j.is_object() && j.value("type", "") == type; };
  const auto replaces_spaces = [&](const json& j) {
    return is(j, "Replace") && j.contains("pattern") && j["pattern"].value("String", "") == " " &&
           j.value("content", "") == space;
  };
  const auto prepends = [&](const json& j) { return is(j, "Prepend") && j.value("prepend", "") == space; };
  // Gemma's Split on " " after a normalizer that left no " " splits nothing.
  const bool no_split = pre.is_null() || (is(pre, "Split") && pre.contains("pattern") &&
                                          pre["pattern"].value("String", "") == " " && replaces_spaces(norm));
  if (replaces_spaces(norm) && no_split) return false;
  if (is(norm, "Sequence") && norm.contains("normalizers") && norm["normalizers"].size() == 2 &&
      prepends(norm["normalizers"][0]) && replaces_spaces(norm["normalizers"][1]) && pre.is_null())
    return true;
  if (norm.is_null() && is(pre, "Metaspace") && pre.value("replacement", "") == space && !pre.value("split", true)) {
    const std::string scheme = pre.value("prepend_scheme", pre.value("add_prefix_space", true) ? "always" : "never");
    if (scheme == "first" || scheme == "always") return true;
    if (scheme == "never") return false;
  }
  throw std::invalid_argument(file + ": the normalizer " + norm.dump() + " and pre-tokenizer " + pre.dump() +
                              " of this byte-fallback BPE are not a sentencepiece form llama.cpp's \"llama\" "
                              "vocabulary splits alike (spaces as \xe2\x96\x81, Metaspace without split); no GGUF is written");
}

// tokenizer.ggml.* of a sentencepiece model that only ships as tokenizer.json (as transformers
// writes it, and as more Hub repositories ship Gemma): llama.cpp's "llama" vocabulary. That
// tokenizer merges the adjacent pair whose result scores highest; BPE merges the pair of lowest
// rank: so a token's score is minus the rank of the first merge that makes it (tokens no merge
// makes score 0, and are never a merge's result). <0xAB> pieces are byte tokens, the unknown token
// is unknown, added tokens control (special) or user-defined, ids past both [PAD<i>].
void add_sentencepiece_json_vocab(const json& tj, const std::string& file, int64_t vocab_size, Metadata& metadata) {
  const json& model = tj.at("model");
  const bool space_prefix = sentencepiece_space_prefix(tj, file);
  std::map<std::string, int64_t> first_merge;
  int64_t rank = 0;
  for (const auto& m : model.value("merges", json::array())) {
    std::string joined;
    if (m.is_string()) {
      const std::string pair = m.get<std::string>();
      const size_t at = pair.find(' ');
      joined = pair.substr(0, at) + (at == std::string::npos ? "" : pair.substr(at + 1));
    } else {
      joined = m.at(0).get<std::string>() + m.at(1).get<std::string>();
    }
    first_merge.emplace(joined, rank++);
  }
  SpVocab v{std::vector<std::string>(vocab_size), std::vector<float>(vocab_size, 0.0f),
            std::vector<int32_t>(vocab_size, kUnused)};
  for (int64_t i = 0; i < vocab_size; ++i) v.tokens[i] = "[PAD" + std::to_string(i) + "]";
  const std::string unk = model.value("unk_token", json()).is_string() ? model["unk_token"].get<std::string>() : "";
  for (const auto& [token, id_json] : model.at("vocab").items()) {
    const int64_t id = id_json.get<int64_t>();
    if (id < 0 || id >= vocab_size) continue;
    const bool byte = token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>';
    v.tokens[id] = token;
    v.types[id] = byte ? kByte : token == unk ? kUnknown : kNormal;
    if (const auto m = first_merge.find(token); m != first_merge.end()) v.scores[id] = -static_cast<float>(m->second);
  }
  for (const auto& t : tj.value("added_tokens", json::array())) {
    const int64_t id = t.at("id").get<int64_t>();
    if (id < 0 || id >= vocab_size) continue;
    const std::string content = t.at("content").get<std::string>();
    const bool control = t.value("special", false) || looks_special(content);
    v.tokens[id] = control ? content : plain_spaces(content);
    v.types[id] = content == unk ? kUnknown : control ? kControl : kUserDefined;
    v.scores[id] = -1000.0f;
  }
  metadata.emplace_back("tokenizer.ggml.model", Value::string("llama"));
  metadata.emplace_back("tokenizer.ggml.tokens", Value::strings_array(std::move(v.tokens)));
  metadata.emplace_back("tokenizer.ggml.scores", Value::f32_array(v.scores));
  metadata.emplace_back("tokenizer.ggml.token_type", Value::i32_array(v.types));
  metadata.emplace_back("tokenizer.ggml.add_space_prefix", Value::boolean(space_prefix));
}

// tokenizer.json: byte-level BPE (llama.cpp's "gpt2" vocabulary) or a sentencepiece model in
// tokenizer.json form (BPE with byte_fallback, a ByteFallback decoder: its "llama" vocabulary).
void add_tokenizer_json_vocab(const std::string& file, int64_t vocab_size, Metadata& metadata) {
  const auto text = io::read_file(file);
  if (!text) throw std::invalid_argument(file + ": cannot read");
  const json tj = json::parse(*text);
  const json& model = tj.at("model");
  const json& dec = tj.contains("decoder") ? tj["decoder"] : json();
  const json decoders = dec.is_object() && dec.value("type", "") == "Sequence" ? dec.value("decoders", json::array())
                                                                               : json::array();
  const bool byte_fallback_decoder = std::any_of(decoders.begin(), decoders.end(), [](const json& d) {
    return d.is_object() && d.value("type", "") == "ByteFallback";
  });
  if (model.value("type", "") == "BPE" && model.value("byte_fallback", false) && byte_fallback_decoder)
    add_sentencepiece_json_vocab(tj, file, vocab_size, metadata);
  else
    add_bpe_vocab(tj, file, vocab_size, metadata);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

void add_tokenizer_metadata(const std::string& dir, int64_t vocab_size, Metadata& metadata) {
  const std::string file = data::Tokenizer::find_file(dir);
  const data::Tokenizer tok = data::Tokenizer::open(file);
  if (ends_with(file, "tokenizer.json"))
    io::naming_file(file, [&] { add_tokenizer_json_vocab(file, vocab_size, metadata); });
  else if (ends_with(file, ".model") && !ends_with(file, "original/tokenizer.model"))
    add_sentencepiece_vocab(file, dir, tok, vocab_size, metadata);
  else throw std::invalid_argument(file + ": GGUF export writes tokenizer.json (byte-level BPE or sentencepiece's form) and sentencepiece "
                                   "vocabularies; Meta's tiktoken file is not written yet");
  const auto id = [&](const char* key, int64_t v) {
    if (v >= 0) metadata.emplace_back(key, Value::u32(static_cast<uint32_t>(v)));
  };
  id("tokenizer.ggml.bos_token_id", tok.bos_id());
  id("tokenizer.ggml.eos_token_id", tok.eos_id());
  id("tokenizer.ggml.unknown_token_id", tok.unk_id());
  // A padding id only where the tokenizer has one of its own (tokenizer.json's, or a pad_token in
  // tokenizer_config.json), not the stand-in qlora pads batches with.
  const bool named_pad = tok.config() && tok.config()->contains("pad_token") && !(*tok.config())["pad_token"].is_null();
  if (ends_with(file, "tokenizer.json") || named_pad) id("tokenizer.ggml.padding_token_id", tok.pad_id());
  // Served as qlora serves it: a run's BOS rule (data.add_bos) and template (checkpoint/serving.h).
  const checkpoint::Serving serving = checkpoint::serving_format(dir, tok);
  metadata.emplace_back("tokenizer.ggml.add_bos_token", Value::boolean(serving.add_bos));
  metadata.emplace_back("tokenizer.ggml.add_eos_token", Value::boolean(tok.adds_eos()));
  if (serving.chat_template) metadata.emplace_back("tokenizer.chat_template", Value::string(serving.chat_template->source()));
}

}  // namespace qlora::gguf
