#include "qlora/ops/rmsnorm_ops.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/rmsnorm_cpu.h"
#include "qlora/ops/kernel_operands.h"

namespace qlora::ops {

namespace {

void check_weight(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  if (x.dim() == 0 || weight.dim() != 1 || weight.size(0) != x.size(-1))
    throw std::invalid_argument(std::string(op) + ": weight must be [n] for x [..., n], got weight of " +
                                std::to_string(weight.dim()) + " dims");
}

// Whether the kernels take x (and the other row operands) with this weight: one dtype throughout.
bool kernel_weight(const at::Tensor& x, const at::Tensor& weight) {
  return kernel_dtype(weight) && weight.scalar_type() == x.scalar_type() && weight.is_contiguous();
}

// The shape of rstd: x's with a last dim of 1.
std::vector<int64_t> row_shape(const at::Tensor& x) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = 1;
  return s;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, kernels::RmsScale scale) {
  check_weight("rms_norm", x, weight);
  const auto rows = rows_of(x);
  const bool recorded = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  if (recorded || !rows || !kernel_weight(x, weight) || x.numel() == 0) {
    at::Tensor h = x.to(at::kFloat);
    const at::Tensor rstd = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    h = h * rstd;
    if (scale == kernels::RmsScale::kOnePlusWeight) return {(h * (weight.to(at::kFloat) + 1.0)).to(x.scalar_type()), rstd};
    if (scale == kernels::RmsScale::kWeightFp32) return {(h * weight.to(at::kFloat)).to(x.scalar_type()), rstd};
    return {weight * h.to(x.scalar_type()), rstd};
  }
  const int64_t n = x.size(-1);
  at::Tensor out = at::empty(x.sizes(), x.options()), rstd = at::empty(row_shape(x), x.options().dtype(at::kFloat));
  with_element(x, [&](auto e) {
    using T = decltype(e);
    kernels::rms_norm_forward_cpu(rows->count, n, in_ptr<T>(x), rows->ld, in_ptr<T>(weight), static_cast<float>(eps),
                                  scale, out_ptr<T>(out), n, out_ptr<float>(rstd));
  });
  return {out, rstd};
}

at::Tensor rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& rstd, kernels::RmsScale scale) {
  check_weight("rms_norm_backward", x, weight);
  if (grad.sizes() != x.sizes()) throw std::invalid_argument("rms_norm_backward: grad must have x's shape");
  const auto g = rows_of(grad), rows = rows_of(x);
  const bool rstd_ok = rstd.is_cpu() && rstd.scalar_type() == at::kFloat && rstd.is_contiguous() &&
                       rstd.numel() == x.numel() / std::max<int64_t>(1, x.size(-1));
  if (!g || !rows || !rstd_ok || grad.scalar_type() != x.scalar_type() || !kernel_weight(x, weight) ||
      x.numel() == 0) {
    at::Tensor w = weight.to(at::kFloat);  // [n]
    if (scale == kernels::RmsScale::kOnePlusWeight) w = w + 1.0;
    at::Tensor gx = grad * w;  // gw, fp32 (a bf16 grad promotes)
    const at::Tensor c = (gx * x).mean(-1, /*keepdim=*/true) * rstd.pow(3);
    gx.mul_(rstd).addcmul_(x, c, -1.0);
    return gx.to(x.scalar_type());
  }
  const int64_t n = x.size(-1);
  at::Tensor gx = at::empty(x.sizes(), x.options());
  with_element(x, [&](auto e) {
    using T = decltype(e);
    kernels::rms_norm_backward_cpu(rows->count, n, in_ptr<T>(grad), g->ld, in_ptr<T>(x), rows->ld, in_ptr<T>(weight),
                                   in_ptr<float>(rstd), scale, out_ptr<T>(gx), n);
  });
  return gx;
}

}  // namespace qlora::ops
