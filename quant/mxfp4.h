// MXFP4 (OCP Microscaling, FP4 E2M1 elements with an E8M0 scale per 32), as gpt-oss's checkpoints store
// their experts: <name>_blocks uint8 [..., groups, 16] (two elements a byte, the low nibble first) and
// <name>_scales uint8 [..., groups] (a biased exponent, 127 meaning 2^0). Element j of group g is
// e2m1[nibble] * 2^(scale - 127), e2m1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives (bit 3 the sign).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

namespace qlora::mxfp4 {

// The value of a 4-bit E2M1 code (0..15).
float e2m1_value(int code);

// Decodes blocks [..., groups, 16] and scales [..., groups] (both uint8, on the CPU) into
// [..., groups * 32] of `dtype` (float32 or bfloat16: exact in both but where 2^(scale - 127) leaves
// their range). Shapes, dtypes and devices that do not fit are refused (std::invalid_argument prefixed
// with `what`, e.g. "<file>: <key>").
at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype, const std::string& what);

// The same groups as ggml's block_mxfp4 (llama.cpp's MXFP4 tensor type) holds them: uint8 [..., groups, 17],
// each group its scale byte unchanged (ggml halves its E8M0 and doubles its E2M1 table: the same values),
// then 16 bytes whose byte j holds element j's code in its low nibble and element j + 16's in its high one.
// The codes are moved, never decoded: exact. Checked as dequantize checks.
at::Tensor to_ggml_blocks(const at::Tensor& blocks, const at::Tensor& scales, const std::string& what);

}  // namespace qlora::mxfp4
