// y = x W^T for the few rows of a decode step (kernels/decode_matmul_cpu.h): W read once per call
// in place, dense or NF4 (never dequantized to memory), instead of BLAS packing a copy of it.
// x float32 [M, K] on the CPU with unit stride along its rows, y float32 [M, N] likewise (a column
// slice of a wider output is fine). Each returns false, y untouched, where the kernel does not
// apply (another dtype or device, K not a multiple of 16 or of W's NF4 block size); the caller
// then multiplies as before. No autograd: for inputs that need no gradient.
#pragma once

#include <ATen/core/Tensor.h>

#include "quant/nf4_tensor.h"

namespace qlora::ops {

bool decode_matmul_out(const at::Tensor& x, const Nf4Tensor& weight, at::Tensor& y);
bool decode_matmul_out(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y);  // dense W [N, K]

}  // namespace qlora::ops
