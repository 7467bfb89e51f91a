// Full attention within consecutive segments of rows (the vision towers': each image, or frame,
// attends to itself), on at::Tensors: kernels/attention_amx_cpu.h's AMX kernel for bf16 CPU
// operands where nothing is differentiated and the CPU has AMX-BF16, ATen's SDPA per segment
// otherwise (as transformers splits its [1, heads, rows, d] per image).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace qlora::ops {

// q, k, v [rows, heads, d] (d contiguous where the kernel runs), segment lengths summing to rows:
// softmax(q k^T scale) v per head and segment. Returns [rows, heads, d].
at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<int64_t>& segments, double scale);

// Whether segment_attention takes the AMX kernel for these operands.
bool segment_attention_uses_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace qlora::ops
