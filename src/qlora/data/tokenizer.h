// The tokenizer of a checkpoint: an HF tokenizer.json (Qwen; Llama-2/3 and Mistral HF repositories),
// a sentencepiece model (Llama-2, Mistral's tokenizer.model) or Meta's tiktoken-format BPE
// (Llama-3/3.1, original/tokenizer.model), told apart by content.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace qlora::data {

class TiktokenBpe;
class HfTokenizer;

class Tokenizer {
 public:
  // Loads a tokenizer.json (a file starting with '{'; see hf_tokenizer.h), a sentencepiece model,
  // or a tiktoken file (ASCII lines "<base64> <rank>") with Llama-3's pre-tokenizer and its 256
  // special tokens after the ranks. `path` may be a checkpoint directory: the first of
  // tokenizer.model, original/tokenizer.model, tokenizer.json in it is loaded. Throws
  // std::runtime_error naming `path` (and for a malformed tiktoken file, the line).
  static Tokenizer open(const std::string& path);
  // The file open(path) loads: `path` itself, or for a directory the first of the files above.
  static std::string find_file(const std::string& path);

  // Ids of `text` without BOS/EOS. tokenizer.json: as the tokenizers library's encode(text,
  // add_special_tokens=False), added tokens in the text matched. Like sentencepiece (and HF's slow Llama tokenizer) a dummy
  // prefix "▁" is added when the model says so. A tiktoken model adds none and, like tiktoken
  // with allowed_special="all", encodes special-token strings in the text ("<|eot_id|>") as
  // their ids.
  std::vector<int64_t> encode(std::string_view text) const;
  // encode() plus BOS in front / EOS at the end, where the tokenizer has them (bos_id() >= 0).
  std::vector<int64_t> encode_with_special(std::string_view text, bool add_bos, bool add_eos) const;
  // What encode(text, add_special_tokens=True) of transformers adds, as the tokenizer's own files
  // define it:
  //   tokenizer.json: its post_processor (TemplateProcessing's BOS before / EOS after $A, Bert's
  //     cls/sep; ByteLevel nothing); when it is null, tokenizer_config.json's add_bos_token /
  //     add_eos_token (absent: false), as transformers rebuilds a missing post-processor;
  //   sentencepiece (Llama-2, Mistral, Gemma) and Meta's tiktoken file (Llama-3): BOS and no EOS,
  //     as their HF tokenizers and Meta's reference code do, unless a tokenizer_config.json beside
  //     the file says otherwise.
  // A post_processor that adds another token than bos_id()/eos_id() is refused at open().
  bool adds_bos() const { return adds_bos_; }
  bool adds_eos() const { return adds_eos_; }
  // Ids of `text` as it tokenizes when it continues earlier text: without the dummy-prefix "▁"
  // that sentencepiece puts at the start of every encode call. Templates tokenize segment by
  // segment; without this, encode(a) + encode(b) would carry a space that a + b does not have.
  // Same as encode() for a tiktoken model, which has no dummy prefix.
  std::vector<int64_t> encode_continuation(std::string_view text) const;
  // Text of `ids`. tokenizer.json: as the library's decode(ids, skip_special_tokens=False).
  // Sentencepiece: control ids (BOS/EOS) decode to nothing. Tiktoken: as
  // tiktoken's decode, special ids decode to their strings and bytes that are not UTF-8 (ids
  // that split a character) to U+FFFD. Throws std::out_of_range on ids outside the vocab.
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t unk_id() const { return unk_id_; }  // -1 for tiktoken: bytes cover every text
  // Llama-2 ships no pad piece (pad_id -1): fall back to EOS, else 0. Llama-3.1 has
  // <|finetune_right_pad_id|>. The value only fills padded positions, whose labels are -100 and
  // which attention never reads, so any valid id works.
  int64_t pad_id() const { return pad_id_; }
  // tokenizer.json: BOS/EOS/pad are tokenizer_config.json's bos_token/eos_token/pad_token when
  // that file is beside it, else the first added token named <s>, <|begin_of_text|> (BOS),
  // </s>, <|end_of_text|>, <|endoftext|> (EOS); -1 when none (pad falls back to EOS, else 0).
  // <|eot_id|>, the end of a Llama-3 chat turn, where generation should stop too (tokenizer.json:
  // <|eot_id|> or <|im_end|>); -1 if none.
  int64_t eot_id() const { return eot_id_; }
  int64_t vocab_size() const { return vocab_size_; }
  // tokenizer_config.json beside the tokenizer file (null when none): chat templates read their
  // special tokens (bos_token, ...) and the template itself from it.
  const std::shared_ptr<const nlohmann::json>& config() const { return config_; }
  const std::string& path() const { return path_; }
  // tokenizer.json: the token as the file writes it. Sentencepiece: the piece ("▁the", "<0x0A>"). Tiktoken: the token's raw bytes (may be part
  // of a UTF-8 character) or the special token's string.
  std::string id_to_piece(int64_t id) const;

 private:
  Tokenizer() = default;
  static Tokenizer open_file(const std::string& path);  // open(), its errors not all naming the file
  void open_tiktoken();
  void open_hf();
  // shared: a Tokenizer is copied into datasets and recipes; the model is read-only after load.
  // Exactly one of the three is set.
  std::shared_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::shared_ptr<const TiktokenBpe> bpe_;
  std::shared_ptr<const HfTokenizer> hf_;
  std::string path_;
  int64_t bos_id_ = -1, eos_id_ = -1, unk_id_ = -1, pad_id_ = 0, eot_id_ = -1, vocab_size_ = 0;
  bool adds_bos_ = false, adds_eos_ = false;
  std::shared_ptr<const nlohmann::json> config_;
  void read_config();
  void apply_config_flags(bool default_bos, bool default_eos);
  // Ids of kContinuationPrefix, dropped by encode_continuation.
  std::vector<int64_t> prefix_ids_;
};

}  // namespace qlora::data
