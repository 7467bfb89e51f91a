// kernels/epilogue_cpu.h on at::Tensors, in place, for what nothing differentiates (a frozen vision
// tower): a linear's output y [..., cols] with its bias [cols] (may be undefined) added in the pass
// that follows the GEMM. The kernel for contiguous float32 / bfloat16 CPU tensors of one dtype;
// ATen's ops otherwise.
#pragma once

#include <ATen/core/Tensor.h>

namespace qlora::ops {

// y = gelu_tanh(y + bias); returns y.
at::Tensor bias_gelu_tanh_(at::Tensor y, const at::Tensor& bias = {});

// y = x + (y + bias), x of y's shape; returns y.
at::Tensor bias_residual_(at::Tensor y, const at::Tensor& x, const at::Tensor& bias = {});

}  // namespace qlora::ops
