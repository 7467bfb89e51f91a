// Shared by the CPU kernels' bindings: the element types they take (float32, or bfloat16 as
// uint16_t bit patterns) and typed data pointers.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "kernels/nf4_cpu.h"
#include "quant/nf4_tensor.h"

namespace qlora::ops {

// Whether t is on the CPU in a dtype the kernels take.
inline bool kernel_dtype(const at::Tensor& t) {
  return t.is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

// Calls fn(float{}) or fn(uint16_t{}) for t's dtype (float32 or bfloat16).
template <class Fn> void with_element(const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kBFloat16) fn(uint16_t{});
  else fn(float{});
}

// t as rows of its last dim: the row count and the row stride, when every row starts one
// stride after the previous (any leading dims flattened); nullopt otherwise.
struct Rows {
  int64_t count, ld;
};
inline std::optional<Rows> rows_of(const at::Tensor& t) {
  if (!kernel_dtype(t) || t.dim() == 0 || t.stride(-1) != 1) return std::nullopt;
  const int64_t ld = t.dim() >= 2 ? t.stride(-2) : t.size(-1);
  for (int64_t d = t.dim() - 2; d > 0; --d)
    if (t.size(d - 1) > 1 && t.stride(d - 1) != t.stride(d) * t.size(d)) return std::nullopt;
  return Rows{t.numel() / std::max<int64_t>(1, t.size(-1)), ld};
}

template <class T> const T* in_ptr(const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }
template <class T> T* out_ptr(const at::Tensor& t) { return static_cast<T*>(t.mutable_data_ptr()); }

// A CPU NF4 tensor's buffers as the kernels read them (its mean read to the host).
inline kernels::Nf4Operand nf4_operand(const Nf4Tensor& w) {
  return {w.nf4_dtype(), w.codes.data_ptr<uint8_t>(), w.scalers.data_ptr<int8_t>(), w.factors.data_ptr(),
          w.mean.to(at::kFloat).item<float>(), w.layout};
}

}  // namespace qlora::ops
