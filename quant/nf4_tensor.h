// The NF4 tensor type: the four buffers of quant/nf4_format.h as at::Tensors, plus the shape.
// Also the reference quantize/dequantize on at::Tensor (the fast ones are in qlora/ops/nf4_ops.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <string_view>
#include <vector>

#include "quant/nf4_format.h"

namespace qlora {

struct Nf4Tensor {
  at::Tensor codes;    // uint8 [layout.code_bytes()]
  at::Tensor scalers;  // int8  [layout.n_blocks()]
  at::Tensor factors;  // dtype [layout.n_groups()]
  at::Tensor mean;     // dtype []
  std::vector<int64_t> shape;
  nf4::Layout layout;

  bool defined() const { return codes.defined(); }
  at::ScalarType dtype() const { return factors.scalar_type(); }
  nf4::Dtype nf4_dtype() const;
  at::Device device() const { return codes.device(); }
  int64_t numel() const { return layout.numel; }
  int64_t nbytes() const;  // all four buffers
  Nf4Tensor to(at::Device device) const;
  // Throws std::invalid_argument naming `name` if buffers disagree with shape and layout.
  void validate(std::string_view name) const;
};

nf4::Dtype nf4_dtype_of(at::ScalarType t, std::string_view name);
at::ScalarType scalar_type_of(nf4::Dtype d);

// Buffers of the right sizes on `device`, uninitialized.
Nf4Tensor nf4_empty(const std::vector<int64_t>& shape, at::ScalarType dtype, at::Device device,
                    int64_t block_size = nf4::kBlockSize,
                    int64_t scaler_block_size = nf4::kScalerBlockSize);

// Checks a tensor is fit to quantize (float dtype, non-empty); names it in the error.
void nf4_check_quantizable(const at::Tensor& x, std::string_view name);

// mean of the real blocks' absmax scalers, computed by ATen's mean in the tensor's dtype on its
// device, exactly as torchao does (its summation order is ATen's, so we use ATen's). ATen's
// float32 sum order depends on the thread count, so torchao's own fp32 mean can differ in the
// last bit between thread counts; we match it at equal thread counts (bf16 hides the order).
at::Tensor nf4_scaler_mean(const at::Tensor& absmax, const nf4::Layout& layout);

[[noreturn]] void nf4_throw_nonfinite(std::string_view name);

// Reference implementations (slow, CPU): what the kernels are tested against.
Nf4Tensor nf4_quantize_reference(const at::Tensor& x, std::string_view name = "tensor",
                                 int64_t block_size = nf4::kBlockSize,
                                 int64_t scaler_block_size = nf4::kScalerBlockSize);
at::Tensor nf4_dequantize_reference(const Nf4Tensor& t, at::ScalarType out_dtype);

}  // namespace qlora
