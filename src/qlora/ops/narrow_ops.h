// LoRA's narrow products on at::Tensors (one side has the adapter's rank r as its width): the CPU
// kernels of kernels/narrow_cpu.h for CPU operands of one dtype, float32 or bfloat16, whose rows
// have unit stride, ATen's GEMMs otherwise (CUDA, other or mixed dtypes, other strides). The same
// math either way; the kernels sum in a different order than MKL, so results agree to fp32
// rounding (then one bf16 rounding of each output), not bit for bit.
#pragma once

#include <ATen/core/Tensor.h>

namespace qlora::ops {

// u = alpha * x @ w: x [T, K], w [K, R] (any strides, e.g. A.t() or B), u [T, R] (may be a column
// slice of a wider tensor; its old contents are ignored).
void narrow_product_out(const at::Tensor& u, const at::Tensor& x, const at::Tensor& w, double alpha = 1.0);
at::Tensor narrow_product(const at::Tensor& x, const at::Tensor& w, double alpha = 1.0);

// alpha * u^T @ x: u [T, R], x [T, K] -> a new [R, K] tensor (sums over the T rows).
at::Tensor narrow_reduction(const at::Tensor& u, const at::Tensor& x, double alpha = 1.0);

// y += alpha * u @ v, in place: y [T, N] (may be a column slice), u [T, R], v [R, N].
void narrow_update_(const at::Tensor& y, const at::Tensor& u, const at::Tensor& v, double alpha = 1.0);

}  // namespace qlora::ops
