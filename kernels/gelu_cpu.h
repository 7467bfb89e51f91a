// GELU's tanh approximation (transformers' gelu_pytorch_tanh / gelu_new, the vision towers' MLP
// activation) in place on CPU float32 or bf16 elements, where nothing is differentiated:
//   gelu(x) = x / 2 (1 + tanh(u)) = x sigmoid(2u),  u = sqrt(2 / pi) (x + 0.044715 x^3),
// computed as the right-hand side (exp within 2 ulp of expf, kernels/simd.h), which keeps full
// relative precision where 1 + tanh(u) cancels (x below about -4). bf16 (uint16_t bit patterns)
// computes in fp32 and rounds once. Vectorized for the active ISA (kernels/cpu_isa.h); each
// element depends only on itself, so results do not depend on the thread count.
#pragma once

#include <cstdint>

namespace qlora::kernels {

void gelu_tanh_inplace_cpu(int64_t n, float* x);
void gelu_tanh_inplace_cpu(int64_t n, uint16_t* x);

}  // namespace qlora::kernels
