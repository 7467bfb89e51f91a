#include "qlora/ops/gelu_ops.h"

#include <ATen/ATen.h>

#include "kernels/gelu_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

at::Tensor gelu_tanh_(at::Tensor x) {
  if (!kernel_dtype(x) || !x.is_cpu() || !x.is_contiguous()) return at::gelu_(x, "tanh");
  with_element(x, [&](auto e) {
    using T = decltype(e);
    kernels::gelu_tanh_inplace_cpu(x.numel(), out_ptr<T>(x));
  });
  return x;
}

}  // namespace qlora::ops
