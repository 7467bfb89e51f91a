// The tokenizer.* metadata of a GGUF, as llama.cpp's loader reads it, from an HF tokenizer:
// tokenizer.ggml.model "gpt2" (byte-level BPE from tokenizer.json: tokens in id order, token types,
// merges, the pre-tokenizer by the name llama.cpp knows it under) or "llama" (a sentencepiece model,
// from tokenizer.model or from its tokenizer.json form: BPE with byte fallback, scores from the
// merge ranks); the
// BOS/EOS/unknown/padding ids, whether BOS/EOS are added, and the chat template.
//
// A tokenizer llama.cpp would split differently is refused by name, never written: the
// pre-tokenizer must be one of those llama.cpp names (gpt-2, smollm, llama-bpe, qwen2, qwen35) exactly,
// with no normalizer (Qwen's NFC excepted). A sentencepiece tokenizer.model becomes llama.cpp's
// "llama" vocabulary (pieces, scores, types, add_space_prefix), with HF's added tokens from
// added_tokens.json and tokenizer_config.json's added_tokens_decoder (Phi-3's chat tokens past the
// model's pieces, Gemma's special ones as control tokens); Meta's tiktoken file is not written yet.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/gguf/writer.h"

namespace qlora::gguf {

// llama.cpp's pre-tokenizer name for tokenizer.json's "pre_tokenizer" (and "normalizer"); throws
// std::invalid_argument naming `where` and what was found.
std::string pre_tokenizer_name(const nlohmann::json& tokenizer_json, const std::string& where);

// Appends the tokenizer.* entries for the tokenizer of checkpoint directory `dir`; vocab_size is
// the model's (config.json), which may exceed the tokenizer's ids ([PAD<i>] fills the rest).
void add_tokenizer_metadata(const std::string& dir, int64_t vocab_size,
                            std::vector<std::pair<std::string, Value>>& metadata);

}  // namespace qlora::gguf
