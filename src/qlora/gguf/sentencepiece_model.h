// The pieces of a sentencepiece tokenizer.model (a serialized ModelProto), read straight from the
// protobuf wire format: what llama.cpp's "llama" vocabulary stores (piece, score, type) and whether
// the normalizer adds the dummy "▁" prefix. Only the fields GGUF needs are decoded; the rest are
// skipped by wire type. A malformed file is an error naming it and the byte offset.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qlora::gguf {

struct SentencePiece {
  std::string piece;
  float score = 0.0f;
  int32_t type = 1;  // sentencepiece's: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
};

struct SentencePieceModel {
  std::vector<SentencePiece> pieces;
  bool add_dummy_prefix = true;  // NormalizerSpec.add_dummy_prefix (default true)
};

// Throws std::invalid_argument naming `path`.
SentencePieceModel read_sentencepiece_model(const std::string& path);

}  // namespace qlora::gguf
