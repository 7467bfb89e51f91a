#include "qlora/ops/epilogue_ops.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "kernels/epilogue_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

namespace {

// Whether the kernel takes y (and x, bias where defined): contiguous CPU tensors of one kernel dtype.
bool kernel_takes(const at::Tensor& y, const at::Tensor& x, const at::Tensor& bias) {
  const auto fits = [&](const at::Tensor& t) {
    return !t.defined() || (t.is_cpu() && t.scalar_type() == y.scalar_type() && t.is_contiguous());
  };
  return kernel_dtype(y) && y.is_contiguous() && y.dim() >= 1 && fits(x) && fits(bias) &&
         (!bias.defined() || (bias.dim() == 1 && bias.size(0) == y.size(-1)));
}

}  // namespace

at::Tensor bias_gelu_tanh_(at::Tensor y, const at::Tensor& bias) {
  if (!kernel_takes(y, {}, bias)) {
    if (bias.defined()) y.add_(bias);
    return at::gelu_(y, "tanh");
  }
  const int64_t cols = y.size(-1), rows = cols == 0 ? 0 : y.numel() / cols;
  with_element(y, [&](auto e) {
    using T = decltype(e);
    kernels::bias_gelu_tanh_cpu(rows, cols, out_ptr<T>(y), bias.defined() ? in_ptr<T>(bias) : nullptr);
  });
  return y;
}

at::Tensor bias_residual_(at::Tensor y, const at::Tensor& x, const at::Tensor& bias) {
  if (x.sizes() != y.sizes()) throw std::invalid_argument("bias_residual_: x and y must be of one shape");
  if (!kernel_takes(y, x, bias)) {
    if (bias.defined()) y.add_(bias);
    return y.add_(x);
  }
  const int64_t cols = y.size(-1), rows = cols == 0 ? 0 : y.numel() / cols;
  with_element(y, [&](auto e) {
    using T = decltype(e);
    kernels::bias_residual_cpu(rows, cols, out_ptr<T>(y), in_ptr<T>(x), bias.defined() ? in_ptr<T>(bias) : nullptr);
  });
  return y;
}

}  // namespace qlora::ops
