// ggml's k-quant super-blocks (256 elements), encoded as llama.cpp's reference quantizers do
// (quantize_row_q{4,5,6}_K_ref: no importance matrix), bit for bit. Every float operation happens
// in ggml's order and rounding (this library builds with -ffp-contract=off, as ggml-base does not
// fuse multiply-adds either).
//
//   q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
//        4-bit codes; element = d * scale_j * q - dmin * min_j over sub-blocks j of 32.
//   q5_K (176 bytes): as q4_K with 5-bit codes: the fifth bits in 32 bytes before the nibbles.
//   q6_K (210 bytes): 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales, fp16 d;
//        element = d * scale_j * (q - 32) over sub-blocks j of 16.
#pragma once

#include <cstdint>

namespace qlora::gguf {

void encode_q4_k(const float* x, uint8_t* out);  // x[0, 256) -> out[0, 144)
void encode_q5_k(const float* x, uint8_t* out);  // x[0, 256) -> out[0, 176)
void encode_q6_k(const float* x, uint8_t* out);  // x[0, 256) -> out[0, 210)

}  // namespace qlora::gguf
