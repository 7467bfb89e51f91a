// SwiGLU, silu(gate) * up, on at::Tensors: the one-pass CPU kernels of kernels/swiglu_cpu.h for
// float32 or bfloat16 CPU operands of one dtype, ATen's silu, mul and silu_backward otherwise
// (CUDA, mixed dtypes: the same ops autograd would run). The kernels' exp differs from ATen's in
// the last bits (within 2 ulp).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace qlora::ops {

// gate, up: the same shape [..., n], rows with unit stride (e.g. column slices of one output).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// The gradients of gate and up (contiguous, gate's shape) from the output's gradient.
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up);

}  // namespace qlora::ops
