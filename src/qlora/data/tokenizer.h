// SentencePiece tokenizer over a checkpoint's tokenizer.model (Llama-2 / Mistral style).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace qlora::data {

class Tokenizer {
 public:
  // Loads a sentencepiece model; throws std::runtime_error naming `path` when it cannot.
  static Tokenizer open(const std::string& path);

  // Ids of `text` without BOS/EOS. Like sentencepiece (and HF's slow Llama tokenizer) a dummy
  // prefix "▁" is added when the model says so.
  std::vector<int64_t> encode(std::string_view text) const;
  // encode() plus BOS in front / EOS at the end.
  std::vector<int64_t> encode_with_special(std::string_view text, bool add_bos, bool add_eos) const;
  // Ids of `text` as it tokenizes when it continues earlier text: without the dummy-prefix "▁"
  // that sentencepiece puts at the start of every encode call. Templates tokenize segment by
  // segment; without this, encode(a) + encode(b) would carry a space that a + b does not have.
  std::vector<int64_t> encode_continuation(std::string_view text) const;
  // Text of `ids`; control ids (BOS/EOS) decode to nothing. Throws on ids outside the vocab.
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t unk_id() const { return unk_id_; }
  // Llama ships no pad piece (pad_id -1): fall back to EOS, else 0. The value only fills padded
  // positions, whose labels are -100 and which attention never reads, so any valid id works.
  int64_t pad_id() const { return pad_id_; }
  int64_t vocab_size() const { return vocab_size_; }
  const std::string& path() const { return path_; }
  std::string id_to_piece(int64_t id) const;

 private:
  Tokenizer() = default;
  // shared: a Tokenizer is copied into datasets and recipes; the model is read-only after load.
  std::shared_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string path_;
  int64_t bos_id_ = -1, eos_id_ = -1, unk_id_ = -1, pad_id_ = 0, vocab_size_ = 0;
  // Ids of kContinuationPrefix, dropped by encode_continuation.
  std::vector<int64_t> prefix_ids_;
};

}  // namespace qlora::data
