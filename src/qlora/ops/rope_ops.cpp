#include "qlora/ops/rope_ops.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "kernels/rope_cpu.h"

namespace qlora::ops {

namespace {

bool cpu_float(const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; }

// ATen's ops: out = x * cos, then the rotate-half term added into each half in place.
at::Tensor rope_aten(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor out = x * cos;
  out.narrow(-1, 0, half).addcmul_(x.narrow(-1, half, half), sin.narrow(-1, 0, half), sign);
  out.narrow(-1, half, half).addcmul_(x.narrow(-1, 0, half), sin.narrow(-1, half, half), -sign);
  return out;
}

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign, bool heads_inner) {
  if (x.dim() != 4 || x.size(-1) % 2 != 0 || cos.sizes() != sin.sizes())
    throw std::invalid_argument("rope: x must be [B, H, S, d] with even d, cos and sin of one shape");
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), d = x.size(3);
  const bool shared = cos.dim() == 2 && cos.size(0) == S && cos.size(1) == d;
  const bool per_row = cos.dim() == 4 && cos.size(0) == B && cos.size(1) == 1 && cos.size(2) == S && cos.size(3) == d;
  if (!cpu_float(x) || !cpu_float(cos) || !cpu_float(sin) || x.stride(3) != 1 || !(shared || per_row) ||
      !cos.is_contiguous() || !sin.is_contiguous() || x.numel() == 0)
    return rope_aten(x, cos, sin, sign);
  at::Tensor out = heads_inner ? at::empty({B, S, H, d}, x.options()).transpose(1, 2) : at::empty({B, H, S, d}, x.options());
  kernels::rope_cpu(B, H, S, d, x.const_data_ptr<float>(), {x.stride(0), x.stride(1), x.stride(2)},
                    cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), per_row ? S * d : 0,
                    static_cast<float>(sign), out.mutable_data_ptr<float>(), {out.stride(0), out.stride(1), out.stride(2)});
  return out;
}

}  // namespace qlora::ops
