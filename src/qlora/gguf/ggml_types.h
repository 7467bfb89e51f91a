// ggml's tensor types as GGUF stores them, and their encoders: each row of floats becomes the bytes
// llama.cpp's reference quantizer (ggml-quants.c's quantize_row_*_ref, the path llama-quantize
// takes without an importance matrix) makes of it, bit for bit: f32, f16, bf16; the 32-element
// blocks q8_0, q4_0, q5_0, q5_1; the 256-element super-blocks q4_K, q5_K, q6_K (kquants.h).
//
// `qlora gguf --type` names a file type, as llama-quantize does: the type most matrices get
// (q4_k_m: q4_K) and, for the quantized ones, llama.cpp's per-tensor mix around it (quant_mix.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace qlora::gguf {

// The numbers are ggml's enum ggml_type.
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
  MXFP4 = 39  // only copied from an MXFP4 checkpoint (quant/mxfp4.h), never encoded from floats
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;     // as ggml spells it: "f32", "q8_0", "q4_K", ...
  int64_t block;        // elements per block
  int64_t block_bytes;  // bytes per block
  uint32_t file_type;   // llama.cpp's general.file_type of a model mostly of this type (LLAMA_FTYPE_*;
                        // the k-quants: their _M mix)
  const char* option;   // the `--type` that writes such a file ("q4_k_m"); nullptr: only inside a mix
};

const GgmlTypeInfo& type_info(GgmlType type);
// The main type of a `--type` name (case-insensitive); throws std::invalid_argument listing them.
GgmlType type_from_name(std::string_view name);
std::string type_names();  // "f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k"
bool is_quantized(GgmlType type);  // a block type (not f32/f16/bf16)

// Bytes of a row of n elements; n must be a multiple of the type's block.
uint64_t row_bytes(GgmlType type, int64_t n);

// Encodes x[0, n) (n a multiple of the block) into out[0, row_bytes(type, n)).
void encode_row(GgmlType type, const float* x, int64_t n, uint8_t* out);

}  // namespace qlora::gguf
