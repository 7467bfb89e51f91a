// Rotate-half RoPE on CPU float32 or bf16 in one pass (ATen takes three: x * cos, then one multiply-add
// into each half). Each row t of d elements, halves t1 and t2, with its table rows c, s:
//   out1 = t1 * c1 + sign * t2 * s1,   out2 = t2 * c2 - sign * t1 * s2
// sign -1: the rotation (forward); +1: its transpose (the gradient, given the same tables).
// Tensors are [B, H, S, d] with strides in elements (the last stride 1), input and output each in
// its own layout; the tables are [S, d] rows, offset by tsb per B (0: shared by all B).
// The bf16 overload (uint16_t: bf16 bit patterns, tables too) computes in fp32 and rounds each
// output once; a third overload takes bf16 x with fp32 tables (the vision towers' rotary, which
// transformers computes in fp32). Each output is the fp32 expression's (t1 * c1) + sign * (t2 * s1),
// one rounding per product and sum, no fused multiply-add: the same bits as transformers' x * cos +
// rotate_half(x) * sin in fp32. Vectorized for the active ISA (kernels/cpu_isa.h).
// Argument checks live in the binding (src/qlora/ops/rope_ops.cpp).
#pragma once

#include <cstdint>

namespace qlora::kernels {

struct Strides4 {
  int64_t b, h, s;  // the element stride of each leading dim; the last dim's is 1
};

void rope_cpu(int64_t B, int64_t H, int64_t S, int64_t d, const float* x, Strides4 xs, const float* cos,
              const float* sin, int64_t tsb, float sign, float* out, Strides4 os);
void rope_cpu(int64_t B, int64_t H, int64_t S, int64_t d, const uint16_t* x, Strides4 xs, const uint16_t* cos,
              const uint16_t* sin, int64_t tsb, float sign, uint16_t* out, Strides4 os);
void rope_cpu(int64_t B, int64_t H, int64_t S, int64_t d, const uint16_t* x, Strides4 xs, const float* cos,
              const float* sin, int64_t tsb, float sign, uint16_t* out, Strides4 os);

}  // namespace qlora::kernels
