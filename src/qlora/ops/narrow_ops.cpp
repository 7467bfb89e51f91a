#include "qlora/ops/narrow_ops.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#include "kernels/narrow_cpu.h"

namespace qlora::ops {

namespace {

// Throws unless a [m, k] and b [k, n] are 2-D with matching inner sizes.
void check_pair(const char* op, const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0))
    throw std::invalid_argument(std::string(op) + ": cannot multiply " + c10::str(a.sizes()) + " by " + c10::str(b.sizes()));
}

void check_out(const char* op, const at::Tensor& out, int64_t rows, int64_t cols) {
  if (out.dim() != 2 || out.size(0) != rows || out.size(1) != cols)
    throw std::invalid_argument(std::string(op) + ": output is " + c10::str(out.sizes()) + ", expected [" +
                                std::to_string(rows) + ", " + std::to_string(cols) + "]");
}

// Whether the kernels apply: float32 on the CPU, each row-major operand with unit stride along its rows.
bool kernel_ok(std::initializer_list<const at::Tensor*> rows, std::initializer_list<const at::Tensor*> any) {
  for (const at::Tensor* t : rows)
    if (!t->is_cpu() || t->scalar_type() != at::kFloat || t->stride(1) != 1) return false;
  for (const at::Tensor* t : any)
    if (!t->is_cpu() || t->scalar_type() != at::kFloat) return false;
  return true;
}

}  // namespace

void narrow_product_out(const at::Tensor& u, const at::Tensor& x, const at::Tensor& w, double alpha) {
  check_pair("narrow_product", x, w);
  check_out("narrow_product", u, x.size(0), w.size(1));
  if (!kernel_ok({&u, &x}, {&w})) {
    u.addmm_(x, w, 0.0, alpha);
    return;
  }
  kernels::narrow_product_cpu(x.size(0), x.size(1), w.size(1), x.const_data_ptr<float>(), x.stride(0),
                              w.const_data_ptr<float>(), w.stride(0), w.stride(1), static_cast<float>(alpha),
                              u.mutable_data_ptr<float>(), u.stride(0));
}

at::Tensor narrow_product(const at::Tensor& x, const at::Tensor& w, double alpha) {
  check_pair("narrow_product", x, w);
  at::Tensor u = at::empty({x.size(0), w.size(1)}, x.options());
  narrow_product_out(u, x, w, alpha);
  return u;
}

at::Tensor narrow_reduction(const at::Tensor& u, const at::Tensor& x, double alpha) {
  if (u.dim() != 2 || x.dim() != 2 || u.size(0) != x.size(0))
    throw std::invalid_argument("narrow_reduction: cannot multiply the transpose of " + c10::str(u.sizes()) + " by " +
                                c10::str(x.sizes()));
  if (!kernel_ok({&u, &x}, {})) return at::empty({u.size(1), x.size(1)}, x.options()).addmm_(u.t(), x, 0.0, alpha);
  at::Tensor g = at::empty({u.size(1), x.size(1)}, x.options());
  kernels::narrow_reduction_cpu(u.size(0), u.size(1), x.size(1), u.const_data_ptr<float>(), u.stride(0),
                                x.const_data_ptr<float>(), x.stride(0), static_cast<float>(alpha),
                                g.mutable_data_ptr<float>(), g.stride(0));
  return g;
}

void narrow_update_(const at::Tensor& y, const at::Tensor& u, const at::Tensor& v, double alpha) {
  check_pair("narrow_update", u, v);
  check_out("narrow_update", y, u.size(0), v.size(1));
  if (!kernel_ok({&y, &u}, {&v})) {
    y.addmm_(u, v, 1.0, alpha);
    return;
  }
  const at::Tensor vc = v.stride(1) == 1 ? v : v.contiguous();  // rows of v are read as vectors
  kernels::narrow_update_cpu(u.size(0), u.size(1), v.size(1), u.const_data_ptr<float>(), u.stride(0),
                             vc.const_data_ptr<float>(), vc.stride(0), static_cast<float>(alpha),
                             y.mutable_data_ptr<float>(), y.stride(0));
}

}  // namespace qlora::ops
