// The text-processing stages of an HF tokenizer.json that qlora supports, built from their JSON:
// normalizers, pre-tokenizers and decoders, each as the tokenizers library (Rust) applies them.
// Internal to hf_tokenizer.cpp; a separate file only to keep each under a screenful per stage.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace qlora::data::hf {

// A pre-token: its text, and whether it starts at the start of the input (Metaspace's
// prepend_scheme "first" prepends only there, as the library checks the original offset 0).
struct Piece {
  std::string text;
  bool at_start = false;
};

using Normalize = std::function<std::string(std::string)>;
using PreTokenize = std::function<void(std::vector<Piece>&)>;
using Decode = std::function<void(std::vector<std::string>&)>;

// Each builder takes the component's JSON (null: none, an identity stage) and `where`, the file
// and JSON path used in errors ("x/tokenizer.json: normalizer.normalizers[1]"). A type or an
// option qlora does not implement throws std::runtime_error naming both; nothing is ignored.
Normalize make_normalizer(const nlohmann::json& j, const std::string& where);
PreTokenize make_pre_tokenizer(const nlohmann::json& j, const std::string& where);
Decode make_decoder(const nlohmann::json& j, const std::string& where);

// GPT-2's byte-level alphabet: byte b as a printable character (UTF-8), and the inverse (-1 for
// a character that is not one of the 256).
const std::string& byte_char(uint8_t b);
int byte_of_char(uint32_t codepoint);

}  // namespace qlora::data::hf
