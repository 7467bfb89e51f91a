// Launch declarations of the torch-free CUDA NF4 kernels (kernels/nf4_quantize.cu,
// kernels/nf4_dequantize.cu). Raw device pointers, sizes and a stream in; cudaError_t out.
// Argument checks live in the binding (src/qlora/ops/nf4_ops.cpp); numerics are those of
// quant/nf4_format.h and must match quant/nf4_reference.h bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "quant/nf4_format.h"

namespace qlora::kernels {

// Passed by value so the kernels need no global memory for them (computed on the host by
// quant/nf4_format.cpp: the codebook has one home).
struct Nf4Tables {
  float codebook[nf4::kNumCodes];        // codebook values of the storage dtype, as floats
  float thresholds[nf4::kNumCodes - 1];  // code(v) = #{k : v >= thresholds[k]}
};

// absmax[b] = max |x| over block b, for b < layout.n_blocks(); blocks past numel read as 0.
// Sets *nonfinite (device int, zeroed by the caller) to 1 if any x is NaN or Inf.
cudaError_t nf4_block_absmax_cuda(nf4::Dtype dtype, const void* x, const nf4::Layout& layout,
                                  void* absmax, int* nonfinite, cudaStream_t stream);

// Double quantization of the absmax scalers. mean: device pointer to one value of dtype.
// Blocks >= layout.n_real_blocks() are padding and get s = 0.
cudaError_t nf4_double_quantize_cuda(nf4::Dtype dtype, const void* absmax, const void* mean,
                                     const nf4::Layout& layout, int8_t* scalers, void* factors,
                                     cudaStream_t stream);

// Packed codes for every element (padding elements get kZeroCode).
cudaError_t nf4_quantize_codes_cuda(nf4::Dtype dtype, const void* x, const void* absmax,
                                    const nf4::Layout& layout, const Nf4Tables& tables,
                                    uint8_t* codes, cudaStream_t stream);

// out[i] for i < layout.numel, computed in dtype and then converted to out_dtype.
cudaError_t nf4_dequantize_cuda(nf4::Dtype dtype, nf4::Dtype out_dtype, const uint8_t* codes,
                                const int8_t* scalers, const void* factors, const void* mean,
                                const nf4::Layout& layout, const Nf4Tables& tables, void* out,
                                cudaStream_t stream);

}  // namespace qlora::kernels
