// The frozen products of a Mixture-of-Experts layer's experts in one call
// (kernels/grouped_nf4_matmul_cpu.h): x's rows grouped by expert, counts[g] consecutive rows for
// expert g (in order), each group times its own NF4 weight W_g [N, K], never dequantized to memory:
//   transposed false: y [S, N] = x [S, K] W_g^T per group (the forward product);
//   transposed true:  y [S, K] = x [S, N] W_g per group (x's gradient through W_g).
// x and y: float32 or bfloat16 (one dtype), on the CPU, unit stride along their rows (column slices
// of wider tensors are fine). On CUDA, bf16: the used experts dequantized a bounded batch at a time
// and multiplied by ATen's grouped GEMM (at::_grouped_mm). Groups without rows are never read
// (their weights may be undefined). Returns false where it does not take the operands (another
// dtype, a W whose shape or NF4 layout grouped_nf4_matmul_takes refuses, a GPU without a grouped
// GEMM); the caller then multiplies expert by expert and writes y whole. No autograd: the caller's
// node owns the gradients.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "quant/nf4_tensor.h"

namespace qlora::ops {

bool grouped_nf4_matmul_out(const at::Tensor& x, const std::vector<int64_t>& counts,
                            const std::vector<const Nf4Tensor*>& weights, bool transposed, at::Tensor& y);

}  // namespace qlora::ops
