// The BPE tokenizers of HF's tokenizer.json (what Qwen ships, and Llama-3's, Llama-2's and
// Mistral's HF repositories): encodes and decodes as the `tokenizers` library does with
// encode(text, add_special_tokens=False) and decode(ids, skip_special_tokens=False).
//
// Supported: model "BPE" (merges as "a b" strings or [a, b] lists, byte_fallback, unk_token,
// fuse_unk, ignore_merges); added_tokens (special or not, normalized or not, lstrip/rstrip),
// matched in the text before the model runs, leftmost-longest; the normalizers, pre-tokenizers
// and decoders of hf_pipeline.h. The post_processor (BOS/EOS around encode) is read, not applied:
// special_prefix()/special_suffix() say what it adds, and Tokenizer::encode_with_special adds it. Anything else (another model type, an unknown
// component or option, truncation) is refused with an error naming the file and the component.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace qlora::data {

class HfTokenizer {
 public:
  // Throws std::runtime_error naming `path` (malformed JSON, unsupported components, merges
  // naming tokens not in the vocab).
  static std::shared_ptr<const HfTokenizer> load(const std::string& path);
  ~HfTokenizer();
  HfTokenizer(const HfTokenizer&) = delete;
  HfTokenizer& operator=(const HfTokenizer&) = delete;

  // Ill-formed UTF-8 in `text` is first repaired to U+FFFD (the library only sees valid strings).
  std::vector<int64_t> encode(std::string_view text) const;
  // Throws std::out_of_range naming the position of an id that is no token.
  std::string decode(const std::vector<int64_t>& ids) const;

  // One past the largest id of the vocab and the added tokens.
  int64_t vocab_size() const;
  // Id of an added token or a vocab entry; -1 if none.
  int64_t token_id(std::string_view token) const;
  // The token's string as the file writes it (byte-level vocabularies in GPT-2's alphabet).
  std::string token(int64_t id) const;
  // True when encode puts something in front of the text (a Prepend normalizer, Metaspace that
  // prepends, ByteLevel's add_prefix_space): continuations then need the prefix trick.
  bool adds_prefix() const;
  // The ids the post_processor puts before / after a single sequence (encode(text,
  // add_special_tokens=True)): TemplateProcessing's "single", Bert/Roberta's cls and sep, ByteLevel
  // nothing, Sequence the concatenation. has_post_processor() is false for a null one.
  const std::vector<int64_t>& special_prefix() const;
  const std::vector<int64_t>& special_suffix() const;
  bool has_post_processor() const;
  const std::string& path() const;

 private:
  struct Impl;
  HfTokenizer();
  std::unique_ptr<Impl> impl_;
};

}  // namespace qlora::data
