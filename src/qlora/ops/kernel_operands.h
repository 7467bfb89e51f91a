// Shared by the CPU kernels' bindings: the element types they take (float32, or bfloat16 as
// uint16_t bit patterns) and typed data pointers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

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

template <class T> const T* in_ptr(const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }
template <class T> T* out_ptr(const at::Tensor& t) { return static_cast<T*>(t.mutable_data_ptr()); }

}  // namespace qlora::ops
