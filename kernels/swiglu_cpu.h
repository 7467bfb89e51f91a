// SwiGLU on CPU float32 or bf16 rows, forward and backward each in one pass over their operands (ATen
// takes two passes forward, three backward, each with its own output tensor):
//   forward  out = silu(g) * u,  silu(g) = g * s,  s = 1 / (1 + exp(-g))
//   backward du = grad * silu(g),  dg = grad * u * s * (1 + g * (1 - s))
// bf16 overloads (uint16_t: bf16 bit patterns) compute in fp32 and round each output once.
// Vectorized for the active ISA (kernels/cpu_isa.h).
// Rows of n elements with unit stride; ld* are the row strides in elements. Each element depends
// only on its own inputs, so results do not depend on the thread count.
// Argument checks live in the binding (src/qlora/ops/swiglu_ops.cpp).
#pragma once

#include <cstdint>

namespace qlora::kernels {

void swiglu_forward_cpu(int64_t rows, int64_t n, const float* g, int64_t ldg, const float* u, int64_t ldu, float* out,
                        int64_t ldo);
void swiglu_forward_cpu(int64_t rows, int64_t n, const uint16_t* g, int64_t ldg, const uint16_t* u, int64_t ldu,
                        uint16_t* out, int64_t ldo);

void swiglu_backward_cpu(int64_t rows, int64_t n, const float* grad, int64_t ldgrad, const float* g, int64_t ldg,
                         const float* u, int64_t ldu, float* dg, int64_t lddg, float* du, int64_t lddu);
void swiglu_backward_cpu(int64_t rows, int64_t n, const uint16_t* grad, int64_t ldgrad, const uint16_t* g, int64_t ldg,
                         const uint16_t* u, int64_t ldu, uint16_t* dg, int64_t lddg, uint16_t* du, int64_t lddu);

}  // namespace qlora::kernels
