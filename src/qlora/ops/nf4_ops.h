// NF4 quantize/dequantize on at::Tensors: argument checks, then the CPU kernels
// (kernels/nf4_*_cpu.cpp) or the CUDA kernels (kernels/nf4_*.cu) by the tensor's device.
// Results are bit-identical to the reference in quant/ on either device.
#pragma once

#include <ATen/core/Tensor.h>

#include <string_view>

#include "quant/nf4_tensor.h"

namespace qlora::ops {

// x: float32/bfloat16/float16, any shape, CPU or CUDA. `name` goes into error messages
// (NaN/Inf, wrong dtype). Arithmetic in x's dtype, as torchao's to_nf4.
Nf4Tensor nf4_quantize(const at::Tensor& x, std::string_view name = "tensor",
                       int64_t block_size = nf4::kBlockSize,
                       int64_t scaler_block_size = nf4::kScalerBlockSize);

// Dequantize on t's device into a new tensor of t.shape and out_dtype (float32, bfloat16 or
// float16): values are computed in t's dtype, then converted.
at::Tensor nf4_dequantize(const Nf4Tensor& t, at::ScalarType out_dtype);

// Same, into an existing contiguous tensor of t.numel() elements on t's device (the
// just-in-time path: callers reuse one buffer instead of allocating per matmul).
void nf4_dequantize_out(const Nf4Tensor& t, at::Tensor& out);

bool cuda_available();

}  // namespace qlora::ops
