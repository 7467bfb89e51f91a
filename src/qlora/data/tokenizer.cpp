#include "qlora/data/tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "qlora/data/hf_tokenizer.h"
#include "qlora/data/tiktoken_bpe.h"
#include "qlora/io/read_file.h"

namespace qlora::data {
namespace {

// Encoded in front of a continuation and dropped again (torchtune's trim_leading_whitespace
// trick): the dummy prefix attaches to "\n" instead of to the text. A newline is a byte-fallback
// or standalone piece in Llama-style models, so it never merges with the text that follows.
constexpr std::string_view kContinuationPrefix = "\n";

std::vector<int64_t> to_int64(const std::vector<int>& ids) { return {ids.begin(), ids.end()}; }

// Where an HF checkpoint keeps its tokenizer, in the order open() tries them: Llama-3 repositories
// have tokenizer.json at the top and Meta's tiktoken file under original/.
// A checkpoint directory's tokenizer: Meta's or sentencepiece's own file first (what earlier
// releases read, so a run's tokenizer and its resume fingerprint do not change under it), then
// Llama-3's original/ copy, then the HF tokenizer.json (all that Qwen ships).
constexpr const char* kTokenizerFiles[] = {"tokenizer.model", "original/tokenizer.model", "tokenizer.json"};

bool looks_like_json(std::string_view head) {
  const size_t first = head.find_first_not_of(" \t\r\n");
  return first != std::string_view::npos && head[first] == '{';
}

// tokenizer_config.json's entry for `key`: a string, or {"content": string} as newer files write
// it; empty when absent or null.
std::string config_token(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return "";
  const auto& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

}  // namespace

std::string Tokenizer::find_file(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) return path;
  for (const char* rel : kTokenizerFiles) {
    if (fs::is_regular_file(fs::path(path) / rel)) return (fs::path(path) / rel).string();
  }
  throw std::runtime_error("tokenizer: directory '" + path +
                           "' has no tokenizer.model, original/tokenizer.model or tokenizer.json");
}

Tokenizer Tokenizer::open(const std::string& path_or_dir) {
  const std::string path = find_file(path_or_dir);
  return io::naming_file(path, [&] { return open_file(path); });
}

Tokenizer Tokenizer::open_file(const std::string& path) {
  Tokenizer t;
  t.path_ = path;
  io::check_file_to_read(path);  // sentencepiece reads it whole
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("tokenizer: cannot open '" + path + "'");
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  if (looks_like_json(head)) {
    t.open_hf();
    return t;
  }
  if (looks_like_tiktoken(head)) {
    t.open_tiktoken();
    return t;
  }
  t.sp_ = std::make_shared<sentencepiece::SentencePieceProcessor>();
  const auto status = t.sp_->Load(path);
  if (!status.ok()) {
    throw std::runtime_error("tokenizer: cannot load sentencepiece model '" + path + "': " +
                             status.ToString());
  }
  t.vocab_size_ = t.sp_->GetPieceSize();
  t.bos_id_ = t.sp_->bos_id();
  t.eos_id_ = t.sp_->eos_id();
  t.unk_id_ = t.sp_->unk_id();
  const int64_t pad = t.sp_->pad_id();
  t.pad_id_ = pad >= 0 ? pad : (t.eos_id_ >= 0 ? t.eos_id_ : 0);
  t.prefix_ids_ = t.encode(kContinuationPrefix);
  t.read_config();
  t.apply_config_flags(true, false);
  return t;
}

void Tokenizer::open_tiktoken() {
  bpe_ = TiktokenBpe::load(path_, kLlama3Pattern, llama3_special_tokens());
  vocab_size_ = bpe_->vocab_size();
  bos_id_ = bpe_->special_id("<|begin_of_text|>");
  eos_id_ = bpe_->special_id("<|end_of_text|>");
  eot_id_ = bpe_->special_id("<|eot_id|>");
  const int64_t pad = bpe_->special_id("<|finetune_right_pad_id|>");
  pad_id_ = pad >= 0 ? pad : eos_id_;
  read_config();
  apply_config_flags(true, false);
}

void Tokenizer::read_config() {
  const auto dir = std::filesystem::path(path_).parent_path();
  // Meta's original/tokenizer.model: the HF files sit one level up.
  for (const auto& d : {dir, dir.filename() == "original" ? dir.parent_path() : dir}) {
    const auto file = (d / "tokenizer_config.json").string();
    const auto text = io::read_file(file);
    if (!text) continue;
    try {
      config_ = std::make_shared<const nlohmann::json>(nlohmann::json::parse(*text));
    } catch (const nlohmann::json::parse_error& e) {
      throw std::runtime_error(file + ": not valid JSON: " + e.what());
    }
    if (!config_->is_object()) throw std::runtime_error(file + ": expected a JSON object");
    return;
  }
}

// tokenizer_config.json's add_bos_token / add_eos_token over the given defaults; only a token the
// tokenizer has can be added.
void Tokenizer::apply_config_flags(bool default_bos, bool default_eos) {
  const auto flag = [&](const char* key, bool fallback) {
    if (!config_ || !config_->contains(key) || (*config_)[key].is_null()) return fallback;
    if (!(*config_)[key].is_boolean())
      throw std::runtime_error("tokenizer_config.json beside " + path_ + ": " + key + " must be true or false");
    return (*config_)[key].get<bool>();
  };
  adds_bos_ = flag("add_bos_token", default_bos) && bos_id_ >= 0;
  adds_eos_ = flag("add_eos_token", default_eos) && eos_id_ >= 0;
}

void Tokenizer::open_hf() {
  hf_ = HfTokenizer::load(path_);
  vocab_size_ = hf_->vocab_size();
  read_config();
  const nlohmann::json config = config_ ? *config_ : nlohmann::json();
  const std::string config_path = (std::filesystem::path(path_).parent_path() / "tokenizer_config.json").string();
  // The named token's id; a name the config gives must be a token.
  const auto id_of = [&](const std::string& name, const char* key) {
    const int64_t id = hf_->token_id(name);
    if (id < 0) throw std::runtime_error(config_path + ": " + key + " '" + name + "' is not a token of " + path_);
    return id;
  };
  // The first of `names` that is a token, -1 if none.
  const auto first_of = [&](std::initializer_list<const char*> names) {
    for (const char* n : names) {
      if (const int64_t id = hf_->token_id(n); id >= 0) return id;
    }
    return int64_t{-1};
  };
  const auto pick = [&](const char* key, std::initializer_list<const char*> names) {
    if (config.is_object() && config.contains(key)) {
      const std::string name = config_token(config, key);
      return name.empty() ? int64_t{-1} : id_of(name, key);
    }
    return first_of(names);
  };
  bos_id_ = pick("bos_token", {"<s>", "<|begin_of_text|>"});
  eos_id_ = pick("eos_token", {"</s>", "<|end_of_text|>", "<|endoftext|>"});
  unk_id_ = pick("unk_token", {"<unk>"});
  const int64_t pad = pick("pad_token", {"<pad>", "<|finetune_right_pad_id|>"});
  pad_id_ = pad >= 0 ? pad : (eos_id_ >= 0 ? eos_id_ : 0);
  eot_id_ = first_of({"<|eot_id|>", "<|im_end|>"});
  if (hf_->adds_prefix()) prefix_ids_ = encode(kContinuationPrefix);
  if (!hf_->has_post_processor()) return apply_config_flags(false, false);
  const auto& pre = hf_->special_prefix();
  const auto& post = hf_->special_suffix();
  const auto only = [&](const std::vector<int64_t>& ids, int64_t want, const char* what) {
    if (ids.empty()) return false;
    if (ids.size() != 1 || ids[0] != want)
      throw std::runtime_error(path_ + ": post_processor adds " + nlohmann::json(ids).dump() + " " + what +
                               " the text, but the tokenizer's " + (want == bos_id_ ? "BOS" : "EOS") + " is " +
                               std::to_string(want) + "; qlora adds exactly BOS before and EOS after");
    return true;
  };
  adds_bos_ = only(pre, bos_id_, "before");
  adds_eos_ = only(post, eos_id_, "after");
}

std::vector<int64_t> Tokenizer::encode(std::string_view text) const {
  if (bpe_) return bpe_->encode(text);
  if (hf_) return hf_->encode(text);
  std::vector<int> ids;
  const auto status = sp_->Encode(text, &ids);
  if (!status.ok()) {
    throw std::runtime_error("tokenizer '" + path_ + "': encode failed: " + status.ToString());
  }
  return to_int64(ids);
}

std::vector<int64_t> Tokenizer::encode_with_special(std::string_view text, bool add_bos,
                                                    bool add_eos) const {
  std::vector<int64_t> ids;
  // A tokenizer without BOS/EOS (Qwen's tokenizer.json has neither) adds nothing.
  if (add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
  const auto body = encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  if (add_eos && eos_id_ >= 0) ids.push_back(eos_id_);
  return ids;
}

std::vector<int64_t> Tokenizer::encode_continuation(std::string_view text) const {
  if (text.empty()) return {};
  if (bpe_ || (hf_ && !hf_->adds_prefix())) return encode(text);
  std::string joined(kContinuationPrefix);
  joined.append(text);
  auto ids = encode(joined);
  const bool has_prefix = ids.size() >= prefix_ids_.size() &&
                          std::equal(prefix_ids_.begin(), prefix_ids_.end(), ids.begin());
  if (!has_prefix) {
    // Only a model that merges "\n" with what follows gets here; plain encode is then the
    // closest we can do and still round-trips the text.
    return encode(text);
  }
  ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(prefix_ids_.size()));
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  if (bpe_) return utf8_replace_invalid(bpe_->decode_bytes(ids));
  if (hf_) return hf_->decode(ids);
  std::vector<int> narrow;
  narrow.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size_) {
      throw std::out_of_range("tokenizer '" + path_ + "': decode: id " + std::to_string(ids[i]) +
                              " at position " + std::to_string(i) + " is outside the vocab [0, " +
                              std::to_string(vocab_size_) + ")");
    }
    narrow.push_back(static_cast<int>(ids[i]));
  }
  std::string text;
  const auto status = sp_->Decode(narrow, &text);
  if (!status.ok()) {
    throw std::runtime_error("tokenizer '" + path_ + "': decode failed: " + status.ToString());
  }
  return text;
}

std::string Tokenizer::id_to_piece(int64_t id) const {
  if (bpe_) return std::string(bpe_->token_bytes(id));
  if (hf_) return hf_->token(id);
  if (id < 0 || id >= vocab_size_) {
    throw std::out_of_range("tokenizer '" + path_ + "': id " + std::to_string(id) +
                            " is outside the vocab");
  }
  return sp_->IdToPiece(static_cast<int>(id));
}

}  // namespace qlora::data
