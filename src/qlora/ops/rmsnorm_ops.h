// RMSNorm on at::Tensors, as transformers computes it (kernels/rmsnorm_cpu.h states the math):
// the CPU kernels for float32 or bfloat16 rows with a weight of the same dtype, ATen's ops
// otherwise (CUDA, mixed dtypes, strided rows) and whenever autograd records (grad mode and an
// input that requires grad), so that rms_norm stays differentiable. The kernels sum each row in
// their own order, so results agree with ATen's to fp32 rounding, not bit for bit.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "kernels/rmsnorm_cpu.h"

namespace qlora::ops {

// x [..., n], weight [n]. Returns the normed x (x's dtype) and rstd [..., 1] in fp32, which
// backward takes. scale: which form of the weight's product (kernels/rmsnorm_cpu.h).
std::pair<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, kernels::RmsScale scale);

// The gradient of x (x's dtype) from the output's gradient, x, weight and forward's rstd.
at::Tensor rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& rstd, kernels::RmsScale scale);

}  // namespace qlora::ops
