#include "qlora/ops/swiglu_ops.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "kernels/swiglu_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

namespace {

void check_same_shape(const char* op, const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes())
    throw std::invalid_argument(std::string(op) + ": gate and up must have the same shape");
}

bool same_dtype(const at::Tensor& a, const at::Tensor& b) { return a.scalar_type() == b.scalar_type(); }

}  // namespace

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  check_same_shape("swiglu", gate, up);
  const auto g = rows_of(gate), u = rows_of(up);
  if (!g || !u || !same_dtype(gate, up) || gate.numel() == 0) return at::silu(gate) * up;
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  with_element(gate, [&](auto e) {
    using T = decltype(e);
    kernels::swiglu_forward_cpu(g->count, gate.size(-1), in_ptr<T>(gate), g->ld, in_ptr<T>(up), u->ld, out_ptr<T>(out),
                                gate.size(-1));
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  check_same_shape("swiglu_backward", gate, up);
  check_same_shape("swiglu_backward", grad, gate);
  const auto gr = rows_of(grad), g = rows_of(gate), u = rows_of(up);
  if (!gr || !g || !u || !same_dtype(gate, up) || !same_dtype(grad, gate) || gate.numel() == 0)
    return {at::silu_backward(grad * up, gate), grad * at::silu(gate)};
  at::Tensor dg = at::empty(gate.sizes(), gate.options()), du = at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.size(-1);
  with_element(gate, [&](auto e) {
    using T = decltype(e);
    kernels::swiglu_backward_cpu(g->count, n, in_ptr<T>(grad), gr->ld, in_ptr<T>(gate), g->ld, in_ptr<T>(up), u->ld,
                                 out_ptr<T>(dg), n, out_ptr<T>(du), n);
  });
  return {dg, du};
}

}  // namespace qlora::ops
