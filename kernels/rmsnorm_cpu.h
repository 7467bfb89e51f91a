// RMSNorm on CPU float32 or bf16 rows, forward and backward each in one kernel (two passes over a
// row that stays in L1: its sum, then its outputs), as transformers computes it:
//   forward   rstd = 1 / sqrt(mean(x^2) + eps)
//             out  = w * round(x * rstd)            (RmsScale::kWeight, Llama)
//                    round(x * rstd * (w + 1))      (kOnePlusWeight, Gemma 2/3)
//                    round(x * rstd * w)            (kWeightFp32, Gemma 4)
//   backward  gw = grad * w (or grad * (w + 1)),  gx = gw * rstd - x * rstd^3 * mean(gw * x)
// in fp32, where round() is the storage dtype's rounding (none in fp32); the bf16 overloads
// (uint16_t: bf16 bit patterns) round each output once more, as bf16 * bf16 does. rstd is kept
// per row in fp32 for backward. Vectorized for the active ISA (kernels/cpu_isa.h); each row is
// summed in one fixed order, so results do not depend on the thread count.
// Rows of n elements with unit stride; ld* are the row strides in elements; w has n elements.
// Argument checks live in the binding (src/qlora/ops/rmsnorm_ops.cpp).
#pragma once

#include <cstdint>

namespace qlora::kernels {

// How the weight scales the normed row (see above): the three forms transformers' families use.
enum class RmsScale : uint8_t { kWeight, kOnePlusWeight, kWeightFp32 };

void rms_norm_forward_cpu(int64_t rows, int64_t n, const float* x, int64_t ldx, const float* w, float eps,
                          RmsScale scale, float* out, int64_t ldo, float* rstd);
void rms_norm_forward_cpu(int64_t rows, int64_t n, const uint16_t* x, int64_t ldx, const uint16_t* w, float eps,
                          RmsScale scale, uint16_t* out, int64_t ldo, float* rstd);

void rms_norm_backward_cpu(int64_t rows, int64_t n, const float* grad, int64_t ldg, const float* x, int64_t ldx,
                           const float* w, const float* rstd, RmsScale scale, float* gx, int64_t ldgx);
void rms_norm_backward_cpu(int64_t rows, int64_t n, const uint16_t* grad, int64_t ldg, const uint16_t* x,
                           int64_t ldx, const uint16_t* w, const float* rstd, RmsScale scale, uint16_t* gx,
                           int64_t ldgx);

}  // namespace qlora::kernels
