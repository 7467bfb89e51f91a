// Byte-level BPE in tiktoken's format: the original/tokenizer.model that Llama-3 checkpoints ship.
//
// The file holds one line per token, "<base64 of the token's bytes> <rank>", ranks 0..N-1 in
// order; a token's id is its rank. Special tokens are not in the file: the caller names them and
// they get ids N, N+1, ... Encoding does what tiktoken's Encoding.encode(text,
// allowed_special="all") does: split at special-token strings, split the text between them with
// the pre-tokenizer regex (PCRE2), and turn each regex match into ranks by byte-pair merging
// (always merge the adjacent pair whose concatenation has the lowest rank, leftmost first).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "qlora/data/text_regex.h"

namespace qlora::data {

// Meta's Llama-3 pre-tokenizer pattern (tiktoken's cl100k_base pattern), in tiktoken's syntax.
extern const char* const kLlama3Pattern;

// The 256 special tokens Meta appends to Llama-3's 128000 ranks, in id order, with the Llama-3.1
// names (<|finetune_right_pad_id|>, <|step_id|>, <|eom_id|>, <|python_tag|> were reserved tokens
// in 3.0; the ids of <|begin_of_text|>, <|end_of_text|>, the header markers and <|eot_id|> are the
// same in both, and the tokenizer.model files are identical).
std::vector<std::string> llama3_special_tokens();

// True when the first line of `head` (the start of a file) reads "<base64> <digits>": a tiktoken
// file. A sentencepiece model is a protobuf and starts with a binary field tag instead.
bool looks_like_tiktoken(std::string_view head);

class TiktokenBpe {
 public:
  // Reads the ranks in `path`. Malformed lines (bad base64, bad or out-of-order rank, a token
  // seen before) throw std::runtime_error naming the file and the line; so does a vocabulary
  // missing one of the 256 single bytes (byte-level BPE needs them all to encode any text).
  // `pattern` uses tiktoken's regex syntax; each special token must look like "<|...|>".
  static std::shared_ptr<const TiktokenBpe> load(const std::string& path, const std::string& pattern,
                                                 const std::vector<std::string>& special_tokens);
  ~TiktokenBpe();
  TiktokenBpe(const TiktokenBpe&) = delete;
  TiktokenBpe& operator=(const TiktokenBpe&) = delete;

  // Ids of `text`; special-token strings in it become their ids. Ill-formed UTF-8 is first
  // repaired with utf8_replace_invalid (tiktoken only ever sees valid Unicode strings).
  std::vector<int64_t> encode(std::string_view text) const;
  // The tokens' bytes, concatenated; a special id gives its string. Throws std::out_of_range
  // naming the position of an id outside [0, vocab_size()). May be ill-formed UTF-8 when the ids
  // split a character.
  std::string decode_bytes(const std::vector<int64_t>& ids) const;

  int64_t base_vocab_size() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  int64_t vocab_size() const { return base_vocab_size() + static_cast<int64_t>(specials_.size()); }
  // Id of a special token, -1 when `token` is not one.
  int64_t special_id(std::string_view token) const;
  // A token's bytes (a special's string); throws std::out_of_range.
  std::string_view token_bytes(int64_t id) const;
  const std::string& path() const { return path_; }

 private:
  TiktokenBpe() = default;
  void parse_ranks(const std::string& text);
  int64_t rank_of(std::string_view bytes) const;
  void encode_ordinary(std::string_view text, std::vector<int64_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int64_t>& out) const;

  std::string path_;
  std::string arena_;             // every token's bytes, concatenated in rank order
  std::vector<uint32_t> offsets_;  // token r is arena_[offsets_[r], offsets_[r + 1])
  // Views into arena_, which never changes after load (hence no copies of this class).
  std::unordered_map<std::string_view, uint32_t> ranks_;
  std::vector<std::string> specials_;
  std::unordered_map<std::string, int64_t> special_ids_;
  std::unique_ptr<TextRegex> regex_;
};

}  // namespace qlora::data
