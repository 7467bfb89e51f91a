// GELU's tanh approximation in place on at::Tensors with nothing to differentiate (the vision
// towers' MLPs when frozen): kernels/gelu_cpu.h for contiguous float32 or bfloat16 CPU tensors,
// ATen's gelu_(x, "tanh") otherwise.
#pragma once

#include <ATen/core/Tensor.h>

namespace qlora::ops {

// x = gelu_tanh(x); returns x.
at::Tensor gelu_tanh_(at::Tensor x);

}  // namespace qlora::ops
