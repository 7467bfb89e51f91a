// What follows a linear layer's GEMM in the vision towers where nothing is differentiated (a frozen
// tower), in one pass over its output y [rows, cols] (contiguous, in place), with the layer's bias
// [cols] (may be null) added there rather than in a pass of its own:
//   - GELU's tanh approximation (transformers' gelu_pytorch_tanh / gelu_new, the towers' MLPs):
//       y = gelu(y + bias),  gelu(x) = x / 2 (1 + tanh(u)) = x sigmoid(2u),  u = sqrt(2 / pi) (x + 0.044715 x^3),
//     computed as the right-hand side, which keeps full relative precision where 1 + tanh(u) cancels
//     (x below about -4);
//   - the residual: y = x + (y + bias).
// float32 or bf16 (uint16_t bit patterns), computed in fp32 and rounded once (transformers rounds
// y + bias to bf16 first). With AVX-512 written in its intrinsics, elsewhere over kernels/simd.h's
// vectors per ISA (exp within 2 ulp of expf). Each element depends only on its own inputs, so results
// do not depend on the thread count.
#pragma once

#include <cstdint>

namespace qlora::kernels {

void bias_gelu_tanh_cpu(int64_t rows, int64_t cols, float* y, const float* bias);
void bias_gelu_tanh_cpu(int64_t rows, int64_t cols, uint16_t* y, const uint16_t* bias);

void bias_residual_cpu(int64_t rows, int64_t cols, float* y, const float* x, const float* bias);
void bias_residual_cpu(int64_t rows, int64_t cols, uint16_t* y, const uint16_t* x, const uint16_t* bias);

}  // namespace qlora::kernels
