// Rotate-half RoPE on at::Tensors: the one-pass CPU kernel of kernels/rope_cpu.h for float32 or
// bfloat16 CPU operands (the tables in x's dtype), ATen's multiply and multiply-adds otherwise
// (CUDA, mixed dtypes, other table shapes).
#pragma once

#include <ATen/core/Tensor.h>

namespace qlora::ops {

// x [B, H, S, d] (any strides), cos and sin [S, d] or [B, 1, S, d]: x * cos + sign-rotated x * sin
// (kernels/rope_cpu.h: sign -1 rotates, +1 is the gradient). The result is [B, H, S, d]; with
// heads_inner its memory is laid out as [B, S, H, d] (so that transposing it back to [B, S, H, d]
// and merging the heads needs no copy) where the kernel runs, contiguous otherwise.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign, bool heads_inner);

// The rotation (sign -1) computed in fp32 and returned in x's dtype, as transformers' vision towers
// rotate: (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype), within one rounding of it
// (the kernel, like the language models' rope, may fuse a * b + c into one FMA). x [B, H, S, d]
// (any strides), cos and sin [S, d] fp32 contiguous; the kernel's one pass for a float32 or bfloat16
// CPU x (laid out as with heads_inner above), ATen's ops otherwise. No autograd: for frozen inputs.
at::Tensor rope_in_fp32(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool heads_inner);

}  // namespace qlora::ops
