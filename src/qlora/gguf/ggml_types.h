// ggml's tensor types as GGUF stores them, and their encoders: each row of floats becomes the bytes
// llama.cpp's reference quantizer (ggml-quants.c, mirrored by the `gguf` package's quants.py)
// makes of it, bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace qlora::gguf {

// The numbers are ggml's enum ggml_type.
enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, BF16 = 30 };

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;     // as llama.cpp's tools spell it: "f32", "q8_0", ...
  int64_t block;        // elements per block
  int64_t block_bytes;  // bytes per block
  uint32_t file_type;   // llama.cpp's general.file_type of a model mostly of this type (LLAMA_FTYPE_*)
};

const GgmlTypeInfo& type_info(GgmlType type);
// Throws std::invalid_argument listing the names.
GgmlType type_from_name(std::string_view name);
std::string type_names();  // "f32, f16, bf16, q8_0, q4_0"

// Bytes of a row of n elements; n must be a multiple of the type's block.
uint64_t row_bytes(GgmlType type, int64_t n);

// Encodes x[0, n) (n a multiple of the block) into out[0, row_bytes(type, n)).
void encode_row(GgmlType type, const float* x, int64_t n, uint8_t* out);

}  // namespace qlora::gguf
